"""The null backend (tokens on a clock, no model) behind the real server: its spec, its tokens, its aborts."""

from __future__ import annotations

import json
import os
import time

import pytest
from conftest import http_client
from typer.testing import CliRunner

from mvllm.backends.null import Clock
from mvllm.backends.spec import parse_backends
from mvllm.bench.process import ServerProcess
from mvllm.cli import app
from mvllm.errors import InvalidRequestError

MODEL = "synthetic:tiny-qwen2"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("null")
    s = ServerProcess(["--model", MODEL, "--backends", "gpu=null/step_ms=20/max_active=1"], tmp / "server.log")
    s.start().wait_ready(120)
    yield s
    s.stop()


def stream(url: str, body: dict, stop_after: int | None = None) -> tuple[list[int], list[dict]]:
    """The token ids a streamed completion carried, and its chunks; stop_after: hang up after that many tokens."""
    body = {"model": MODEL, "prompt": [5, 6, 7], "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    ids, chunks = [], []
    with http_client.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            for c in chunks[-1]["choices"]:
                ids += c.get("token_ids") or []
            if stop_after is not None and len(ids) >= stop_after:
                break
    return ids, chunks


def test_the_spec_takes_step_ms_and_max_active_and_refuses_the_rest_in_one_line():
    spec, = parse_backends("gpu=null/step_ms=2.5/max_active=8")
    assert (spec.device, spec.step_ms, spec.max_active) == ("null", 2.5, 8)
    for text, message in [("gpu=null/threads=2", "threads is not a setting of a null backend; it takes "
                                                 "max_active, step_ms"),
                          ("gpu=null/step_ms=0", "step_ms above 0"),
                          ("gpu=null/step_ms=fast", "bad value 'fast' for step_ms"),
                          ("gpu=null/max_active=0", "max_active of 1 or more"),
                          ("gpu=null/speed=2", "unknown setting 'speed'; known: max_active, step_ms"),
                          ("gpu=cpu/step_ms=5", "step_ms is a setting of a null backend")]:
        with pytest.raises(InvalidRequestError, match=message):
            parse_backends(text)
    result = CliRunner().invoke(app, ["serve", "--model", MODEL, "--backends", "gpu=null/threads=2"])
    assert result.exit_code == 2 and "threads is not a setting of a null backend" in result.output
    assert "Traceback" not in result.output


def test_the_clock_admits_up_to_max_active_and_ends_each_request_at_its_length():
    clock = Clock(2)
    clock.submit("a", [1, 2], {"max_tokens": 3})
    clock.submit("b", [9], {"max_tokens": 5, "stop_at": 2})
    clock.submit("c", [4], {"max_tokens": 1})
    admitted, tokens = clock.step()
    assert admitted == [("a", 0), ("b", 0)] and tokens == [("a", 1, None), ("b", 9, None)]
    assert clock.step()[1] == [("a", 2, None), ("b", 9, "stop")]
    assert clock.step() == ([("c", 0)], [("a", 1, "length"), ("c", 4, "length")])
    assert not clock.busy()


def test_a_served_request_gets_exactly_max_tokens(server):
    ids, chunks = stream(server.url, {"max_tokens": 7})
    assert len(ids) == 7 and ids == [5, 6, 7, 5, 6, 7, 5]
    assert chunks[-1]["usage"]["completion_tokens"] == 7
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    ids, chunks = stream(server.url, {"max_tokens": 9, "benchmark_length": 4})
    assert len(ids) == 4 and [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    r = http_client.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [3], "max_tokens": 5}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert r.headers["x-mvllm-backend"] == "gpu"


def test_an_abort_frees_its_slot(server):
    """max_active is 1: a request that would hold the slot for 40 s is cut, and the next one runs at once."""
    ids, _ = stream(server.url, {"max_tokens": 2000, "ignore_eos": True}, stop_after=3)
    assert len(ids) >= 3
    start = time.monotonic()
    ids, _ = stream(server.url, {"max_tokens": 4})
    assert len(ids) == 4 and time.monotonic() - start < 10
    snap = http_client.get(f"{server.url}/v1/backends", timeout=10).json()[0]
    assert (snap["device"], snap["running"], snap["waiting"], snap["booked_active"]) == ("null", 0, 0, 0)
    assert snap["pid"] != server.proc.pid and os.path.exists(f"/proc/{snap['pid']}")


def test_a_stream_arrives_whole_and_in_order_however_slowly_it_is_read(server):
    """The step's loop writes tokens straight to the socket where it can, the response's task where it cannot:
    a client that reads late still gets every token once, in order."""
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 100, "stream": True}
    ids = []
    with http_client.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        for i, line in enumerate(r.iter_lines()):
            if i in (2, 40):
                time.sleep(0.5)  # 25 steps' tokens wait for the reader
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
    assert ids == ([5, 6, 7] * 34)[:100]


def test_neither_the_api_process_nor_the_null_worker_loads_torch(server):
    pid = http_client.get(f"{server.url}/v1/backends", timeout=10).json()[0]["pid"]
    for p in (server.proc.pid, pid):
        with open(f"/proc/{p}/maps") as f:
            assert "libtorch" not in f.read(), p


def test_a_null_backend_takes_no_core_from_a_cpu_backend_and_env_describes_it():
    from mvllm import machine
    from mvllm.backends.spec import share_cores
    from mvllm.env import backend_facts

    specs = parse_backends("gpu=null/step_ms=4,cpu=cpu")
    share_cores(specs)
    assert specs[0].threads is None and specs[1].threads == machine.compute_cores()[0]
    assert backend_facts(specs[0]) == {"device": "null", "null": True, "max_active": 4, "step_ms": 4.0}
