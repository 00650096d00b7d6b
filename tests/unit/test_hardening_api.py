"""Hardening of the HTTP API over a real in-process engine (tiny random model, no Ray).

Limits (max_tokens cap, prompt tokens, body size, waiting queue, queue time-out),
overload answers with Retry-After, security (several API keys, constant-time compare,
keys never shown, CORS off by default, request ids), draining, client disconnects over a
real socket, and inputs that used to reach the engine unchecked. Every error is OpenAI's
error JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.errors import to_api_error
from api.lifecycle import Lifecycle
from api.serving import OpenAIServing, ServingSettings
from services.engine.async_engine import AsyncEngine, EngineLimits, GenerateRequest
from services.engine.backends import EngineOptions, build_engine
from services.engine.params import SamplingParams
from tests.conftest import make_tiny_chat_model
from tests.serving_helpers import freed, uvicorn_server, wait_stats

MODEL = "tiny-chat"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory) -> Path:
    """The tiny chat model with a 4K context, so a request can run for a while."""
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def engines(tiny_long):
    """``make(**limits)``: an AsyncEngine over a fresh plain engine with one running slot."""
    made = []

    def make(max_num_seqs: int = 1, mode: str = "ar", **limits) -> AsyncEngine:
        opts = EngineOptions(
            target=str(tiny_long), mode=mode, max_num_seqs=max_num_seqs, kv_cache_tokens=16384
        )
        if mode == "spec":
            opts.drafter, opts.k = "random", 3
        eng, close = build_engine(opts)
        runner = AsyncEngine(eng, limits=EngineLimits(**limits))
        made.append((runner, close))
        return runner

    yield make
    for runner, close in made:
        runner.shutdown()
        close()


def make_app(engine, lifecycle=None, **settings):
    settings = ServingSettings(model_name=MODEL, **settings)
    return create_app(OpenAIServing(engine, settings), lifecycle)


def http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def run(coro):
    return asyncio.run(coro)


def body(**kw):
    return {"model": MODEL, "prompt": "Hello world", "max_tokens": 4, **kw}


LONG = body(max_tokens=3000, ignore_eos=True)  # runs for seconds on the tiny model


def is_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    doc = r.json()
    assert set(doc["error"]) == {"message", "type", "param", "code"} and doc["error"]["message"]
    assert doc["request_id"] == r.headers["x-request-id"]
    return doc["error"]


async def until_running(engine: AsyncEngine, n: int = 1) -> None:
    for _ in range(500):
        if (await engine.stats())["num_running"] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request never started")


# -- limits ---------------------------------------------------------------------------
def test_max_tokens_cap(engines):
    app = make_app(engines(), max_tokens_limit=8)

    async def go():
        async with http(app) as c:
            over = await c.post("/v1/completions", json=body(max_tokens=9))
            at = await c.post("/v1/completions", json=body(max_tokens=8, ignore_eos=True))
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            default = await c.post("/v1/chat/completions", json={**chat, "ignore_eos": True})
            return over, at, default

    over, at, default = run(go())
    assert is_openai_error(over, 400)["param"] == "max_tokens"
    assert at.status_code == 200 and at.json()["usage"]["completion_tokens"] == 8
    # a chat request without max_tokens gets the cap, not the 512 default
    assert default.status_code == 200 and default.json()["usage"]["completion_tokens"] == 8


def test_max_prompt_tokens(engines):
    app = make_app(engines(max_prompt_tokens=8))

    async def go():
        async with http(app) as c:
            long = await c.post("/v1/completions", json=body(prompt=list(range(9))))
            ok = await c.post("/v1/completions", json=body(prompt=list(range(8))))
            return long, ok

    long, ok = run(go())
    assert is_openai_error(long, 400)["code"] == "context_length_exceeded"
    assert ok.status_code == 200


def test_body_size_limit_holds_for_declared_and_chunked_bodies(engines):
    app = make_app(engines(), max_request_bytes=2048)
    big = json.dumps(body(prompt="x" * 5000)).encode()

    async def chunks():
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    async def go():
        async with http(app) as c:
            declared = await c.post("/v1/completions", content=big)
            chunked = await c.post("/v1/completions", content=chunks())  # no content-length
            return declared, chunked

    for r in run(go()):
        assert is_openai_error(r, 413)["code"] == "request_too_large"


def test_full_waiting_queue_answers_429_with_retry_after(engines):
    engine = engines(max_num_seqs=1, max_waiting=1)
    app = make_app(engine)

    async def go():
        async with http(app) as c:
            running = asyncio.create_task(c.post("/v1/completions", json=LONG))
            await until_running(engine)
            waiting = asyncio.create_task(c.post("/v1/completions", json=body()))
            for _ in range(500):
                if (await engine.stats())["num_waiting"] == 1:
                    break
                await asyncio.sleep(0.01)
            refused = await c.post("/v1/completions", json=body())
            running.cancel()  # the client of the long request goes away
            await asyncio.gather(running, return_exceptions=True)
            return refused, await waiting, await engine.stats()

    refused, waited, stats = run(go())
    err = is_openai_error(refused, 429)
    assert err["code"] == "server_busy" and int(refused.headers["retry-after"]) >= 1
    assert waited.status_code == 200  # the waiting one ran once the slot was free
    assert stats["overloaded"] >= 1


def test_an_api_at_its_in_flight_cap_answers_429_and_serves_the_rest(engines):
    """The cap an engine replica with the API inside keeps in place of Serve's queue."""
    from api.lifecycle import Lifecycle

    engine = engines()
    app = make_app(engine, lifecycle=Lifecycle(max_in_flight=1))

    async def go():
        async with http(app) as c:
            running = asyncio.create_task(c.post("/v1/completions", json=LONG))
            await until_running(engine)
            refused = await c.post("/v1/completions", json=body())
            models = await c.get("/v1/models")  # not generation: never capped
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            return refused, models, await c.post("/v1/completions", json=body())

    refused, models, after = run(go())
    err = is_openai_error(refused, 429)
    assert err["code"] == "server_busy" and int(refused.headers["retry-after"]) >= 1
    assert models.status_code == 200 and after.status_code == 200


def test_queue_timeout_answers_503_with_retry_after(engines):
    engine = engines(max_num_seqs=1, queue_timeout_s=0.5)
    app = make_app(engine)

    async def go():
        async with http(app) as c:
            running = asyncio.create_task(c.post("/v1/completions", json=LONG))
            await until_running(engine)
            t0 = time.monotonic()
            timed_out = await c.post("/v1/completions", json=body(stream=True))
            waited = time.monotonic() - t0
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            stale = GenerateRequest(SamplingParams(max_tokens=2), prompt="Hi")
            stale.arrival_time -= 10  # it already spent 10 s queued in front of the engine
            (result,) = await engine.admit([stale])
            return timed_out, waited, result

    timed_out, waited, stale = run(go())
    err = is_openai_error(timed_out, 503)  # streamed requests too: before the first byte
    assert err["code"] == "queue_timeout" and timed_out.headers["retry-after"]
    assert waited < 30
    assert to_api_error(stale).code == "queue_timeout"


def test_serve_back_pressure_is_429_with_retry_after():
    from ray.serve.exceptions import BackPressureError

    import services.serving.errors  # noqa: F401 - Serve's exceptions are mapped there

    err = to_api_error(BackPressureError(num_queued_requests=9, max_queued_requests=8))
    assert (err.status, err.code) == (429, "server_busy") and "Retry-After" in err.headers()


# -- security -------------------------------------------------------------------------
def test_several_api_keys_and_no_key_leaks(engines, caplog):
    keys = ("key-one", "key-two")
    app = make_app(engines(), api_keys=keys)

    async def go():
        async with http(app) as c:
            out = {}
            for name, hdr in [
                ("none", {}),
                ("wrong", {"Authorization": "Bearer key-three"}),
                ("scheme", {"Authorization": "Basic key-one"}),
                ("one", {"Authorization": "Bearer key-one"}),
                ("two", {"Authorization": "Bearer key-two"}),
            ]:
                out[name] = await c.post("/v1/completions", json=body(), headers=hdr)
            out["debug"] = await c.get("/debug/engine")
            return out

    with caplog.at_level(logging.DEBUG):
        r = run(go())
    for name in ("none", "wrong", "scheme", "debug"):
        assert is_openai_error(r[name], 401)["type"] == "authentication_error"
    assert r["one"].status_code == 200 and r["two"].status_code == 200
    shown = caplog.text + "".join(x.text for x in r.values())
    assert not any(k in shown for k in keys)
    settings = ServingSettings(model_name=MODEL, api_key="key-one", api_keys=keys)
    assert "key-" not in repr(settings)


def test_keys_compared_in_constant_time_against_every_key(monkeypatch):
    import hmac

    from api import auth

    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    assert auth.key_matches("b", ["a", "b", "c"])
    assert len(calls) == 3  # no early exit on the match
    assert not auth.key_matches("d", ["a", "b", "c"]) and len(calls) == 6


def test_api_keys_from_env_and_file(tiny_checkpoints, tmp_path, monkeypatch):
    from services.serving.config import API_KEY_ENV, API_KEY_FILE_ENV, ServeArgs

    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\nfile-key-1\n\nfile-key-2  # old\n")
    monkeypatch.setenv(API_KEY_ENV, "env-a, env-b")
    monkeypatch.setenv(API_KEY_FILE_ENV, str(key_file))
    args = ServeArgs(target=str(tiny_checkpoints["qwen3"])).resolved()
    assert args.api_keys == ["env-a", "env-b", "file-key-1", "file-key-2"]
    assert "env-a" not in repr(args) and "file-key" not in repr(args)


def test_binds_localhost_unless_told():
    from services.cli.main import build_parser
    from services.serving.launch import settings_from

    _, host, _ = settings_from(build_parser().parse_args(["serve"]))
    assert host == "127.0.0.1"
    _, host, _ = settings_from(build_parser().parse_args(["serve", "--host", "0.0.0.0"]))
    assert host == "0.0.0.0"


def test_cors_is_off_unless_configured(engines):
    engine = engines()
    preflight = {
        "Origin": "https://evil.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }

    async def go(app):
        async with http(app) as c:
            pre = await c.options("/v1/completions", headers=preflight)
            post = await c.post(
                "/v1/completions", json=body(), headers={"Origin": preflight["Origin"]}
            )
            return pre, post

    pre, post = run(go(make_app(engine)))
    assert "access-control-allow-origin" not in pre.headers
    assert "access-control-allow-origin" not in post.headers
    pre, post = run(go(make_app(engine, cors_origins=("https://evil.example",))))
    assert pre.headers["access-control-allow-origin"] == "https://evil.example"
    assert post.headers["access-control-allow-origin"] == "https://evil.example"


def test_request_id_echoed_in_errors_and_logs(engines, caplog):
    app = make_app(engines())

    async def go():
        async with http(app) as c:
            given = await c.post(
                "/v1/completions", json=body(model="nope"), headers={"X-Request-Id": "abc-123"}
            )
            made = await c.post("/v1/completions", content=b"{oops")
            bad = await c.get("/v1/models", headers={"X-Request-Id": "x" * 1000})
            ok = await c.get("/v1/models", headers={"X-Request-Id": "ok-1"})
            return given, made, bad, ok

    given, made, bad, ok = run(go())
    assert given.headers["x-request-id"] == "abc-123" and given.json()["request_id"] == "abc-123"
    assert re.fullmatch(r"[0-9a-f]{32}", made.json()["request_id"])
    assert made.headers["x-request-id"] == made.json()["request_id"]
    assert len(bad.headers["x-request-id"]) == 32  # an unusable id is replaced
    assert ok.headers["x-request-id"] == "ok-1"

    from api.errors import log as api_log

    async def broken(self, req):
        raise KeyError("unexpected")

    async def boom():
        async with http(app) as c:
            headers = {"X-Request-Id": "trace-me"}
            return await c.post("/v1/completions", json=body(), headers=headers)

    original = OpenAIServing.completions
    OpenAIServing.completions = broken  # an unexpected exception inside the route
    try:
        with caplog.at_level(logging.ERROR, logger=api_log.name):
            r = run(boom())
    finally:
        OpenAIServing.completions = original
    assert r.status_code == 500 and r.json()["request_id"] == "trace-me"
    assert "[request trace-me]" in caplog.text


def test_no_pickle_or_eval_of_client_input():
    """Nothing on the request path deserialises with pickle, evaluates code or loads YAML
    unsafely: bodies are JSON parsed by pydantic, chat templates render in Jinja's sandbox."""
    files = [*ROOT.glob("api/*.py"), ROOT / "services/engine/async_engine.py"]
    files += ROOT.glob("services/serving/*.py")
    pattern = re.compile(r"\b(pickle|marshal|cloudpickle|shelve)\b|\beval\(|\bexec\(|yaml\.load\(")
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{path.name}:{n}: {line.strip()}"


# -- inputs that must be 4xx, never 5xx ------------------------------------------------
@pytest.mark.parametrize(
    "extra,param,code",
    [
        ({"prompt": "\ud800"}, None, "json_invalid"),  # a lone surrogate: not valid JSON text
        ({"seed": 2**70}, "seed", "invalid_value"),
        ({"stop": ["x"] * 17}, "stop", "invalid_value"),
        ({"stop": "y" * 300}, "stop", "invalid_value"),
    ],
)
def test_bad_inputs_are_400(engines, extra, param, code):
    app = make_app(engines())
    raw = json.dumps(body(**extra))  # json.dumps escapes the surrogate as \ud800

    async def go():
        async with http(app) as c:
            headers = {"content-type": "application/json"}
            return await c.post("/v1/completions", content=raw, headers=headers)

    err = is_openai_error(run(go()), 400)
    assert (err["param"], err["code"]) == (param, code)


def test_odd_but_valid_inputs_are_served(engines):
    app = make_app(engines())

    async def go():
        async with http(app) as c:
            tiny_t = await c.post("/v1/completions", json=body(temperature=1e-300))
            greedy = await c.post("/v1/completions", json=body(temperature=0))
            odd_key = await c.post("/v1/completions", json={**body(), "ünïcode\u2028key": 1})
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}
            surrogate_chat = await c.post(
                "/v1/chat/completions",
                content=json.dumps(chat),
                headers={"content-type": "application/json"},
            )
            model = await c.get("/v1/models/%ED%A0%80")
            return tiny_t, greedy, odd_key, surrogate_chat, model

    tiny_t, greedy, odd_key, surrogate_chat, model = run(go())
    assert tiny_t.status_code == 200 and tiny_t.json()["choices"] == greedy.json()["choices"]
    assert odd_key.status_code == 200 and odd_key.headers["x-longspark-warning"].isascii()
    assert is_openai_error(surrogate_chat, 400)["code"] == "json_invalid"
    assert model.status_code == 404


def test_openapi_documents_the_request_bodies(engines):
    async def go():
        async with http(make_app(engines())) as c:
            return (await c.get("/openapi.json")).json()

    doc = run(go())
    op = doc["paths"]["/v1/completions"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert (
        ref.endswith("/CompletionRequest") and "CompletionRequest" in doc["components"]["schemas"]
    )
    assert "StreamOptions" in doc["components"]["schemas"]
    assert {"400", "401", "413", "429", "503"} <= set(op["responses"])


# -- draining --------------------------------------------------------------------------
def test_drain_refuses_new_requests_and_lets_in_flight_ones_finish(engines):
    engine = engines(max_num_seqs=2)
    lifecycle = Lifecycle()
    app = make_app(engine, lifecycle)

    async def go():
        async with http(app) as c:
            in_flight = asyncio.create_task(
                c.post("/v1/completions", json=body(max_tokens=300, ignore_eos=True, stream=True))
            )
            await until_running(engine)
            lifecycle.drain()
            refused = await c.post("/v1/completions", json=body())
            health = await c.get("/health")
            models = await c.get("/v1/models")  # reads still work
            idle = await lifecycle.wait_idle(60)
            return refused, health, models, idle, await in_flight

    refused, health, models, idle, finished = run(go())
    assert is_openai_error(refused, 503)["code"] == "shutting_down"
    assert refused.headers["retry-after"] and health.status_code == 503
    assert models.status_code == 200 and idle and lifecycle.in_flight == 0
    assert finished.status_code == 200 and finished.text.endswith("data: [DONE]\n\n")
    assert '"finish_reason":"length"' in finished.text


# -- client disconnects over a real socket ---------------------------------------------
def test_disconnects_at_any_point_free_the_sequence(engines):
    """A client leaving while queued, before its non-streamed answer, or mid-stream frees
    its KV blocks and drafter state; the engine does not finish the abandoned work."""
    engine = engines(max_num_seqs=1, mode="spec")
    app = make_app(engine)
    with uvicorn_server(app) as url:
        with httpx.Client(base_url=url, timeout=120) as c:
            # 1. non-streamed: the client times out (closes the socket) after 1 s
            t0 = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=LONG, timeout=httpx.Timeout(120, read=1.0))
            stats = wait_stats(url, freed, timeout=30)
            assert freed(stats), stats
            assert time.monotonic() - t0 < 30
            assert stats["engine"]["num_generated_tokens"] < 3000  # stopped, not finished
            # 2. mid-stream, and 3. while queued behind it
            with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                lines = r.iter_lines()
                while not next(lines).startswith("data: "):
                    pass
                with pytest.raises(httpx.ReadTimeout):  # queued behind the stream, gives up
                    c.post("/v1/completions", json=body(), timeout=httpx.Timeout(60, read=0.5))
                stats = wait_stats(url, lambda s: s["num_waiting"] == 0, timeout=30)
                assert stats["num_waiting"] == 0 and stats["num_running"] == 1
            stats = wait_stats(url, freed, timeout=30)
            assert freed(stats), stats
            assert c.post("/v1/completions", json=body()).status_code == 200


# -- the load test's own guard rails ----------------------------------------------------
def test_loadtest_only_targets_loopback(capsys):
    from services.cli.main import main

    assert main(["loadtest", "--url", "http://10.1.2.3:8000", "--requests", "1"]) == 2
    assert "loopback" in capsys.readouterr().err


def test_loadtest_plan_is_bounded_and_mixed():
    from services.bench.loadtest import LoadTestConfig, plan

    jobs = plan(LoadTestConfig(requests=300, disconnect_fraction=0.2, sampled_fraction=0.3))
    assert len(jobs) == 300
    for attr in ("chat", "stream", "greedy"):
        assert 0 < sum(getattr(j, attr) for j in jobs) < 300
    assert 20 < sum(j.disconnect_after is not None for j in jobs) < 120


# -- the soak's own guard rails and judgement -------------------------------------------
def test_soak_only_targets_loopback_and_needs_time_after_warmup(capsys):
    from services.cli.main import main

    assert main(["soak", "--url", "http://10.1.2.3:8000", "--duration", "5"]) == 2
    assert "loopback" in capsys.readouterr().err
    assert main(["soak", "--duration", "5", "--warmup", "5"]) == 2
    assert "--warmup" in capsys.readouterr().err


def test_soak_judges_growth_after_warmup_only():
    from services.bench.soak import SoakReport, rss_growth

    samples = [
        {"t_s": 10, "rss": {"a[1]": 50, "b[2]": 100}},  # warm-up: not judged
        {"t_s": 20, "rss": {"a[1]": 100, "b[2]": 100, "pooled[3]": 7}},
        {"t_s": 30, "rss": {"a[1]": 104, "b[2]": 120}},  # pooled[3] ended: not judged
    ]
    growth = rss_growth(samples, warmup_s=15)
    assert growth == {"a[1]": 0.04, "b[2]": 0.2}
    assert rss_growth(samples[:2], warmup_s=15) == {}  # one sample judges nothing

    ok = SoakReport(requests=10, rss_growth={"a[1]": 0.04}, max_growth=0.05)
    assert ok.passed
    assert not SoakReport(requests=10, rss_growth={"b[2]": 0.2}, max_growth=0.05).passed
    assert not SoakReport(requests=10, failed=1, max_growth=0.05).passed
    assert not SoakReport(requests=0, max_growth=0.05).passed
    assert not SoakReport(requests=10, object_store_growth=10 * 2**20).passed


def test_soak_reads_the_object_store_until_it_settles():
    """The last requests' objects are freed a moment after their answers: the soak judges
    the store once it is back (or after ``settle_s``), not the instant the load stops."""
    from services.bench import soak

    class Server:
        def __init__(self, values):
            self.values = list(values)

        async def get(self, path):
            value = self.values.pop(0) if len(self.values) > 1 else self.values[0]
            return httpx.Response(200, json={"object_store": {"bytes_used": value}})

    start = 100_000
    draining = Server([1_400_000, 900_000, start])
    assert asyncio.run(soak._settled_store(draining, start, settle_s=5)) <= start + 2**20
    stuck = Server([9_000_000])
    assert asyncio.run(soak._settled_store(stuck, start, settle_s=0.6)) == 9_000_000
