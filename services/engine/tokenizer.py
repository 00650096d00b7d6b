"""The target's tokenizer: prompt encoding (raw or chat template) and decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.engine import tools as tool_calls
from services.engine.params import InvalidRequest


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path))
        self.eos_token_id = self.hf.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens).input_ids)

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Apply the model's chat template, ending with the assistant's turn opener; tools,
        earlier calls and their results as the template takes them, or folded into plain
        messages when it does not (``services.engine.tools``)."""
        if not self.has_chat_template:
            raise InvalidRequest(
                "this model has no chat template; use the completions API", "messages"
            )
        kwargs: dict[str, Any] = {}
        if tool_calls.template_takes_tools(self.hf.chat_template):
            kwargs["tools"] = tools
        else:
            messages = tool_calls.fold_into_messages(messages, tools)
        text = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        return list(self.hf(text, add_special_tokens=False).input_ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
