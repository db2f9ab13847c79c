"""A backend that dies: requests that had sent nothing yet move to a live backend unseen by their clients,
a stream in progress ends with an OpenAI-shaped error event and [DONE], and --restart-backends brings the
backend back, warmed, into the router."""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
import time

import httpx
import pytest
from conftest import http_client, start_long_stream, wait_for

from mvllm.bench.process import ServerError, ServerProcess

MODEL = "synthetic:smollm2-135m"  # slow enough on one thread that requests queue behind a long one
BACKENDS = "gpu=cpu/threads=1/max_active=1,cpu=cpu/threads=1/max_active=1"


def post(url: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return http_client.post(f"{url}/v1/completions", json=body, timeout=120)


def test_dead_backend_reroutes_what_had_not_started_and_comes_back(tmp_path):
    prefix = list(range(300, 332))  # 2 full blocks
    (tmp_path / "prefix.json").write_text(json.dumps(prefix))
    server = ServerProcess(["--model", MODEL, "--backends", BACKENDS, "--policy", "gpu-only", "--restart-backends",
                            "--warm-prefix", str(tmp_path / "prefix.json")], tmp_path / "server.log").start()
    server.wait_ready(180)
    try:
        pids = {b["name"]: b["pid"] for b in http_client.get(f"{server.url}/v1/backends").json()}
        queued: dict[int, httpx.Response] = {}

        def one(i: int):
            queued[i] = post(server.url, prefix + [i, i + 1], 6)

        stream, lines, streaming = start_long_stream(server.url, MODEL, 3000, 120)
        assert streaming.wait(60)
        waiting = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in waiting:
            t.start()

        def queued_behind_the_stream() -> bool:  # the three wait behind the stream on the gpu backend (max_active 1)
            gpu = next(b for b in http_client.get(f"{server.url}/v1/backends", timeout=30).json() if b["name"] == "gpu")
            return gpu.get("running") == 1 and gpu.get("waiting") == 3

        wait_for(queued_behind_the_stream, 60, 0.05)
        killed = time.monotonic()
        os.kill(pids["gpu"], signal.SIGKILL)
        stream.join(60)
        print(f"the stream ended {time.monotonic() - killed:.2f} s after the kill")
        assert not stream.is_alive(), "the stream did not end after its backend was killed"
        assert lines[-1] == "[DONE]" and "error" in json.loads(lines[-2])
        for t in waiting:
            t.join(120)
        assert all(r.status_code == 200 for r in queued.values()), [r.text for r in queued.values()]
        assert {r.json()["backend"] for r in queued.values()} == {"cpu"}
        for i, r in queued.items():  # the same tokens as the same request served directly
            assert r.json()["choices"][0]["token_ids"] == post(server.url, prefix + [i, i + 1], 6).json()[
                "choices"][0]["token_ids"]

        def restarted() -> bool:  # the restart counts once the new worker is warmed and back in the router
            health = http_client.get(f"{server.url}/health", timeout=30)
            return health.status_code == 200 and health.json()["backends"]["gpu"]["restarts"] >= 1

        wait_for(restarted, 120, 0.5)
        health = http_client.get(f"{server.url}/health").json()
        assert health["status"] == "ok" and health["backends"]["gpu"] == {"alive": True, "restarts": 1}
        again = post(server.url, prefix + [9, 9], 4).json()
        assert again["backend"] == "gpu" and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        metrics = http_client.get(f"{server.url}/metrics").text
        assert 'mvllm_backend_restarts_total{backend="gpu"} 1.0' in metrics
        assert 'mvllm_requests_rerouted_total{backend="gpu"} 3.0' in metrics
    finally:
        server.stop()


@pytest.fixture
def not_openai():
    """An HTTP server that is not an OpenAI-compatible one: every path is 404."""
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_backend_that_fails_to_start_is_left_out(tmp_path, not_openai):
    """The server starts on the backends that load, says which did not, and never routes to it; a benchmark's
    wait for the server says so too (it needs every backend it names). Here the one left out is a remote that
    is not an OpenAI server; a local worker's load error (e.g. out of GPU memory) takes the same path."""
    server = ServerProcess(["--model", "synthetic:tiny-qwen2", "--backends", f"cpu=cpu/threads=1,far={not_openai}",
                            "--policy", "round-robin"], tmp_path / "server.log").start()
    try:
        with pytest.raises(ServerError, match=f"started without a backend: backend far: {not_openai} has no /v1/models"):
            server.wait_ready(180)
        health = http_client.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503
        body = health.json()
        assert body["down"] == ["far"] and body["backends"]["cpu"]["alive"]
        assert "is it an OpenAI-compatible server?" in body["backends"]["far"]["start_error"]
        for _ in range(3):
            r = http_client.post(f"{server.url}/v1/completions", json={"model": "synthetic:tiny-qwen2", "prompt": [1, 2, 3],
                                                                 "max_tokens": 3, "temperature": 0}, timeout=60)
            assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
        assert "serving without backend far" in (tmp_path / "server.log").read_text()
    finally:
        server.stop()


def test_no_backend_started_is_one_error(tmp_path, not_openai):
    server = ServerProcess(["--model", "synthetic:tiny-qwen2", "--backends", f"a={not_openai},b={not_openai}/max_active=2",
                            "--policy", "round-robin"], tmp_path / "server.log").start()
    try:
        with pytest.raises(ServerError, match="exited with code"):
            server.wait_ready(120)
        log = (tmp_path / "server.log").read_text()
        assert "no backend started: backend a:" in log and "backend b:" in log and "Traceback" not in log
    finally:
        server.stop()
