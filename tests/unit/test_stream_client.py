"""The load client against a real socket: a small asyncio server writes the HTTP/1.1
responses an OpenAI server sends (chunked event streams, JSON bodies with a length)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.bench.http_load import StreamClient, StreamError, run_client


def _chunks(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p)


def _chunked(parts: list[bytes]) -> bytes:
    """A whole chunked body: the parts, then the last (empty) chunk."""
    return _chunks(parts) + b"0\r\n\r\n"


def _events(*events: dict | str) -> list[bytes]:
    out = []
    for e in events:
        data = e if isinstance(e, str) else json.dumps(e)
        out.append(f"data: {data}\n\n".encode())
    return out


async def _serve(respond) -> tuple[asyncio.Server, str, list[bytes]]:
    """A server that reads one request (head and body) and answers ``respond(head)``
    (bytes, or a list written with a pause between them). Returns it, its URL and the
    requests it saw."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = [
            int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        ]  # fmt: skip
        body = await reader.readexactly(length[0]) if length else b""
        seen.append(head + body)
        answer = respond(head)
        for piece in answer if isinstance(answer, list) else [answer]:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.005)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", seen


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _json_response(status: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode() + data


def test_events_arrive_as_dicts_across_split_chunks_and_stop_at_done():
    events = _events(
        {"choices": [{"delta": {"content": "Hel"}}]},
        {"choices": [{"delta": {"content": "lo"}}]},
        {"choices": [], "usage": {"completion_tokens": 2}},
        "[DONE]",
    )
    stream = b"".join(events)
    # the event stream cut at odd places: a line may span HTTP chunks and TCP writes
    parts = [stream[:7], stream[7:60], stream[60:61], stream[61:]]

    async def main():
        server, url, seen = await _serve(
            lambda head: [
                STREAM_HEAD + _chunks(parts[:2]),
                _chunked(parts[2:]),
            ]
        )
        async with server:
            client = StreamClient(url, api_key="k1")
            got = [e async for e in client.stream_chat({"stream": True, "max_tokens": 2})]
        return got, seen

    got, seen = run_client(main())
    assert [e.get("usage") or e["choices"][0]["delta"]["content"] for e in got] == [
        "Hel",
        "lo",
        {"completion_tokens": 2},
    ]
    head, _, body = seen[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1")
    assert b"Authorization: Bearer k1" in head
    assert json.loads(body) == {"stream": True, "max_tokens": 2}


def test_a_refusal_raises_with_the_servers_message():
    async def main():
        server, url, _ = await _serve(
            lambda head: _json_response(
                "400 Bad Request", {"error": {"message": "max_tokens must be >= 1"}}
            )
        )
        async with server:
            with pytest.raises(StreamError, match=r"HTTP 400: max_tokens must be >= 1"):
                async for _ in StreamClient(url).stream_chat({"stream": True}):
                    pass

    run_client(main())


def test_an_error_event_in_the_stream_raises_it():
    events = _events({"choices": [{"delta": {"content": "a"}}]}, {"error": {"message": "boom"}})

    async def main():
        server, url, _ = await _serve(lambda head: STREAM_HEAD + _chunked(events))
        async with server:
            got = []
            with pytest.raises(StreamError, match="boom"):
                async for e in StreamClient(url).stream_chat({"stream": True}):
                    got.append(e)
            return got

    assert len(run_client(main())) == 1


def test_a_connection_dropped_mid_stream_raises():
    events = _events({"choices": [{"delta": {"content": "a"}}]})

    async def main():
        # the chunked body never ends: the server closes after one event
        server, url, _ = await _serve(lambda head: STREAM_HEAD + _chunks(events))
        async with server:
            with pytest.raises(Exception, match="closed|connection|Connection"):
                async for _ in StreamClient(url).stream_chat({"stream": True}):
                    pass

    run_client(main())


def test_model_lists_the_first_id_and_a_bad_url_is_refused():
    async def main():
        server, url, seen = await _serve(
            lambda head: _json_response("200 OK", {"data": [{"id": "m0"}, {"id": "m1"}]})
        )
        async with server:
            return await StreamClient(url + "/").model(), seen

    model, seen = run_client(main())
    assert model == "m0"
    assert seen[0].startswith(b"GET /v1/models HTTP/1.1")
    with pytest.raises(ValueError, match="not an http"):
        StreamClient("localhost:8000")
