"""Structured outputs: what a request asks its text to follow, as one llguidance grammar.

OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar`` in Lark) become the
grammar string ``target_actor.grammar`` masks each verified row with. A grammar that does
not compile for the model's tokenizer is the request's error (400 naming the field),
found here before the request is queued.
"""

from __future__ import annotations

import json
from typing import Any

from services.engine.params import InvalidRequest

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


def from_response_format(response_format: dict[str, Any] | None) -> str | None:
    """OpenAI's ``response_format`` -> a grammar (None for plain text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest(
                "response_format json_schema needs json_schema.schema, an object",
                "response_format",
            )
        return json_grammar(schema, "response_format")
    raise InvalidRequest(
        f"response_format type {kind!r} is not one of text, json_object, json_schema",
        "response_format",
    )


def from_structured_outputs(spec: dict[str, Any] | None) -> str | None:
    """vLLM's ``structured_outputs`` (exactly one of json / regex / choice / grammar)."""
    if not spec:
        return None
    given = [k for k in STRUCTURED_KINDS if spec.get(k) is not None]
    unknown = sorted(set(spec) - set(STRUCTURED_KINDS))
    if unknown:
        raise InvalidRequest(
            f"structured_outputs does not take {', '.join(unknown)}", "structured_outputs"
        )
    if len(given) != 1:
        raise InvalidRequest(
            "structured_outputs takes exactly one of json, regex, choice, grammar",
            "structured_outputs",
        )
    from llguidance import LLMatcher

    kind, value = given[0], spec[given[0]]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequest(
                    f"structured_outputs.json is not JSON: {exc}", "structured_outputs"
                ) from None
        if not isinstance(value, dict):
            raise InvalidRequest("structured_outputs.json must be a schema", "structured_outputs")
        return json_grammar(value, "structured_outputs")
    if kind == "regex":
        _need_str(value, "regex")
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or any(not isinstance(c, str) for c in value):
            raise InvalidRequest(
                "structured_outputs.choice must be a list of strings", "structured_outputs"
            )
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    _need_str(value, "grammar")
    return LLMatcher.grammar_from_lark(value)


COMPACT_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def json_grammar(schema: dict[str, Any], field: str, compact: bool = False) -> str:
    """A JSON schema as a grammar; ``compact``: whitespace only as ``json.dumps`` writes
    it (tool calls: a model cannot pad the arguments out to ``max_tokens``)."""
    from llguidance import LLMatcher

    if compact:
        schema = {**schema, "x-guidance": COMPACT_JSON}
    try:
        return LLMatcher.grammar_from_json_schema(schema)
    except ValueError as exc:
        raise InvalidRequest(f"{field}: the JSON schema is not usable: {exc}", field) from None


def _need_str(value: Any, kind: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(
            f"structured_outputs.{kind} must be a non-empty string", "structured_outputs"
        )


class GrammarChecker:
    """Compiles a request's grammar against the model's tokenizer before it is queued."""

    def __init__(self, hf_tokenizer: Any, eos_ids: tuple[int, ...]) -> None:
        self.hf, self.eos = hf_tokenizer, eos_ids
        self._tokenizer = None

    def check(self, grammar: str, field: str) -> None:
        from target_actor.grammar import GrammarError, check_grammar

        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self.hf, eos_token=list(self.eos) or None
            )
        try:
            check_grammar(grammar, self._tokenizer)
        except GrammarError as exc:
            raise InvalidRequest(f"{field}: {exc}", field) from None
