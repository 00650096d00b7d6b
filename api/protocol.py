"""OpenAI HTTP protocol: request and response models (the subset this service speaks).

Requests are parsed strictly (``"5"`` is not an integer here) from the raw JSON body.
Fields the OpenAI API defines but this service does not implement are listed per request
with the value that means "off" (:data:`UNSUPPORTED`); any other value is rejected with a
400 naming the field, never silently ignored. Fields OpenAI does not define are ignored
and reported in the ``X-LongSpark-Warning`` response header. Responses carry OpenAI's
fields plus a ``longspark`` object (mode, rounds, acceptance), which clients that do not
know it ignore.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.engine import structured, tools
from services.engine.params import InvalidRequest, SamplingParams

# field -> the values that mean "not used" (accepted); anything else is a 400
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "functions": (None, []),  # the deprecated spelling of tools
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}

MAX_STOP_SEQUENCES = 16
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP_CHARS = 256
SEED_RANGE = (-(2**63), 2**64 - 1)  # what a torch.Generator takes


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool | None = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, description="tokens to generate at most")
    temperature: float | None = Field(None, description="0 = greedy; default 1")
    top_p: float | None = None
    top_k: int | None = Field(None, description="extension: sample from the k most likely")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(None, description=f"choices per prompt (1 to {MAX_N})")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(None, description="extension: generate past EOS")
    stream_interval: int | None = Field(
        None, ge=1, description="extension: stream every N tokens (at least the server's interval)"
    )
    return_token_ids: bool | None = Field(
        None, description="extension: the generated token ids in `longspark.token_ids`"
    )
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100]")
    # vLLM's extensions
    min_p: float | None = None
    prompt_logprobs: int | None = Field(
        None, description="the prompt tokens' log-probabilities, and this many alternatives"
    )
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: exactly one of json, regex, choice, grammar (Lark)"
    )
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object, or json_schema with json_schema.schema"
    )
    # the OpenAI fields this service does not implement; see UNSUPPORTED
    suffix: Any = None
    best_of: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None

    def check_supported(self) -> None:
        for name, off in UNSUPPORTED.items():
            if name in self.model_fields_set and getattr(self, name) not in off:
                raise InvalidRequest(f"{name} is not supported by this server", name)
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n must lie in [1, {MAX_N}], got {self.n}", "n")

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def num_logprobs(self) -> int | None:
        """Top log-probabilities asked per token: None = none (see the endpoint's field)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """The same per prompt token (vLLM's ``prompt_logprobs``)."""
        return self.prompt_logprobs

    def ignored_fields(self) -> list[str]:
        """Fields OpenAI does not define for this endpoint (ignored, reported in a header)."""
        return sorted(self.model_extra or {})

    def sampling_params(
        self, default_max_tokens: int, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """Validated sampling settings (``InvalidRequest`` names the offending field);
        ``defaults`` fill what the request leaves unset (the model's generation config)."""
        self.check_supported()
        stop = self.stop if self.stop is not None else []
        stop = [stop] if isinstance(stop, str) else list(stop)
        if len(stop) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise InvalidRequest(
                f"stop takes at most {MAX_STOP_SEQUENCES} strings of at most "
                f"{MAX_STOP_CHARS} characters",
                "stop",
            )
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise InvalidRequest("seed must fit in 64 bits", "seed")
        bias = None
        if self.logit_bias:
            if not all(t.isdigit() for t in self.logit_bias):
                raise InvalidRequest("logit_bias keys must be token ids", "logit_bias")
            bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        d = defaults or {}

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else d.get(name, fallback)

        grammar, grammar_field = self.grammar()
        return SamplingParams(  # validates; temperatures below 1e-5 become greedy
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=float(pick("temperature", 1.0)),
            top_p=float(pick("top_p", 1.0)),
            top_k=pick("top_k", 0),
            seed=self.seed,
            stop=stop,
            ignore_eos=bool(self.ignore_eos),
            min_p=float(pick("min_p", 0.0)),
            presence_penalty=float(pick("presence_penalty", 0.0)),
            frequency_penalty=float(pick("frequency_penalty", 0.0)),
            repetition_penalty=float(pick("repetition_penalty", 1.0)),
            logit_bias=bias,
            min_tokens=self.min_tokens or 0,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False,
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            grammar=grammar,
            grammar_field=grammar_field,
            stream_interval=self.stream_interval,
        )

    def grammar(self) -> tuple[str | None, str]:
        """The grammar the output must follow (None: free text) and the field it came from."""
        by_format = structured.from_response_format(self.response_format)
        by_outputs = structured.from_structured_outputs(self.structured_outputs)
        if by_format is not None and by_outputs is not None:
            raise InvalidRequest(
                "give response_format or structured_outputs, not both", "structured_outputs"
            )
        if by_outputs is not None:
            return by_outputs, "structured_outputs"
        return by_format, "response_format"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, description="top log-probabilities per token (0 to 20)")
    echo: bool | None = Field(None, description="the prompt's text before the completion")

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string or token-id list, or a batch of them."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(batch) > MAX_PROMPTS:
            raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        if any(isinstance(q, list) and not q for q in batch) or (isinstance(p, list) and not p):
            raise InvalidRequest("the prompt is empty", "prompt")
        return batch

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs``: the echoed prompt's tokens carry them too."""
        if not self.echo or self.logprobs is None:
            return self.prompt_logprobs
        return max(self.logprobs, self.prompt_logprobs or 0)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    arguments: str


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise InvalidRequest("only text content parts are supported", "messages")
        return "".join(part.text or "" for part in self.content)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = Field(None, description="the chosen tokens' log-probabilities")
    top_logprobs: int | None = Field(None, description="and this many alternatives (0 to 20)")
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without"
    )
    parallel_tool_calls: bool | None = Field(None, description="more than one call (default)")

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or named (a function given by name)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if choice is None:
            return "auto" if self.tools else "none"
        return choice

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools for the prompt (none when ``tool_choice`` is none)."""
        if not self.tools or self.tool_mode == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def named_tool(self) -> dict[str, Any]:
        assert isinstance(self.tool_choice, NamedToolChoice)
        name = self.tool_choice.function.name
        for t in self.tool_dicts() or []:
            if t["function"]["name"] == name:
                return t
        raise InvalidRequest(f"tool_choice names {name!r}, which is not in tools", "tool_choice")

    def grammar(self) -> tuple[str | None, str]:
        mode = self.tool_mode
        if mode in ("required", "named"):
            if not self.tools:
                raise InvalidRequest(f"tool_choice {mode} needs tools", "tool_choice")
            if self.response_format is not None or self.structured_outputs is not None:
                raise InvalidRequest(
                    "tool_choice required or named cannot be combined with "
                    "response_format or structured_outputs",
                    "tool_choice",
                )
            if mode == "named":
                schema = tools.parameters(self.named_tool())
            else:
                schema = tools.required_schema(
                    self.tool_dicts() or [], self.parallel_tool_calls is not False
                )
            return structured.json_grammar(schema, "tools", compact=True), "tools"
        return super().grammar()

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequest("top_logprobs needs logprobs=true", "top_logprobs")
            return None
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages for the chat template ("developer" is the new name of "system"); an
        assistant's tool calls and a tool result's call id ride along."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            msg: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
            }
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None and m.role == "tool":
                msg["name"] = m.name
            out.append(msg)
        return out

    def sampling_params(
        self, default_max_tokens: int, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens, defaults)


# -- responses --------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class LongSparkInfo(BaseModel):
    """Our extras: how the answer was decoded (ignored by OpenAI clients)."""

    mode: str = Field(description="spec (speculative) or ar (plain decoding)")
    rounds: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_accepted_length: float = 0.0
    token_ids: list[int] | None = Field(None, description="with return_token_ids only")


class _ResponseBase(BaseModel):
    """What every completion answer and stream chunk carries besides its choices."""

    id: str
    created: int
    model: str
    usage: Usage | None = None
    longspark: LongSparkInfo | None = None


class CompletionLogprobs(BaseModel):
    """The completions API's log-probabilities: per token its text, offset in the
    choice's text, log-probability, and the most likely tokens there (the chosen one too)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: no context
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry: one token's log-probability at a prompt place."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt token; None for the first


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = None  # the (shared) prompt's, as vLLM puts it


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class CompletionChunk(_ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "longspark"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None

    def template_messages(self) -> list[dict[str, str]] | None:
        """The chat messages as the template takes them (None: a prompt)."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of prompt and messages", "prompt")
        if self.add_generation_prompt is False:
            raise InvalidRequest(
                "add_generation_prompt=false is not supported", "add_generation_prompt"
            )
        if self.messages is None:
            return None
        return ChatCompletionRequest(model="", messages=self.messages).template_messages()

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None = None
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
    request_id: str | None = Field(None, description="the id echoed in X-Request-Id")
