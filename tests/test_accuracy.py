"""Accuracy against float32 on real weights (SmolLM2-135M): the accurate CPU modes keep mean KL <= 0.005
nats/token, the lossy one does not, and `mvllm profile` writes both numbers."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mvllm.cli import app
from mvllm.engine import quant
from mvllm.engine.engine import EngineConfig
from mvllm.errors import InvalidRequestError
from mvllm.model.loader import build_model, resolve
from mvllm.profile import accuracy, run
from mvllm.profile.accuracy import KL_BOUND, MIN_TOKENS, SYNTHETIC_NOTE, compare, eval_tokens

CPU = torch.device("cpu")
runner = CliRunner()


def backend_model(source, dtype: str | None, mode: str | None):
    config = EngineConfig(model="-", dtype=dtype, quant=mode)
    config.validate()
    dt = getattr(torch, config.dtype)
    model = quant.quantize(build_model(source, CPU, dt), config.quant, CPU)
    if quant.packable(CPU, dt):
        quant.pack(model)
    return model, dt


def test_eval_text_is_long_enough(reference):
    assert len(reference.ids) >= MIN_TOKENS
    assert reference.logits.shape == (len(reference.ids), reference.source.config.vocab_size)


def test_compare_is_zero_on_itself_and_positive_otherwise():
    a = torch.randn(10, 50)
    same = compare(a, a.clone())
    assert same["kl_mean"] == pytest.approx(0, abs=1e-6) and same["top1"] == 1.0
    other = compare(a, a.flip(-1))
    assert other["kl_mean"] > 0.1 and other["top1"] < 1.0


# (dtype, quant) -> its measurement: "default" resolves to one of the explicit modes, measured once for both
measured: dict[tuple[str, str], dict] = {}


@pytest.mark.parametrize("mode", ["default", "dtype=bfloat16", "quant=int8w", "quant=int8-lossy"])
def test_accuracy_of_each_cpu_mode(reference, mode):
    if mode != "default" and mode not in quant.cpu_modes():
        pytest.skip(f"{mode} does not run on this machine")
    key, _, value = mode.partition("=")
    config = EngineConfig(model="-", dtype=value if key == "dtype" else None, quant=value if key == "quant" else None)
    config.validate()
    if (config.dtype, config.quant) not in measured:
        model, dt = backend_model(reference.source, config.dtype, config.quant)
        measured[config.dtype, config.quant] = reference.measure(model, CPU, dt)
    got = measured[config.dtype, config.quant]
    assert set(got) >= {"prefill", "decode", "kl_mean", "top1", "within_bound"}
    if mode == "quant=int8-lossy":
        assert got["kl_mean"] > 0.1 and not got["within_bound"]
    else:
        for p in ("prefill", "decode"):
            assert got[p]["kl_mean"] <= KL_BOUND and got[p]["top1"] >= 0.95, got
        assert got["within_bound"]


def test_eval_text_errors(smollm2, tiny, tmp_path):
    with pytest.raises(InvalidRequestError, match="context is 100"):
        eval_tokens(smollm2.engine.source, max_len=100)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        eval_tokens(resolve(str(tiny("llama")[0])))
    with pytest.raises(InvalidRequestError, match="cannot be read"):
        eval_tokens(smollm2.engine.source, tmp_path / "missing.txt")


def test_profile_writes_accuracy(reference, tmp_path, monkeypatch):
    monkeypatch.setattr(accuracy, "DECODE_CHUNK", 16)  # that profile writes both numbers is the question here
    monkeypatch.setattr(run, "Reference", lambda source: reference)  # the same model's float32 logits, made once
    out = tmp_path / "p.json"
    res = runner.invoke(app, ["profile", "--backends", "cpu=cpu/threads=1/max_step_tokens=64,"
                              "lossy=cpu/quant=int8-lossy/threads=1/max_step_tokens=64",
                              "--lengths", "16", "--repeats", "1", "--steps", "1", "--max-active", "1",
                              "--contexts", "", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())["backends"]
    assert data["cpu"]["accuracy"]["within_bound"] and data["cpu"]["picked"].startswith("picked")
    assert data["cpu"]["accuracy"]["path"] == "served"  # through the engine's own runner
    assert not data["lossy"]["accuracy"]["within_bound"]
    assert "LOSSY" in res.output and "accuracy against float32" in res.output


def test_profile_says_synthetic_has_no_accuracy(tmp_path):
    out = tmp_path / "p.json"
    res = runner.invoke(app, ["profile", "--model", "synthetic:tiny-qwen2", "--backends", "cpu=cpu/threads=1",
                              "--lengths", "16", "--repeats", "1", "--steps", "1", "--max-active", "1",
                              "--contexts", "", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["backends"]["cpu"]["accuracy"] == {"note": SYNTHETIC_NOTE}
    assert "n/a: synthetic weights" in res.output


def test_profile_without_tokenizer_fails_in_one_line(tiny):
    res = runner.invoke(app, ["profile", "--model", str(tiny("llama")[0]), "--backends", "cpu=cpu/threads=1",
                              "--lengths", "16", "--repeats", "1", "--steps", "1"])
    assert res.exit_code == 2 and "no tokenizer" in res.output
    assert len(res.output.strip().splitlines()) == 1
