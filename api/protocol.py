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

from services.engine.params import InvalidRequest, SamplingParams

# field -> the values that mean "not used" (accepted); anything else is a 400
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None, False, True),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}

MAX_STOP_SEQUENCES = 16
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
    n: int | None = Field(None, description="choices per prompt (only 1)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(None, description="extension: generate past EOS")
    return_token_ids: bool | None = Field(
        None, description="extension: the generated token ids in `longspark.token_ids`"
    )
    user: str | None = None
    # the OpenAI fields this service does not implement; see UNSUPPORTED
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None

    def check_supported(self) -> None:
        for name, off in UNSUPPORTED.items():
            if name in self.model_fields_set and getattr(self, name) not in off:
                raise InvalidRequest(f"{name} is not supported by this server", name)
        if self.n not in (None, 1):
            raise InvalidRequest("only n=1 is supported", "n")

    def ignored_fields(self) -> list[str]:
        """Fields OpenAI does not define for this endpoint (ignored, reported in a header)."""
        return sorted(self.model_extra or {})

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Validated sampling settings (``InvalidRequest`` names the offending field)."""
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
        temperature = 1.0 if self.temperature is None else float(self.temperature)
        return SamplingParams(  # validates; temperatures below 1e-5 become greedy
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=temperature,
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=stop,
            ignore_eos=bool(self.ignore_eos),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a string or token ids); a batch of several is a 400."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequest("only one prompt per request is supported", "prompt")
            p = p[0]
        if isinstance(p, list) and not p:
            raise InvalidRequest("the prompt is empty", "prompt")
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise InvalidRequest("only text content parts are supported", "messages")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def template_messages(self) -> list[dict[str, str]]:
        """Messages for the chat template ("developer" is the new name of "system")."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(_ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
    request_id: str | None = Field(None, description="the id echoed in X-Request-Id")
