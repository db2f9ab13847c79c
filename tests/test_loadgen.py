"""The load generator: its HTTP/SSE parser, several client processes against one, the client's own health,
and its failures (a stream cut mid-way, a dead worker, a server that is down). Speed stays out: `mvllm bench
--selftest` and experiments/client_ceiling.py measure it."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from mvllm.bench import client
from mvllm.bench.health import summarize_client, warning
from mvllm.bench.http import ResponseParser
from mvllm.bench.loadgen import ClientError, _next, deal, generate, run_loop
from mvllm.bench.metrics import summarize
from mvllm.bench.request import Request
from mvllm.bench.stub import MODEL, StubServer

EVENTS = [b'{"choices":[{"text":"a","token_ids":[1]}]}', b'{"choices":[{"text":"","token_ids":[2, 3]}]}',
          b"[DONE]"]


def chunked_response() -> bytes:
    body = b"".join(b"data: " + e + b"\r\n\r\n" for e in EVENTS)
    pieces = [body[:7], body[7:50], body[50:]]  # chunk borders inside lines
    framed = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"x-mvllm-backend: gpu\r\n\r\n" + framed)


def parse(pieces: list[bytes]) -> tuple[ResponseParser, list[bytes]]:
    got: list[bytes] = []
    p = ResponseParser(got.append)
    for piece in pieces:
        p.feed(piece)
    return p, got


def test_sse_parser_over_chunks_split_at_every_byte():
    raw = chunked_response()
    for cut in range(1, len(raw)):
        p, got = parse([raw[:cut], raw[cut:]])
        assert got == EVENTS and p.done and p.reusable and p.status == 200, cut
    p, got = parse([raw[i:i + 1] for i in range(len(raw))])
    assert got == EVENTS and p.done and p.headers["x-mvllm-backend"] == "gpu"


def test_parser_reads_a_sized_error_and_a_close_delimited_stream():
    body = b'{"error": {"message": "too long"}}'
    p, got = parse([b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n" % len(body), body[:5], body[5:]])
    assert p.done and p.status == 400 and bytes(p.body) == body and got == []
    p, got = parse([b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: x\n"])
    assert not p.done and got == [b"x"]
    p.eof()
    assert p.done and not p.reusable


def requests(n: int = 24) -> list[Request]:
    reqs = [Request(i, [1, 2, 3 + i], 5 + i % 7, 0.002 * i) for i in range(n)]
    reqs.append(Request(n, [7, 7], 3, 0.01, parent=0))  # a follow-up turn: with its first turn's worker
    return reqs


def outcome(records):
    return [(r.id, r.ok, r.output_tokens, len(r.chunks), r.finish_reason, r.backend, r.error, r.prompt_tokens)
            for r in records]


def test_several_workers_give_the_same_records_as_one():
    reqs = requests()
    with StubServer() as stub:
        one, _, _, h1 = generate(stub.url, MODEL, reqs, 30.0, 1)
        three, _, _, h3 = generate(stub.url, MODEL, reqs, 30.0, 3)
    assert outcome(one) == outcome(three)
    assert all(r.ok for r in one) and one[-1].prompt_tokens == 3 + 5 + 2  # parent prompt + reply + own
    assert len(h1) == 1 and len(h3) == 3 and all(h["wall_s"] > 0 for h in h3)
    assert [r.id for r in deal(reqs, 3)[0]] == [0, 3, 6, 9, 12, 15, 18, 21, 24]


def test_a_stream_cut_mid_way_is_an_error_and_the_others_finish():
    reqs = [Request(i, [1, 2], 10, 0.0) for i in range(6)]
    with StubServer(cut=3) as stub:
        records, _, _, _ = generate(stub.url, MODEL, reqs, 30.0, 1)
    failed = [r for r in records if not r.ok]
    assert len(failed) == 2 and all("closed" in r.error for r in failed)
    assert all(r.output_tokens == 10 for r in records if r.ok)


def test_hidden_length_disconnects_at_the_true_length():
    reqs = [Request(0, [1, 2], 6, 0.0, max_tokens=None)]
    with StubServer() as stub:  # the stub would stream 16 without benchmark_length
        records, _, _, _ = generate(stub.url, MODEL, reqs, 30.0, 1, stop="disconnect")
    assert records[0].ok and records[0].output_tokens == 6 and records[0].finish_reason == "disconnect"


def test_a_slowed_client_is_flagged(monkeypatch):
    def slow(data):
        import time
        time.sleep(0.003)  # a client too busy for its schedule
        return fast(data)

    fast = client.loads
    monkeypatch.setattr(client, "loads", slow)
    reqs = [Request(i, [1, 2], 8, 0.001 * i) for i in range(20)]
    with StubServer() as stub:
        records, duration, _, health = generate(stub.url, MODEL, reqs, 30.0, 1)
    s = summarize(records, duration)
    c = summarize_client(records, health, s["median_ttft_ms"])
    assert c["saturated"] and c["p99_lag_ms"] > c["limit_ms"] and warning(c).startswith("warning:")
    calm = summarize_client(records, [{"lags": [0.0001], "cpu_s": 0.1, "wall_s": 1.0}], 1e9)
    assert calm["cpu"] == [0.1] and not calm["saturated"]
    # a burst: all sent at one instant's schedule, 80 ms apart at the end, by a loop on time and at 10% of a core
    for i, r in enumerate(records):
        r.arrival, r.sent = 0.0, 0.004 * i
    burst = summarize_client(records, [{"lags": [0.0001] * 100, "cpu_s": 0.1, "wall_s": 1.0}], 1e9)
    assert burst["send_lag_ms"]["p99"] > 70 and not burst["saturated"] and warning(burst) is None
    busy = summarize_client(records, [{"lags": [0.0001] * 100, "cpu_s": 0.95, "wall_s": 1.0}], 1e9)
    assert busy["saturated"] and "95% of a core" in warning(busy)


def test_a_worker_that_dies_fails_the_run_naming_it():
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=os._exit, args=(3,))
    p.start()
    p.join()
    with pytest.raises(ClientError, match=r"client worker 0 \(pid \d+\) died with exit code 3"):
        _next(ctx.Queue(), [p], {}, None)


def test_bench_to_a_server_that_is_down_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "bench", "--url", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the server at http://127.0.0.1:9" in lines[0]


def test_replay_in_this_process_still_works():
    with StubServer() as stub:
        records, duration, _ = asyncio.run(client.replay(stub.url, MODEL, requests(4), 30.0))
    assert [r.ok for r in records] == [True] * 5 and duration > 0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio's runner turns Ctrl-C into a cancellation from 3.11")
def test_ctrl_c_ends_a_replay_that_went_on_after_it():
    """asyncio's runner makes Ctrl-C a cancellation of the main task; a coroutine that returns through it (as
    Python 3.11's wait_for does where its wait finished at that moment) still ends in KeyboardInterrupt."""
    import signal

    async def goes_on() -> str:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the loop runs
        for _ in range(3):
            try:
                await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                pass
        return "finished"

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # a CLI's (an earlier test may have set another)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_loop(goes_on())
    finally:
        signal.signal(signal.SIGINT, before)
