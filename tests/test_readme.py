"""Every `mvllm ...` command the README shows names a subcommand and flags that exist; the ones that finish in
seconds on a CPU run as written (marked slow: `--out` in a temporary folder, nothing tracked written)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from mvllm.cli import app

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The README's commands: indented lines (with their backslash continuations) and inline `mvllm ...`
    spans, comments and the [optional] brackets taken off."""
    lines = (ROOT / "README.md").read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("    mvllm "):
            text = line.strip()
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            found.append(text)
        found += re.findall(r"`(mvllm [^`]+)`", line)
        i += 1
    return [re.sub(r"\s+#.*$", "", c).replace("[", "").replace("]", "") for c in found]


def parts(command: str) -> tuple[str, list[str]]:
    words = shlex.split(command)
    assert words[0] == "mvllm", command
    return words[1], [w.split("=", 1)[0] for w in words[2:] if w.startswith("--")]


def test_every_readme_command_names_a_subcommand_and_flags_that_exist():
    group = typer.main.get_command(app)
    commands = readme_commands()
    assert len(commands) >= 12, commands  # the command block and the inline ones were found
    for command in commands:
        name, flags = parts(command)
        assert name in group.commands, f"README: `{command}`: no subcommand {name!r}"
        known = {opt for p in group.commands[name].params for opt in p.opts + p.secondary_opts}
        missing = [f for f in flags if f not in known]
        assert not missing, f"README: `{command}`: {name} has no {', '.join(missing)}"


def test_the_extraction_sees_continuations_and_options():
    commands = readme_commands()
    serve = next(c for c in commands if c.startswith("mvllm serve") and "--profile" in c)
    assert parts(serve)[1][-3:] == ["--policy", "--routing-log", "--restart-backends"]
    assert parts("mvllm bench x.toml --runs 3 --url=http://h:1")[1] == ["--runs", "--url"]


@pytest.mark.slow
def test_readme_commands_that_take_seconds_run_as_written(tmp_path):
    """env, simulate and report as the README shows them, each with --out in a temporary folder where it writes:
    simulate finds the experiment's profile or a committed one of the same model and backends, and says which."""
    runs = {"mvllm env": [], "mvllm env --backends gpu=cuda,cpu=cpu --json": None,
            "mvllm simulate experiments/paper-48.toml": ["--out", str(tmp_path / "sim")],
            "mvllm report results/paper-48": ["--out", str(tmp_path / "report")]}
    commands = readme_commands()
    for command, out in runs.items():
        assert command in commands, f"the README no longer shows `{command}`"
        if out is None:  # gpu=cuda: this machine may have no CUDA; the line says so, in one line, exit 2
            continue
        done = subprocess.run([sys.executable, "-m", "mvllm.cli", *shlex.split(command)[1:], *out],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, f"`{command}`: {done.stderr[-2000:]}"
        if "simulate" in command:
            assert "profile: results/paper-48/profile.json, measured on NVIDIA H200" in done.stderr
    assert (tmp_path / "report" / "summary.md").is_file() and list((tmp_path / "sim").glob("*/summary.json"))


def test_simulate_without_the_experiments_profile_uses_a_committed_one(tmp_path):
    from mvllm.bench import experiment as ex

    exp = ex.load(ROOT / "experiments" / "shared-prefix.toml")
    path, same = ex.committed_profile(exp, ROOT / "results")
    assert path is not None and path in same and path.name == "profile.json"
    assert (path.parent / "shared-prefix" / "experiment.toml").is_file() or \
        (path.parent.parent / "shared-prefix" / "experiment.toml").is_file()  # a committed run of it
    assert re.fullmatch(r".+, \d{4}-\d\d-\d\d", ex.measured_on(path))
    toml = tmp_path / "x.toml"
    toml.write_text('name = "no-such-run"\nmodel = "synthetic:qwen2.5-0.5b"\nbackends = "gpu=mps,cpu=cpu"\n'
                    'profile = "auto"\npolicies = ["gpu-only"]\n')
    assert ex.committed_profile(ex.load(toml), ROOT / "results")[0] is None  # no committed profile on mps
    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "simulate", str(toml)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "no committed profile has synthetic:qwen2.5-0.5b on backends gpu=mps,cpu=cpu" in done.stderr
    assert "(those of synthetic:qwen2.5-0.5b: " in done.stderr and "results/paper-48/profile.json" in done.stderr
