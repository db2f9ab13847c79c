"""`mvllm bench`: for every sweep value, policy and run, a fresh server, warmed, then the replay."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from mvllm.backends import default_backends, parse_backends
from mvllm.bench import env as envinfo
from mvllm.bench.client import replay, served_model
from mvllm.bench.display import RunDisplay, run_line, table
from mvllm.bench.experiment import Experiment, ExperimentError, check_policy
from mvllm.bench.metrics import summarize
from mvllm.bench.process import ServerError, ServerProcess
from mvllm.bench.results import run_id, write_aggregate, write_json, write_requests
from mvllm.bench.workload import build, vocab_of
from mvllm.errors import MvllmError

EXTERNAL = "external"


def backend_text(exp: Experiment) -> str:
    return default_backends() if exp.backends == "default" else exp.backends


def _matches(path: Path, model: str, backends: str) -> bool:
    """An earlier auto profile in the results folder is reused only for the same model and backends."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    names = {b.name for b in parse_backends(backends)}
    return data.get("model") == model and set(data.get("backends", {})) == names


def find_profile(exp: Experiment, out: Path, backends: str, console: Console) -> Path | None:
    """The profile the server routes with: a file (relative to the cwd or to the experiment file),
    "auto" (measured once with `mvllm profile` into the results folder), or none."""
    if exp.profile is None:
        return None
    if exp.profile == "auto":
        path = out / "profile.json"
        if not _matches(path, exp.model, backends):
            cmd = [sys.executable, "-m", "mvllm.cli", "profile", "--model", exp.model, "--backends", backends,
                   "--out", str(path), *exp.profile_args]
            if exp.max_active is not None and "--max-active" not in exp.profile_args:
                cmd += ["--max-active", str(exp.max_active)]
            console.print(f"[dim]profiling the backends: {' '.join(cmd[2:])}[/dim]", highlight=False)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0 or not path.is_file():
                last = "\n".join("    " + x for x in (done.stderr or done.stdout).strip().splitlines()[-10:])
                raise MvllmError(f"`mvllm profile` failed (exit {done.returncode}):\n{last}")
        return path
    for base in (Path.cwd(), exp.path.parent if exp.path else Path.cwd()):
        path = (base / exp.profile).resolve()
        if path.is_file():
            from mvllm.profile import load_profile

            load_profile(path)
            return path
    raise ExperimentError(f"key 'profile': no profile file {exp.profile!r} (looked relative to the current "
                          f"folder and to the experiment file)")


def server_args(exp: Experiment, policy: str, backends: str, profile: Path | None, folder: Path) -> list[str]:
    args = ["--model", exp.model, "--backends", backends, "--policy", policy,
            "--routing-log", str(folder / "routing.jsonl")]
    if profile is not None:
        args += ["--profile", str(profile)]
    if exp.max_active is not None:
        args += ["--max-active", str(exp.max_active)]
    return args


def one_run(exp: Experiment, policy: str, url: str | None, backends: str | None, profile: Path | None,
            folder: Path, label: str, console: Console, quiet: bool) -> dict:
    vocab = vocab_of(exp.model, exp.workload)
    prefix, requests = build(exp.workload, vocab)
    meta = {"warm_cached_tokens": None}
    server = None
    if url is None:
        server = ServerProcess(server_args(exp, policy, backends, profile, folder), folder / "server.log").start()
        meta["server_command"] = server.command
    try:
        if server is not None:
            with console.status(f"{label}: starting the server"):
                server.wait_ready(exp.ready_timeout)
                if exp.workload.warm and prefix:
                    meta["warm_cached_tokens"] = server.warm(prefix)
            url = server.url
        model = served_model(url) or exp.model
        display = RunDisplay(console, label, len(requests))
        with display if not quiet else _Null():
            records, duration, start = asyncio.run(replay(url, model, requests, exp.request_timeout,
                                                   None if quiet else display.done))
    finally:
        if server is not None:
            server.stop()
    summary = {"experiment": exp.name, "policy": policy, "model": exp.model, "backends": backends,
               "max_active": exp.max_active, "url": url if server is None else None,
               "profile": str(profile) if profile else None, "workload": asdict(exp.workload), "start_time": start, **meta}
    summary.update(summarize(records, duration))
    write_requests(folder / "requests.csv", records)
    return summary


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def bench(exp: Experiment, out: Path, policies: list[str] | None = None, runs: int | None = None,
          url: str | None = None, console: Console | None = None, quiet: bool = False) -> list[dict]:
    """Run the experiment; returns the aggregate rows. Each finished run is on disk before the next
    starts, so an error or Ctrl-C loses nothing already measured."""
    console = console or Console(stderr=True)
    if url is not None and policies and not quiet:
        console.print("[dim]note: --policy does not apply with --url; the server routes as it is set up[/dim]")
    policies = [check_policy(p) for p in (policies or exp.policies)] if url is None else [EXTERNAL]
    runs = runs if runs is not None else exp.runs
    if runs < 1:
        raise ExperimentError(f"--runs must be at least 1, got {runs}")
    backends = None
    if url is None:
        backends = backend_text(exp)
        parse_backends(backends, exp.max_active)
    url = url.rstrip("/") if url else None
    out.mkdir(parents=True, exist_ok=True)
    if exp.path is not None and exp.path.resolve() != (out / "experiment.toml").resolve():
        shutil.copyfile(exp.path, out / "experiment.toml")
    write_json(out / "experiment.json", asdict(exp))
    profile = find_profile(exp, out, backends, console) if url is None else None
    specs = parse_backends(backends, exp.max_active) if backends else None
    total = len(exp.points()) * len(policies) * runs
    planned = {run_id(p, i, exp.sweep.knob if exp.sweep else None, v)
               for v, _ in exp.points() for p in policies for i in range(1, runs + 1)}
    kept = sorted(p.parent.name for p in out.glob("*/summary.json") if p.parent.name not in planned)
    if kept and not quiet:
        console.print(f"[dim]note: {len(kept)} earlier run(s) in {out} are kept and aggregated with these: "
                      f"{', '.join(kept[:6])}{' ...' if len(kept) > 6 else ''}[/dim]", highlight=False)
    done = 0
    try:
        for value, point in exp.points():
            for policy in policies:
                for i in range(1, runs + 1):
                    knob = exp.sweep.knob if exp.sweep else None
                    rid = run_id(policy, i, knob, value)
                    folder = out / rid
                    shutil.rmtree(folder, ignore_errors=True)
                    folder.mkdir(parents=True)
                    write_json(folder / "env.json", envinfo.describe(specs))
                    label = f"[{done + 1}/{total}] {rid}"
                    s = one_run(point, policy, url, backends, profile, folder, label, console, quiet)
                    s.update({"run_id": rid, "run": i, "knob": knob, "value": value})
                    write_json(folder / "summary.json", s)
                    done += 1
                    write_aggregate(out)
                    if not quiet:
                        console.print(run_line(label, s), highlight=False)
    except KeyboardInterrupt:
        raise MvllmError(f"interrupted; {done} finished run(s) are saved in {out}") from None
    except ServerError as e:
        raise ServerError(f"{e}\n{done} finished run(s) are saved in {out}") from None
    rows = write_aggregate(out)
    if not quiet:
        Console(width=None if sys.stdout.isatty() else 160).print(table(rows, f"{exp.name}: {exp.model}, means over runs (change against gpu-only)"))
    return rows

