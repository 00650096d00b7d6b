"""What a request that sets no sampling fields gets: the model's generation config.

As vLLM's ``--generation-config``: ``auto`` reads ``generation_config.json`` from the
model folder, a folder path reads that folder's, ``vllm`` uses none. Only the sampling
fields a request can also set are taken (``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty``); a field neither the request nor the config sets gets
OpenAI's default (temperature 1, no top-p / top-k / min-p, no penalty).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from target_actor.errors import LongSparkError

FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class GenerationConfigError(LongSparkError, ValueError):
    """The generation config asked for cannot be read (one line)."""


def sampling_defaults(model_dir: str | Path, choice: str = "auto") -> dict[str, Any]:
    """The sampling defaults ``choice`` (``auto``, ``vllm`` or a folder) gives."""
    if choice == "vllm":
        return {}
    folder = Path(model_dir) if choice == "auto" else Path(choice)
    path = folder / FILE
    if not path.is_file():
        if choice == "auto":
            return {}
        raise GenerationConfigError(f"--generation-config {choice}: no {FILE} in that folder")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"{path} cannot be read: {exc}") from exc
    if not isinstance(config, dict):
        raise GenerationConfigError(f"{path} is not a JSON object")
    out = {}
    for name in SAMPLING_FIELDS:
        value = config.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    return out
