"""`mvllm profile` end to end on a tiny model with two CPU backends, the profile contract, bad specs."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mvllm.cli import app
from mvllm.errors import MvllmError
from mvllm.profile.run import run_profile
from mvllm.routing.rates import load_profile

runner = CliRunner()
TINY = "synthetic:tiny-qwen2"


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "tiny.json"
    res = runner.invoke(app, ["profile", "--model", TINY, "--backends", "gpu=cpu/dtype=float32,cpu=cpu/quant=int8-lossy/threads=1",
                              "--lengths", "16,40", "--repeats", "1", "--steps", "2", "--max-active", "2",
                              "--baseline", "transformers", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_profile_writes_the_contract(profiled):
    data = json.loads(profiled.read_text())
    assert load_profile(profiled) == data
    assert data["model"] == TINY and data["created"]
    env = data["environment"]
    for key in ("cpu_model", "torch", "transformers", "date", "git_commit", "model"):
        assert key in env
    assert set(data["backends"]) == {"gpu", "cpu"}
    cpu, gpu = data["backends"]["cpu"], data["backends"]["gpu"]
    assert (cpu["quant"], cpu["threads"], gpu["quant"]) == ("int8-lossy", 1, "none")
    assert cpu["picked"] == gpu["picked"] == "as asked"
    assert cpu["accuracy"]["note"].startswith("synthetic weights")
    for b in (cpu, gpu):
        assert b["kv_blocks"] == 512
        assert b["device"] == "cpu" and b["dtype"] == "float32" and b["max_active"] == 2
        assert [p["tokens"] for p in b["prefill"] if p["kind"] == "cold"] == [16, 40]
        warm = next(p for p in b["prefill"] if p["kind"] == "warm")
        assert (warm["tokens"], warm["cached"]) == (20, 496)
        assert [d["batch"] for d in b["decode"]] == [1, 2]
        assert all(d["cached"] == 560 and 560 < d["context"] < 600 for d in b["decode"])
        cold40 = next(p["tok_s"] for p in b["prefill"] if p["tokens"] == 40)
        assert b["prefill_rate"] == cold40 and b["decode_rate"] == b["decode"][-1]["tok_s"]
        assert "max_active=2" in b["rule"]
        runs = b["baseline"]["runs"]["float32"]
        assert runs["prefill"][0]["tok_s"] > 0 and [d["batch"] for d in runs["decode"]] == [1, 2]
        ratio = b["baseline"]["ratios"]["decode_b2_same_dtype"]
        assert ratio == pytest.approx(b["decode"][-1]["tok_s"] / runs["decode"][-1]["tok_s"])


def test_profile_without_serving_has_no_serving_block(profiled):
    data = json.loads(profiled.read_text())
    assert "serving_s" not in data
    assert all("serving" not in b for b in data["backends"].values())


def test_serving_overheads_measured_through_the_server(tmp_path):
    """--serving: each backend's request_ms/step_ms through a real `mvllm serve`, the other backend busy, and
    step_ms_alone with it idle."""
    from mvllm.routing.eta import Timing

    out = tmp_path / "serving.json"
    res = runner.invoke(app, ["profile", "--model", TINY, "--backends", "gpu=cpu/threads=1,cpu=cpu/threads=1",
                              "--lengths", "16", "--repeats", "1", "--steps", "2", "--max-active", "2",
                              "--no-accuracy", "--serving", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = load_profile(out)
    assert data["serving_s"] > 0
    for name, b in data["backends"].items():
        s = b["serving"]
        assert 0 <= s["request_ms"] < 500 and 0 <= s["step_ms"] < 100, (name, s)
        m = s["measured"]
        assert m["served_as"] == name and m["others_busy"] == [{"gpu": "cpu", "cpu": "gpu"}[name]]
        assert len(m["ttft_ms"]) == 5 and m["uncached_tokens"] == 20  # the 496-token prefix was cached
        assert set(m["served_gap_ms"]) == {"1", "2"} and all(g > 0 for g in m["served_gap_ms"].values())
        assert s["step_ms"] == pytest.approx(max(0.0, sum(m["host_ms"].values()) / 2), abs=1e-2)
        assert set(m["served_gap_alone_ms"]) == {"1", "2"} and all(g > 0 for g in m["served_gap_alone_ms"].values())
        alone = sum(m["served_gap_alone_ms"][k] - m["profiled_step_ms"][k] for k in ("1", "2")) / 2
        assert s["step_ms_alone"] == pytest.approx(min(s["step_ms"], max(0.0, alone)), abs=1e-2)
        assert "every other backend decodes" in s["rule"]
        bare = Timing.from_profile({k: v for k, v in b.items() if k != "serving"})
        timing = Timing.from_profile(b)
        assert timing.request_s == pytest.approx(s["request_ms"] / 1000)
        assert timing.step_s[0] - bare.step_s[0] == pytest.approx(s["step_ms"] / 1000)
        assert timing.alone_s == pytest.approx((s["step_ms"] - s["step_ms_alone"]) / 1000)


def test_serving_roles():
    from mvllm.backends.spec import parse_backends
    from mvllm.profile.serving import roles, served_backends

    assert roles(["cpu", "gpu"]) == {"cpu": "cpu", "gpu": "gpu"}
    assert roles(["fast", "cpu", "slow"]) == {"fast": "gpu", "cpu": "cpu", "slow": "slow"}
    text = "a=cpu/threads=1/max_active=3,b=cpu"
    specs = parse_backends(text, 2)
    assert served_backends(specs, text, roles(["a", "b"])) == "gpu=cpu/threads=1/max_active=3,cpu=cpu/max_active=2"


def test_hand_written_profile_loads(tmp_path):
    path = tmp_path / "hand.json"
    path.write_text(json.dumps({"backends": {"gpu": {"prefill_rate": 2551, "decode_rate": 293},
                                             "cpu": {"prefill_rate": 73.0, "decode_rate": 45}}}))
    assert load_profile(path)["backends"]["cpu"]["decode_rate"] == 45


@pytest.mark.parametrize("text, words", [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a profile"),
    ('{"backends": {}}', "not a profile"),
    ('{"backends": {"cpu": {"prefill_rate": 10}}}', "decode_rate"),
    ('{"backends": {"cpu": {"prefill_rate": -1, "decode_rate": 3}}}', "prefill_rate"),
    ('{"backends": {"cpu": {"prefill_rate": "fast", "decode_rate": 3}}}', "prefill_rate"),
])
def test_bad_profiles_fail_clearly(tmp_path, text, words):
    path = tmp_path / "p.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(MvllmError, match=words):
        load_profile(path)


BAD = [
    ("gpu=tpu", "unknown device"),
    ("a=cpu,a=cpu", "given twice"),
    ("cpu=cpu/threads=0", "threads must be at least 1"),
    ("cpu=cpu/max_active=0", "max_active must be at least 1"),
    ("cpu=cpu/quant=int4", "quant must be one of"),
    ("cpu=cpu/quant=int8", "now called quant=int8-lossy"),
    ("cpu=cpu/fused=maybe", "bad value"),
    ("cpu=cpu/speed=fast", "unknown setting"),
]
if not torch.cuda.is_available():
    BAD.append(("gpu=cuda", "no CUDA GPU"))


@pytest.mark.parametrize("spec, words", BAD)
def test_bad_backend_specs_fail_before_loading(monkeypatch, spec, words):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("mvllm.profile.run.Engine", no_load)
    res = runner.invoke(app, ["profile", "--model", TINY, "--backends", spec])
    assert res.exit_code == 2
    assert words in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_baseline_model_carries_mvllm_weights():
    from mvllm import LLM, SamplingParams
    from mvllm.profile.baseline import hf_model

    prompt = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(3))
    hf = hf_model("synthetic:tiny-llama", "cpu", torch.float32, "none")
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0, 12:].tolist()
    out = LLM("synthetic:tiny-llama", dtype="float32", num_blocks=16).generate(
        [prompt[0].tolist()], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref


def test_profile_measures_each_backend_with_the_threads_serve_gives_it(monkeypatch):
    """serve runs each backend in its own process and splits the cores between CPU backends without a thread
    count (a GPU worker keeps one); profile applies the same split, or it would promise the speed of all the
    cores to each backend."""
    from mvllm import machine
    from mvllm.backends.spec import parse_backends, share_cores, with_threads

    monkeypatch.setattr(machine, "logical_cpus", lambda: 16)
    specs = parse_backends("gpu=cpu,cpu=cpu,x=cpu/threads=3", check_devices=False)
    share_cores(specs)
    assert [s.threads for s in specs] == [8, 8, 3]
    # beside a CUDA GPU: at most half the cores (a core each to its worker and the API process, and under bench
    # to the client, would leave 14 or 13); the backend written in as bench's servers get it
    specs = parse_backends("gpu=cuda,cpu=cpu", check_devices=False)
    assert "half of 16 logical CPUs, beside a CUDA GPU" in share_cores(specs)
    assert [s.threads for s in specs] == [1, 8]
    specs = parse_backends("gpu=cuda,cpu=cpu", check_devices=False)
    assert share_cores(specs, client=True).startswith("8 a CPU backend")
    assert with_threads("gpu=cuda,cpu=cpu,x=cpu/threads=3", client=True) == \
        "gpu=cuda,cpu=cpu/threads=8,x=cpu/threads=3"  # the one without a count written in
    with monkeypatch.context() as m:  # an M2: its 4 performance cores of 8, one left to the MPS worker; the API
        m.setattr(machine, "system", lambda: "darwin")  # process and the client have the efficiency cores
        m.setattr(machine, "arch", lambda: "arm64")
        m.setattr(machine, "logical_cpus", lambda: 8)
        m.setattr(machine, "sysctl", {"hw.perflevel0.physicalcpu": 4}.get)
        specs = parse_backends("gpu=mps,cpu=cpu", check_devices=False)
        share_cores(specs, client=True)
        assert [s.threads for s in specs] == [1, 3]
    monkeypatch.setattr(machine, "logical_cpus", lambda: 2)
    torch.set_num_threads(2)  # what profile would otherwise give each backend here
    try:
        entry = run_profile(TINY, parse_backends("gpu=cpu,cpu=cpu"), (16,), 1, 2, accuracy=False)["backends"]
    finally:
        torch.set_num_threads(1)
    assert entry["gpu"]["threads"] == entry["cpu"]["threads"] == 1


def test_profile_decodes_at_chosen_depths(tmp_path):
    """--contexts adds decode rows at each depth (batch 1 and 4), as llama-bench -d measures them; a depth past
    the context is skipped with a line; a bad value is one CLI line."""
    from typer.testing import CliRunner

    from mvllm.cli import app

    out = tmp_path / "p.json"
    res = CliRunner().invoke(app, ["profile", "--model", TINY, "--backends", "cpu=cpu/threads=1/max_active=4",
                                   "--lengths", "16", "--repeats", "1", "--steps", "2", "--no-accuracy",
                                   "--contexts", "0,40", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["backends"]["cpu"]["contexts"]
    assert [(r["depth"], r["batch"]) for r in rows] == [(0, 1), (0, 4), (40, 1), (40, 4)]
    assert all(r["step_ms"] > 0 and r["context"] == max(r["depth"], 1) + 2 for r in rows)
    assert "decode by depth" in res.output
    bad = CliRunner().invoke(app, ["profile", "--model", TINY, "--contexts", "0,-5"])
    assert bad.exit_code == 2 and "--contexts must be 0 or more" in bad.output


def test_serve_warns_where_its_profile_measured_other_threads(tmp_path):
    from mvllm.backends.spec import parse_backends
    from mvllm.routing.rates import load_profile
    from mvllm.server.serve import thread_warnings

    path = tmp_path / "profile.json"
    rates = {"prefill_rate": 1000.0, "decode_rate": 100.0}
    path.write_text(json.dumps({"model": "m", "backends": {"gpu": rates | {"threads": 1},
                                                           "cpu": rates | {"threads": 8}}}))
    same = parse_backends("gpu=cpu/threads=1,cpu=cpu/threads=2", check_devices=False)
    same[1].threads = 8
    data = load_profile(path)
    assert thread_warnings(str(path), data, same) == []
    (line,) = thread_warnings(str(path), data, parse_backends("gpu=cpu/threads=1,cpu=cpu/threads=2"))
    assert "backend cpu with 8 thread(s); it serves with 2" in line and "\n" not in line
    assert thread_warnings(None, None, parse_backends("cpu=cpu")) == []
