"""One server for many runs: prefix-cache reset, policy switch, bench's shared mode, sweeps of one backend's
setting, fixed-length prompts, timed arrivals, and rates cut to the batch a backend serves."""

from __future__ import annotations

import json

import pytest
from conftest import http_client

from mvllm.backends.spec import parse_backends
from mvllm.bench import experiment as ex
from mvllm.bench.process import ServerProcess
from mvllm.bench.results import read_json
from mvllm.bench.runner import bench
from mvllm.bench.workload import arrivals, build
from mvllm.engine.block_manager import BlockManager
from mvllm.engine.params import SamplingParams
from mvllm.engine.sequence import Sequence
from mvllm.routing.eta import Timing
from mvllm.server.serve import read_rates

MODEL = "synthetic:tiny-llama"


def test_block_manager_reset_forgets_cached_blocks_and_refuses_while_in_use():
    bm = BlockManager(8, block_size=4)
    seq = Sequence(list(range(12)), SamplingParams(max_tokens=1))
    bm.allocate(seq)
    seq.num_computed_tokens = 12
    bm.commit(seq)
    assert not bm.reset_prefix_cache()  # blocks in use: nothing changes
    bm.free(seq)
    assert bm.cached_prefix_len(list(range(13))) == 12
    assert bm.reset_prefix_cache()
    assert bm.cached_prefix_len(list(range(13))) == 0
    assert bm.num_free == 8 and not bm.hash_to_block and len(bm.clean) == 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared")
    srv = ServerProcess(["--model", MODEL, "--backends", "gpu=cpu/threads=1,cpu=cpu/threads=1", "--policy",
                         "gpu-only"], tmp / "server.log")
    with srv:
        srv.wait_ready(180)
        yield srv


def _cached(server, prompt) -> tuple[str, int]:
    r = http_client.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                   timeout=60).json()
    return r["backend"], r["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_reset_prefix_cache_empties_every_backend(server):
    prompt = list(range(100, 148))
    _cached(server, prompt)
    assert _cached(server, prompt)[1] == 32  # 3 full blocks; the last token is always computed
    r = http_client.post(f"{server.url}/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["reset"] == ["cpu", "gpu"]
    assert _cached(server, prompt)[1] == 0


def test_policy_switch_and_unknown_policy(server):
    try:
        r = http_client.post(f"{server.url}/v1/policy", json={"policy": "cpu-only"})
        assert r.status_code == 200 and r.json() == {"policy": "cpu-only"}
        assert _cached(server, [5, 6, 7])[0] == "cpu"
        for bad in ({"policy": "fastest"}, {"policy": "mixed"}, {"policy": "split:-1"}, {},
                    {"policy": "gpu-only", "slo": "ttft:500"}, {"policy": "slo", "slo": "ttft:abc"},
                    {"policy": "slo", "slo": "ttft:0"}, {"policy": "slo"}):
            r = http_client.post(f"{server.url}/v1/policy", json=bad)
            assert r.status_code == 400 and r.json()["error"]["message"], bad
        assert _cached(server, [5, 6, 7])[0] == "cpu"  # a refused switch changes nothing
    finally:
        http_client.post(f"{server.url}/v1/policy", json={"policy": "gpu-only"})


def test_shared_bench_reuses_one_server_per_setting_and_slices_its_routing_log(tmp_path):
    exp = ex.from_dict({
        "name": "shared", "model": MODEL, "backends": "gpu=cpu/threads=1,cpu=cpu/threads=1", "max_active": 2,
        "server": "shared", "policies": ["gpu-only", "split:1"], "runs": 2, "ready_timeout": 180,
        "workload": {"requests": 4, "prompt_tokens": 40, "suffix_tokens": 8, "output_tokens": 6, "interval": 0.01},
        "sweep": {"knob": "backends.gpu.max_active", "values": [1, 2]}})
    out = tmp_path / "shared"
    bench(exp, out, quiet=True)
    assert sorted(p.name for p in out.glob("server-*")) == ["server-1", "server-2"]
    assert not list(out.glob("server-*/routing.jsonl"))  # each run holds its slice; the whole log is gone
    logs = [json.loads(x) for p in out.glob("*-run*/routing.jsonl") for x in p.read_text().splitlines()]
    assert len(logs) == 2 * 2 * 2 * 4
    runs = sorted(out.glob("*/summary.json"))
    assert len(runs) == 8
    for path in runs:
        s = read_json(path)
        routing = [json.loads(x) for x in (path.parent / "routing.jsonl").read_text().splitlines()]
        assert len(routing) == 4 and {r["policy"] for r in routing} == {s["policy"]}
        assert s["server"] == "shared" and s["completed"] == 4
        assert s["backends"].startswith(f"gpu=cpu/threads=1/max_active={s['value']}")
        assert s["workload"]["prefix_tokens"] == 32
        assert min(s["backend_cached_tokens"].values()) >= 32  # re-warmed after each reset
        cpu = s["backend_requests"].get("cpu", 0)
        assert cpu == (1 if s["policy"] == "split:1" else 0)  # split's count starts again each run


def test_prompt_tokens_keep_the_prompt_length_and_duration_bounds_the_arrivals():
    w = ex.from_dict({"name": "x", "model": MODEL, "workload": {"prompt_tokens": 516, "suffix_tokens": 516,
                                                                  "vocab": 1000}}).workload
    prefix, reqs = build(w, 1000)
    assert prefix == [] and {len(r.prompt) for r in reqs} == {516}
    assert len({tuple(r.prompt) for r in reqs}) == len(reqs)
    timed = ex.from_dict({"name": "x", "model": MODEL, "workload": {"arrival": "poisson", "rate": 50.0,
                                                                      "duration": 4.0}}).workload
    times = arrivals(timed)
    assert times[-1] < 4.0 and 150 < len(times) < 250
    for bad, key in (({"prompt_tokens": 10, "suffix_tokens": 20}, "prompt_tokens"),
                     ({"duration": 5.0, "interval": 0.0}, "duration"), ({"duration": -1.0}, "duration")):
        with pytest.raises(ex.ExperimentError, match=key):
            ex.from_dict({"name": "x", "model": MODEL, "workload": bad})
    with pytest.raises(ex.ExperimentError, match="server"):
        ex.from_dict({"name": "x", "model": MODEL, "server": "pooled"})
    with pytest.raises(ex.ExperimentError, match="backends.tpu.max_active"):
        ex.from_dict({"name": "x", "model": MODEL, "backends": "gpu=cpu,cpu=cpu",
                      "sweep": {"knob": "backends.tpu.max_active", "values": [2]}})


def test_rates_are_cut_to_the_batch_the_backend_serves(tmp_path):
    decode = [{"batch": b, "context": 568, "step_ms": 2.0 + b, "tok_s": b / (2.0 + b) * 1000} for b in (1, 2, 4)]
    entry = {"prefill": [{"kind": "cold", "tokens": 516, "cached": 0, "ms": 10.0, "tok_s": 51600.0}],
             "decode": decode, "max_active": 4, "prefill_rate": 51600.0, "decode_rate": decode[-1]["tok_s"]}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model": MODEL, "backends": {"gpu": entry, "cpu": entry}}))
    rates = read_rates(str(path), parse_backends("gpu=cpu/max_active=2,cpu=cpu/max_active=4"))
    assert rates["gpu"]["decode_rate"] == pytest.approx(2 / 4.0 * 1000) and len(rates["gpu"]["decode"]) == 2
    assert rates["cpu"]["decode_rate"] == pytest.approx(4 / 6.0 * 1000) and len(rates["cpu"]["decode"]) == 3
    assert Timing.from_profile(rates["gpu"]).step_s == [0.003, 0.004]
    # a profile that stops short of max_active: eta still lets max_active run, at the largest measured step
    rates = read_rates(str(path), parse_backends("gpu=cpu/max_active=6,cpu=cpu/max_active=4"))
    assert Timing.from_profile(rates["gpu"]).step_s == [0.003, 0.004, 0.004, 0.006, 0.006, 0.006]
    assert rates["gpu"]["decode_rate"] == pytest.approx(decode[-1]["tok_s"])
