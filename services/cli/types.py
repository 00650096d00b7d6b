"""argparse types and the parser class every ``longspark`` subcommand uses."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any
from urllib.parse import urlparse


class Parser(argparse.ArgumentParser):
    """Errors in one line, no usage dump (``longspark: error: ...``, exit status 2)."""

    def error(self, message: str) -> None:
        self.exit(2, f"longspark: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def gpu_share(text: str) -> float:
    """A share of one GPU, in (0, 1] (Ray packs fractional GPUs onto one device)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {value:g}")
    return value


def torch_device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. ``1,4,16``."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [positive_int(t) for t in parts]


def key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``; the value parsed as JSON when it is JSON, else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def require_loopback(url: str, what: str) -> None:
    """Load generators aim at this machine only: refuse any other host, naming ``what``."""
    host = urlparse(url).hostname or ""
    if host not in ("localhost", "::1") and not host.startswith("127."):
        raise ValueError(f"{what} only targets loopback addresses, not {host!r}")
