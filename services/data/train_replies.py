"""Drafter training data from ShareGPT's own replies, labelled by the target at train time.

Regenerating responses with the target costs a decode step per token; ShareGPT's own first
reply to each prompt costs nothing. Those replies are not the target's text, so the
trainer does not learn them: the tap cache stores the target's greedy next token after
every row, a slot's label is that token, and a slot counts only while the reply before
it agrees with the target (``views.block_labels``). Anchors still see the target's real
hidden states and K/V rows over a real context, so the drafter learns from many more
contexts than regeneration could afford on a CPU.

The folder has the layout of ``train_data`` (manifest + 64-record shards of token ids,
``finish_reason`` ``"stop"`` for a whole reply, ``"length"`` for one cut at
``max_tokens``) with ``"responses": "sharegpt"`` in the manifest. Prompts come in the
seeded order ``train_data`` uses, after the first ``skip_prompts`` of it, which are left
to the target-regenerated set, so the two sets never share a prompt.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from services.data.prompts import (
    SHAREGPT,
    Prompt,
    PromptSetError,
    load_prompts,
    load_sharegpt_replies,
)
from services.data.train_data import (
    FORMAT_VERSION,
    MAX_PROMPT_TOKENS,
    SHARD_SIZE,
    TrainDataError,
    TrainRecord,
    _add_shard,
    _locked,
    _read_manifest,
    _write_manifest,
    check_positive,
    check_skip,
)


def build_reply_data(
    out_dir: str | os.PathLike[str],
    num_prompts: int,
    skip_prompts: int = 0,
    max_tokens: int = 256,
    target: str | None = None,
    seed: int = 0,
    prompts: list[Prompt] | None = None,
    replies: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Write up to ``num_prompts`` reply records to an empty ``out_dir``; returns the manifest.

    ``prompts`` / ``replies`` replace ShareGPT's (tests); ``target`` is a local Hugging
    Face folder, ``None`` the default model (its tokenizer and chat template are used).
    """
    from services.engine.tokenizer import Tokenizer
    from target_actor.checkpoint import ModelFetchError, resolve_target
    from target_actor.config import ModelConfig

    check_positive(num_prompts=num_prompts, max_tokens=max_tokens)
    check_skip(skip_prompts)
    try:
        path = resolve_target(target)
        pool = load_prompts("sharegpt") if prompts is None else list(prompts)
        replies = load_sharegpt_replies() if replies is None else replies
    except (ModelFetchError, PromptSetError) as exc:
        raise TrainDataError(str(exc)) from exc
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out / ".lock"):
        if any(p.name != ".lock" for p in out.iterdir()):
            raise TrainDataError(f"{out} is not empty; use a new folder")
        tok = Tokenizer(path)
        if not tok.has_chat_template:
            raise TrainDataError(f"{path.name} has no chat template")
        random.Random(seed).shuffle(pool)  # the order train_data regenerates in
        cfg = ModelConfig.from_pretrained(path)
        manifest: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "model": path.name,
            "source": f"sharegpt replies ({SHAREGPT})" if prompts is None else "custom",
            "responses": "sharegpt",
            "chat_template": True,
            "max_tokens": max_tokens,
            "seed": seed,
            "skip_prompts": skip_prompts,
            "max_prompt_tokens": MAX_PROMPT_TOKENS,
            "vocab_size": cfg.vocab_size,
            "eos_token_ids": list(cfg.eos_token_ids),
            "num_prompts": num_prompts,
        }
        shards: dict[str, list[TrainRecord]] = {}
        _write_manifest(out, manifest, shards)
        batch: list[TrainRecord] = []
        for rec in _records(pool[skip_prompts:], replies, tok, max_tokens, num_prompts):
            batch.append(rec)
            if len(batch) == SHARD_SIZE:
                _add_shard(out, manifest, shards, batch)
                batch = []
        if batch:
            _add_shard(out, manifest, shards, batch)
        if not shards:
            raise TrainDataError("no prompt after skip_prompts has a usable reply")
    return _read_manifest(out)


def _records(pool, replies, tok, max_tokens, limit):
    """Chat-encoded prompts with their reply's token ids, at most ``limit`` of them."""
    made = 0
    for p in pool:
        if made == limit:
            return
        reply = replies.get(p.id, "")
        if not reply:
            continue
        prompt_ids = tok.encode_chat([{"role": "user", "content": p.prompt}])
        if len(prompt_ids) > MAX_PROMPT_TOKENS:
            continue
        ids = list(tok.hf(reply, add_special_tokens=False).input_ids)
        reason = "length" if len(ids) > max_tokens else "stop"
        made += 1
        yield TrainRecord(p.id, prompt_ids, ids[:max_tokens], reason)
