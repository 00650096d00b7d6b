"""Fixtures of the API tests: a tiny chat model and engines over it (spec and plain)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.async_engine import AsyncEngine
from services.engine.backends import EngineOptions, build_engine
from tests.conftest import make_tiny_chat_model


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def engine(tiny_chat):
    eng, close = build_engine(
        EngineOptions(
            target=str(tiny_chat), drafter="random", k=4, max_num_seqs=8, kv_cache_tokens=8192
        )
    )
    runner = AsyncEngine(eng)
    yield runner
    runner.shutdown()
    close()


@pytest.fixture(scope="module")
def plain(tiny_chat):
    eng, close = build_engine(EngineOptions(target=str(tiny_chat), mode="ar", kv_cache_tokens=4096))
    yield eng
    close()
