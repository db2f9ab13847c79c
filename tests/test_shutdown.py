"""Graceful shutdown: SIGTERM drains (503 for new requests, running ones finish or end with an "abort"
chunk and [DONE]), the workers stop and the server exits 0; workers never outlive a SIGKILLed server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

from conftest import http_client, wait_for

from mvllm.bench.process import ServerProcess

TINY = "synthetic:tiny-llama"  # ~0.7 ms a step; a stream that must outlast a timeout runs on NULLS
BACKENDS = "gpu=cpu/threads=1,cpu=cpu/threads=1"
NULLS = "gpu=null/step_ms=20,cpu=null/step_ms=20"


def start(tmp_path, *args, backends: str = BACKENDS) -> ServerProcess:
    server = ServerProcess(["--model", TINY, "--backends", backends, "--policy", "round-robin", *args],
                           tmp_path / "server.log").start()
    server.wait_ready(180)
    return server


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def gone(pids: list[int]) -> bool:
    return not any(os.path.exists(f"/proc/{p}") and "zombie" not in _state(p) for p in pids)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line for line in f if line.startswith("State")), "").lower()
    except OSError:
        return "zombie"


def stream(url: str, max_tokens: int, out: list, started: threading.Event) -> None:
    body = {"model": TINY, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with http_client.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                started.set()


def die_with_a_killed_server(server: ServerProcess, pids: list[int], what: str) -> None:
    """SIGKILL the server: its child processes `pids` end too (none is left running or serving)."""
    try:
        server.proc.kill()
        server.proc.wait(10)
        wait_for(lambda: gone(pids), 60, 0.05, lambda: f"{what} {pids} still running")
    finally:
        server.stop()


def drains_on_sigterm(server: ServerProcess) -> None:
    """SIGTERM while a long stream runs: a late request gets a 503, the stream ends with an "abort" chunk and
    [DONE], and the server exits 0."""
    chunks: list[str] = []
    started = threading.Event()
    reader = threading.Thread(target=stream, args=(server.url, 2000, chunks, started))
    reader.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "taking no new requests" in server.log.read_text(), 60, 0.02)  # SIGTERM was handled
    late = http_client.post(f"{server.url}/v1/completions", timeout=10,
                            json={"model": TINY, "prompt": [1, 2], "max_tokens": 2})
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    reader.join(30)
    assert not reader.is_alive()
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["choices"][0]["finish_reason"] == "abort"
    assert server.proc.wait(30) == 0


def test_sigterm_drains_then_exits_zero(tmp_path):
    # null backends (tokens every 20 ms, no model): a stream outlasts the 1 s timeout, and the server starts in
    # seconds where two SmolLM2-shaped workers took 13-50 s
    server = start(tmp_path, "--shutdown-timeout", "1", "--routing-log", str(tmp_path / "routing.jsonl"),
                   backends=NULLS)
    try:
        workers = children(server.proc.pid)
        assert len(workers) >= 2  # the two workers (and multiprocessing's resource tracker)
        drains_on_sigterm(server)
        wait_for(lambda: gone(workers), 60, 0.05, lambda: f"workers {workers} still running")
        log = server.log.read_text()
        assert "aborted 1 request(s)" in log and "mvllm: stopped" in log
        assert (tmp_path / "routing.jsonl").read_text().count("\n") >= 1
    finally:
        server.stop()


def test_running_requests_finish_within_the_timeout(tmp_path):
    server = start(tmp_path, "--shutdown-timeout", "30")
    try:
        chunks: list[str] = []
        started = threading.Event()
        reader = threading.Thread(target=stream, args=(server.url, 1500, chunks, started))
        reader.start()
        assert started.wait(60)
        server.proc.send_signal(signal.SIGINT)  # Ctrl-C drains the same way as SIGTERM
        reader.join(60)
        assert not reader.is_alive()
        finals = [json.loads(c)["choices"][0] for c in chunks if c != "[DONE]"]
        assert chunks[-1] == "[DONE]" and finals[-1]["finish_reason"] == "length"
        assert sum(len(c["token_ids"]) for c in finals) == 1500
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_workers_do_not_outlive_a_killed_server(tmp_path):
    server = start(tmp_path)
    workers = children(server.proc.pid)
    assert len(workers) >= 2  # the two workers (and multiprocessing's resource tracker)
    die_with_a_killed_server(server, workers, "workers")


def test_ctrl_c_stops_a_server_still_starting_even_with_sigint_ignored(tmp_path):
    """A server started with SIGINT ignored (a shell's background job, as a CI runner may start a harness) still
    stops on Ctrl-C while its backends start: it does not come up and keep serving."""
    server = ServerProcess(["--model", TINY, "--backends", BACKENDS, "--policy", "round-robin"], tmp_path / "server.log")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the server, as from a background job
    try:
        server.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        wait_for(lambda: children(server.proc.pid), 60, 0.01)  # its backends are starting: past the CLI's imports
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 130  # the CLI's exit for an interrupt, not some other failure
        log = server.log.read_text()
        assert "interrupted" in log and "mvllm: serving" not in log
    finally:
        server.stop()
