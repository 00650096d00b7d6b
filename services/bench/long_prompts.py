"""Long prompts from real text: benchmark articles or problems concatenated, then a question.

``xsum`` concatenates XSum news articles and asks for a one-sentence summary of the last
one; ``humaneval`` concatenates HumanEval problems and asks to complete the last one.
The body is cut on a token boundary so that the chat-encoded prompt is ``num_tokens``
long, give or take the few tokens a re-encode at the cut may move.
"""

from __future__ import annotations

from services.data.prompts import load_prompts
from services.engine.tokenizer import Tokenizer

SOURCES = {  # name -> (prompt set, heading, separator, question)
    "xsum": (
        "xsum",
        "Read these news articles.\n\n",
        "\n\n---\n\n",
        "\n\nSummarize the last article above in one sentence.",
    ),
    "humaneval": (
        "humaneval",
        "Here are some Python functions to implement.\n\n",
        "\n\n",
        "\n\nComplete the last function above. Answer with Python code only.",
    ),
}


def long_prompts(
    tok: Tokenizer, source: str, num_tokens: int, count: int
) -> list[list[dict[str, str]]]:
    """``count`` chat prompts of ``num_tokens`` tokens, each starting at a different item."""
    if source not in SOURCES:
        raise ValueError(f"unknown long-prompt source {source!r}; choose from {', '.join(SOURCES)}")
    name, head, sep, question = SOURCES[source]
    items = [p.text for p in load_prompts(name)]
    overhead = len(tok.encode_chat([{"role": "user", "content": head + question}]))
    budget = num_tokens - overhead
    if budget < 16:
        raise ValueError(f"a {num_tokens}-token prompt leaves no room for text")
    out = []
    for n in range(count):
        i = (n * 37) % len(items)  # spread the starting item over the set
        parts: list[str] = []
        chars, want_chars = 0, 6 * budget  # generous: English runs ~4 characters per token
        while True:
            while chars < want_chars:
                parts.append(items[i % len(items)])
                chars, i = chars + len(parts[-1]), i + 1
            body_ids = tok.hf(sep.join(parts), add_special_tokens=False).input_ids
            if len(body_ids) >= budget:
                break
            want_chars *= 2
        body = tok.hf.decode(body_ids[:budget])
        out.append([{"role": "user", "content": head + body + question}])
    return out
