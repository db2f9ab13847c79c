"""Every subcommand's --help renders (help texts hold brackets that must not be read as markup)."""

import pytest
from typer.testing import CliRunner

from mvllm.cli import app


@pytest.mark.parametrize("command", ["generate", "profile", "serve", "bench", "report"])
def test_help_renders(command):
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output and "--" in result.output


def test_serve_rejects_bad_input_before_loading_anything():
    runner = CliRunner()
    for args, message in [
        (["--backends", "gpu=cpu,gpu=cpu", "--policy", "gpu-only"], "given twice"),
        (["--backends", "gpu=cpu,cpu=cpu", "--policy", "fastest"], "unknown policy"),
        (["--backends", "gpu=cpu,cpu=cpu", "--policy", "mixed"], "--profile"),
        (["--backends", "gpu=cpu,cpu=cpu", "--policy", "mixed", "--profile", "/nonexistent.json"], "does not exist"),
        (["--backends", "gpu=tpu,cpu=cpu", "--policy", "gpu-only"], "unknown device"),
    ]:
        result = runner.invoke(app, ["serve", "--model", "synthetic:tiny-qwen2", *args])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output


def test_serve_says_an_unknown_policy_before_checking_the_backends(monkeypatch):
    """Checking the backends starts a process that imports torch (seconds): a misspelt policy is said first."""
    def never(*a, **k):
        raise AssertionError("the backends were checked first")

    monkeypatch.setattr("mvllm.server.serve.parse_apart", never)
    for policy, message in (("fastest", "unknown policy 'fastest'"), ("split:x", "K must be")):
        result = CliRunner().invoke(app, ["serve", "--model", "synthetic:tiny-qwen2", "--policy", policy])
        assert result.exit_code == 2 and message in result.output, result.output


def test_serve_policy_defaults_to_the_one_backend_else_eta_with_a_profile_else_gpu_only():
    from mvllm.server.serve import choose_policy

    assert choose_policy(None, None) == "gpu-only"
    assert choose_policy(None, "profile.json") == "eta"
    assert choose_policy("mixed", None) == "mixed"
    assert choose_policy(None, None, ["cpu"]) == "cpu-only"
    assert choose_policy(None, "profile.json", ["gpu"]) == "gpu-only"
    assert choose_policy(None, None, ["mine"]) == "round-robin"  # no mine-only: the only backend to turn to
    assert choose_policy(None, None, ["gpu", "cpu"]) == "gpu-only"
    assert choose_policy("gpu-only", None, ["cpu"]) == "gpu-only"  # asked for: its error stays


def test_serve_warns_once_per_lossy_backend_and_refuses_modes_this_machine_lacks(monkeypatch):
    from mvllm.backends.spec import parse_backends
    from mvllm.kernels import cpu_int8
    from mvllm.server.serve import lossy_warnings

    specs = parse_backends("gpu=cpu/dtype=float32,a=cpu/quant=int8-lossy,b=cpu/quant=int8-lossy")
    lines = lossy_warnings(specs)
    assert len(lines) == 2 and all("changes the model's answers" in line for line in lines)
    result = CliRunner().invoke(app, ["serve", "--model", "synthetic:tiny-qwen2", "--backends",
                                      "gpu=cpu,cpu=cpu/quant=int8-lossy", "--policy", "mixed"])
    assert result.exit_code == 2 and "warning: backend cpu runs quant=int8-lossy" in result.output

    monkeypatch.setattr(cpu_int8, "available", lambda: False)
    monkeypatch.setattr(cpu_int8, "why_unavailable", "RuntimeError: ninja not found")
    result = CliRunner().invoke(app, ["serve", "--model", "synthetic:tiny-qwen2", "--backends",
                                      "gpu=cpu,cpu=cpu/quant=int8w"])
    assert result.exit_code == 2, result.output
    assert "quant=int8w does not run on this machine (RuntimeError: ninja not found)" in result.output
    assert "dtype=float32" in result.output and len(result.output.strip().splitlines()) == 1
