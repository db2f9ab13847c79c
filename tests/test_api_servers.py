"""`serve --api-servers N`: N API processes on one port in front of one core (server/core.py), over null backends
(tokens every 20 ms, no model). Streams finish whole on every process, counters are whole, bad input gets a 400
from any of them, a client that hangs up or an API process that dies frees its requests, SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import httpx
import pytest
from conftest import http_client, wait_for
from test_shutdown import TINY, children, die_with_a_killed_server, drains_on_sigterm, gone

from mvllm.backends.spec import BackendSpec, api_servers, share_cores
from mvllm.bench.process import ServerProcess

MODEL = TINY
NULLS = "gpu=null/step_ms=20/max_active=64,cpu=null/step_ms=20/max_active=64"


def start(tmp_path, *args) -> ServerProcess:
    server = ServerProcess(["--model", MODEL, "--backends", NULLS, "--policy", "round-robin", "--api-servers", "2",
                            *args], tmp_path / "server.log").start()
    server.wait_ready(120)
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start(tmp_path_factory.mktemp("api-servers"))
    yield s
    s.stop()


def health(server) -> dict:
    return http_client.get(f"{server.url}/health", timeout=10).json()


def load(server) -> dict[str, tuple[int, int]]:
    """Each backend's (running requests, requests the router still books)."""
    snaps = http_client.get(f"{server.url}/v1/backends", timeout=10).json()
    return {b["name"]: (b["running"], b["booked_active"] + b["booked_queued"]) for b in snaps}


async def streams(url: str, n: int, tokens: int) -> list:
    """n streams, a connection each: (API process, tokens received, ended with [DONE]) or the error."""
    async def one():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": tokens, "stream": True}
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                got, done = 0, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        got += len(json.loads(line[6:])["choices"][0]["token_ids"])
                return r.headers["x-mvllm-api-server"], got, done

    return await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)


def generated(server) -> float:
    text = http_client.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("mvllm_generation_tokens_total{"))


def test_streams_spread_over_the_api_processes_and_the_counters_are_whole(server):
    before = generated(server)
    got = asyncio.run(streams(server.url, 48, 30))
    assert all(g[1:] == (30, True) for g in got), got
    assert {g[0] for g in got} == {"0", "1"}  # both processes accepted connections on the one port
    wait_for(lambda: generated(server) - before == 48 * 30, 10, 0.1)  # counted once, by the core
    assert sorted(health(server)["api_servers"]) == ["0", "1"]


def connections(seen: set, most: int = 64):
    """Count connections until `seen` holds both API processes' names: the kernel spreads connections over the
    two sockets at random, so a fixed few (8) all reach one of them about once in 128 runs."""
    for i in range(most):
        if i >= 4 and seen == {"0", "1"}:
            return
        yield i


def test_bad_input_gets_a_400_from_every_api_process(server):
    seen = set()
    for _ in connections(seen):
        with httpx.Client() as c:
            r = c.post(f"{server.url}/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        seen.add(r.headers.get("x-mvllm-api-server"))
    for body, param in [({"model": "nope", "prompt": "hi"}, "model"),
                        ({"model": MODEL, "prompt": [1, 2], "max_tokens": -1}, "max_tokens"),
                        ({"model": MODEL, "prompt": list(range(1, 5000))}, "prompt")]:
        r = http_client.post(f"{server.url}/v1/completions", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http_client.post(f"{server.url}/v1/policy", json={"policy": "nope"}, timeout=10)
    assert r.status_code == 400 and "unknown policy" in r.json()["error"]["message"]  # raised in the core
    assert http_client.post(f"{server.url}/v1/policy", json={"policy": "round-robin"}).json() == {
        "policy": "round-robin"}
    assert seen == {"0", "1"}


def test_the_cores_endpoints_answer_from_every_api_process(server):
    seen = set()
    for _ in connections(seen):
        with httpx.Client() as c:
            warm = c.post(f"{server.url}/v1/warm", json={"prompt": [1, 2, 3, 4]})
            reset = c.post(f"{server.url}/reset_prefix_cache")
            snaps = c.get(f"{server.url}/v1/backends").json()
        assert warm.status_code == 200 and set(warm.json()["cached_tokens"]) == {"gpu", "cpu"}
        assert reset.json() == {"reset": ["cpu", "gpu"]}
        assert [b["name"] for b in snaps] == ["gpu", "cpu"] and all(b["alive"] for b in snaps)
        seen |= {warm.headers["x-mvllm-api-server"], reset.headers["x-mvllm-api-server"]}
    assert seen == {"0", "1"}


def test_a_second_server_on_the_same_port_is_refused_in_one_line(server):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "serve", "--model", MODEL, "--backends", "gpu=null",
                           "--api-servers", "2", "--port", str(server.port)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "cannot listen on 127.0.0.1" in done.stderr + done.stdout, done.stderr
    assert http_client.get(f"{server.url}/health").status_code == 200  # the first one still serves, alone


def test_a_client_that_hangs_up_frees_its_request(server):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2000, "stream": True}
    with httpx.Client() as c, c.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # held open: a loop left by break would close the connection here
        assert next(line for line in lines if line.startswith("data: "))
        assert sum(n for n, _ in load(server).values()) == 1
    wait_for(lambda: load(server) == {"gpu": (0, 0), "cpu": (0, 0)}, 10, 0.05, lambda: str(load(server)))


def test_an_api_process_that_dies_frees_its_requests_and_another_takes_its_place(server):
    pids = health(server)["api_servers"]
    for pid in pids.values():  # an API process imports no torch
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read()
    out: list = []
    runner = threading.Thread(target=lambda: out.extend(asyncio.run(streams(server.url, 16, 150))))
    runner.start()
    wait_for(lambda: sum(n for n, _ in load(server).values()) == 16, 20, 0.05)
    os.kill(pids["0"], signal.SIGKILL)
    runner.join(60)
    ok = [g for g in out if isinstance(g, tuple)]
    cut = [g for g in out if not isinstance(g, tuple)]
    assert ok and cut and len(ok) + len(cut) == 16  # (round-robin over the connections: both had some)
    assert all(g == ("1", 150, True) for g in ok), ok  # the other process's streams ran to their end
    wait_for(lambda: load(server) == {"gpu": (0, 0), "cpu": (0, 0)}, 10, 0.05, lambda: str(load(server)))
    wait_for(lambda: health(server).get("api_servers", {}).get("0") not in (None, pids["0"]), 60, 0.2)
    wait_for(lambda: http_client.get(f"{server.url}/health").status_code == 200, 60, 0.1)  # 503 until it serves
    wait_for(lambda: "0" in {g[0] for g in asyncio.run(streams(server.url, 8, 3))}, 60, 0.5)  # the new one serves
    assert "API process 0 exited; starting another" in server.log.read_text()


def test_sigterm_drains_every_api_process_then_exits_zero(tmp_path):
    server = start(tmp_path, "--shutdown-timeout", "1")
    try:
        procs = children(server.proc.pid)
        drains_on_sigterm(server)
        wait_for(lambda: gone(procs), 60, 0.05, lambda: f"processes {procs} still running")
    finally:
        server.stop()


def test_how_many_api_processes_and_the_cores_they_leave(monkeypatch):
    """One API process unless asked (two served 0.80x of one on an H100); a CPU backend beside a CUDA GPU takes
    at most half the compute cores, and with N API processes leaves a core to each and to the core."""
    from mvllm import machine

    monkeypatch.setattr(machine, "logical_cpus", lambda: 16)
    monkeypatch.setattr(machine, "compute_cores", lambda: (16, "16 logical CPUs"))
    assert api_servers() == (1, "the default: more pay only where one API process is the bottleneck")
    assert api_servers(3) == (3, "--api-servers")

    def threads(device, **kw):  # (the GPU worker's threads, the CPU backend's, why) beside a GPU on `device`
        gpu, cpu = BackendSpec("gpu", device), BackendSpec("cpu", "cpu")
        why = share_cores([gpu, cpu], **kw)
        return gpu.threads, cpu.threads, why

    assert threads("cuda") == (1, 8, "8 a CPU backend: half of 16 logical CPUs, beside a CUDA GPU")
    assert threads("cuda:1", client=True)[:2] == (1, 8)
    monkeypatch.setattr(machine, "compute_cores", lambda: (6, "6 logical CPUs"))
    monkeypatch.setattr(machine, "logical_cpus", lambda: 6)
    _, cpu_threads, why = threads("cuda", apis=2)  # 6 less the GPU worker, 2 API processes and the core: 2 < 3
    assert cpu_threads == 2 and "2 API processes and the core" in why
    assert threads("mps")[1] == 4  # not capped beside MPS: 6 less its worker and the API process


def test_api_servers_below_one_is_refused_in_one_line():
    from typer.testing import CliRunner

    from mvllm.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", MODEL, "--backends", NULLS, "--api-servers", "0"])
    assert result.exit_code == 2 and "--api-servers must be at least 1" in result.output
    assert "Traceback" not in result.output


def test_an_api_process_that_exits_before_it_serves_stops_the_server():
    from types import SimpleNamespace

    from mvllm.server.core import Core

    said: list[str] = []
    core = Core(None, 2, {}, SimpleNamespace(print=lambda line, **_: said.append(line)))

    async def go():
        core.stop = asyncio.Event()
        core.procs[1] = SimpleNamespace(exitcode=1)  # started again, and gone before its hello
        await asyncio.wait_for(core.watch(1), 5)

    asyncio.run(go())
    assert core.stop.is_set() and "API process 1 exited before it served (exit code 1)" in said[0]


def test_api_processes_do_not_outlive_a_killed_core(tmp_path):
    server = start(tmp_path)
    pids = list(health(server)["api_servers"].values())
    assert len(pids) == 2 and set(pids) <= set(children(server.proc.pid))
    die_with_a_killed_server(server, pids, "API processes")


def test_bench_starts_its_servers_with_the_api_processes_asked(tmp_path):
    """An experiment's `api_servers` (or bench --api-servers) reaches the servers bench starts: the runs stream
    through that many API processes and each summary records how many."""
    from typer.testing import CliRunner

    from mvllm.cli import app

    (tmp_path / "exp.toml").write_text(f'''name = "apis"
model = "{MODEL}"
backends = "{NULLS}"
policies = ["round-robin"]
runs = 1
server = "shared"
max_active = 8
client_workers = 1
[workload]
requests = 16
prefix_tokens = 8
suffix_tokens = 4
output_tokens = 8
arrival = "fixed"
interval = 0.01
''')
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", str(tmp_path / "exp.toml"), "--out", str(out), "--quiet",
                                      "--api-servers", "2"])
    assert result.exit_code == 0, result.output
    summary = json.loads(next(out.rglob("summary.json")).read_text())
    assert summary["api_servers"] == 2 and summary["completed"] == 16
    assert "2 API processes" in next(out.rglob("server.log")).read_text()
    bad = CliRunner().invoke(app, ["bench", str(tmp_path / "exp.toml"), "--out", str(out), "--api-servers", "0"])
    assert bad.exit_code != 0 and "--api-servers must be at least 1, got 0" in bad.output

