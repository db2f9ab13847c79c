"""`mvllm bench`: for every sweep value, policy and run, a fresh server, warmed, then the replay."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import httpx
from rich.console import Console

from mvllm.backends.spec import default_backends, parse_backends, set_option, spec_budget, with_threads
from mvllm.bench.client import check_reachable, served_model
from mvllm.bench.display import RunDisplay, run_line, table
from mvllm.bench.experiment import Experiment, ExperimentError, check_policy, find_profile
from mvllm.bench.health import summarize_client, warning
from mvllm.bench.loadgen import auto_workers, generate
from mvllm.bench.metrics import summarize
from mvllm.bench.process import ServerError, ServerProcess
from mvllm.bench.request import Request
from mvllm.bench.results import run_id, write_aggregate, write_json, write_requests
from mvllm.bench.workload import Built, build_all, selection_line, vocab_of
from mvllm.errors import MvllmError
from mvllm.routing.policies.registry import uses_slo
from mvllm.tables import WIDTH


def describe(specs) -> dict:
    """The machine and versions a run records (mvllm.env imports torch: 2-3 s of CPU, which a command that stops
    on bad input, or a bench that only drives servers, need not pay until its first run)."""
    from mvllm import env

    return env.describe(specs)

EXTERNAL = "external"


def backend_text(exp: Experiment) -> str:
    """The experiment's backends, each CPU backend's threads written in as share_cores gives them beside bench's
    client: the profile bench measures and the servers it starts run the same threads."""
    return with_threads(default_backends() if exp.backends == "default" else exp.backends, client=True,
                        apis=exp.api_servers)


def _largest(exp: Experiment) -> dict[str, int]:
    """Each backend's largest max_active over the experiment's sweep points: what a profile must cover."""
    need: dict[str, int] = {}
    for _, point in exp.points():
        for spec in parse_backends(backend_text(point), point.max_active):
            need[spec.name] = max(need.get(spec.name, 0), spec.max_active)
    return need


def _specs(exp: Experiment):
    """Every backend spec of every point, as bench starts it (settings only: no device checked)."""
    for _, point in exp.points():
        yield from parse_backends(backend_text(point), point.max_active, check_devices=False)


def _budgets(exp: Experiment) -> dict[str, int | None]:
    """The step budget each backend runs: its spec's max_step_tokens, else the default for its device where
    this host can tell it (the CPU and MPS; a CUDA device present here); None where not known."""
    return {spec.name: spec_budget(spec) for spec in _specs(exp)}


def _threads(exp: Experiment) -> dict[str, int]:
    """The threads each local CPU backend runs."""
    return {s.name: s.threads for s in _specs(exp) if s.device == "cpu" and s.threads is not None}


def _matches(path: Path, model: str, need: dict[str, int], budgets: dict[str, int | None] | None = None,
             threads: dict[str, int] | None = None) -> bool:
    """An earlier profile in the results folder is reused for the same model and backend names when it
    measured every batch size up to each backend's max_active (the server cuts it to what it serves), its
    budgeted steps (`chunks`) under the budget each backend runs (`budgets`: None where not known here), and each
    CPU backend with the threads it runs (`threads`)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    have = data.get("backends", {})
    budgets, threads = budgets or {}, threads or {}
    return (data.get("model") == model and set(have) == set(need)
            and all(int(have[b].get("max_active") or 0) >= n for b, n in need.items())
            and all(have[b].get("chunks") and have[b].get("max_step_tokens") for b in need)
            and all(have[b]["max_step_tokens"] == n for b, n in budgets.items() if n and b in have)
            and all(have[b].get("threads") == n for b, n in threads.items() if b in have))


def measure(exp: Experiment, path: Path, console: Console) -> None:
    """An "auto" profile: measured with `mvllm profile` into `path`, unless the one there already serves."""
    need = _largest(exp)
    if _matches(path, exp.model, need, _budgets(exp), _threads(exp)):
        return
    backends = backend_text(exp)
    for name, n in need.items():
        backends = set_option(backends, name, "max_active", str(n))
    cmd = [sys.executable, "-m", "mvllm.cli", "profile", "--model", exp.model, "--backends", backends,
           "--out", str(path), *exp.profile_args]
    console.print(f"[dim]profiling the backends: {' '.join(cmd[2:])}[/dim]", highlight=False)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not path.is_file():
        last = "\n".join("    " + x for x in (done.stderr or done.stdout).strip().splitlines()[-10:])
        raise MvllmError(f"`mvllm profile` failed (exit {done.returncode}):\n{last}")


def check_profile(exp: Experiment, policies: list[str], profile: Path | None) -> None:
    """A policy that prices backends by their speed needs a profile that has every backend: said before the
    first run, not after the policies before it have run."""
    from mvllm.routing.policies import make_policy
    from mvllm.server.serve import read_rates

    for _, point in exp.points():
        specs = parse_backends(backend_text(point), point.max_active)
        names = [s.name for s in specs]
        rates = read_rates(str(profile), specs) if profile else {}
        for policy in policies:
            p = make_policy(policy, names)
            if not (p.needs_rates or p.needs_timing or p.needs_drain):
                continue
            missing = [b for b in names if not {"prefill_rate", "decode_rate"} <= set(rates.get(b) or {})]
            if missing:
                raise ExperimentError(f"policy {policy} needs each backend's profiled speed, and "
                                      f"{'no profile has' if not profile else f'{profile} lacks'} backend(s) "
                                      f"{', '.join(missing)}: set profile = \"auto\" in {exp.name}'s file "
                                      "(bench measures it) or a profile made by `mvllm profile`")


def slo_text(slo: dict[str, float]) -> str:
    """{"ttft_ms": 2000.0, ...} as --slo's form, "ttft:2000 ..."."""
    return " ".join(f"{k.removesuffix('_ms')}:{v:g}" for k, v in slo.items())


def server_args(exp: Experiment, policy: str, profile: Path | None, routing_log: Path) -> list[str]:
    args = ["--model", exp.model, "--backends", backend_text(exp), "--policy", policy,
            "--routing-log", str(routing_log)]
    if uses_slo(policy) and exp.goodput:
        args += ["--target-slo", slo_text(exp.goodput)]
    if profile is not None:
        args += ["--profile", str(profile)]
    if exp.max_active is not None:
        args += ["--max-active", str(exp.max_active)]
    if exp.api_servers > 1:
        args += ["--api-servers", str(exp.api_servers)]
    return args


class Servers:
    """The servers runs are made against. "fresh": a new one for every run, logging into the run's folder.
    "shared": one per model, backends and max_active, logging into out/server-N/; before each run its
    prefix caches are emptied and its policy set, and the run's slice of its routing log is copied out. When
    it stops, its own routing log goes (every line of it is in some run's folder) unless a run broke off
    before its slice was copied."""

    def __init__(self, mode: str, out: Path, profile: Path | None):
        self.mode, self.out, self.profile = mode, out, profile
        self.server: ServerProcess | None = None
        self.log: Path | None = None
        self.key: tuple | None = None
        self.count = 0
        self.unsliced = False  # a run's lines of the shared log not yet copied into its folder
        self.new = False  # the last start() started a server (not one kept from a run before)

    def start(self, exp: Experiment, policy: str, folder: Path) -> tuple[ServerProcess, Path]:
        """Ready server for one run, and its routing log."""
        server, log = self._start(exp, policy, folder)
        self.unsliced = self.mode == "shared"  # after any stop of the previous server, whose runs are sliced
        return server, log

    def _start(self, exp: Experiment, policy: str, folder: Path) -> tuple[ServerProcess, Path]:
        if self.mode == "fresh":
            self.stop()
            home = folder
        else:
            key = (exp.model, backend_text(exp), exp.max_active, exp.api_servers)
            if key == self.key and self.server is not None:
                self.new = False
                self.reset(policy, exp.goodput if uses_slo(policy) else None)
                return self.server, self.log
            self.stop()
            self.count += 1
            home = self.out / f"server-{self.count}"
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
            self.key = key
        self.log = home / "routing.jsonl"
        self.server = ServerProcess(server_args(exp, policy, self.profile, self.log), home / "server.log").start()
        self.server.wait_ready(exp.ready_timeout)
        self.new = True
        return self.server, self.log

    def reset(self, policy: str, slo: dict | None = None) -> None:
        choice = {"policy": policy, **({"slo": slo_text(slo)} if slo else {})}
        for path, body in (("/reset_prefix_cache", None), ("/v1/policy", choice)):
            r = self.server.http.post(self.server.url + path, json=body, timeout=120.0)
            if r.status_code != 200:
                raise ServerError(f"POST {path} failed: HTTP {r.status_code}: {r.text[:300]}")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            if self.mode == "shared" and self.log is not None and not self.unsliced:
                self.log.unlink(missing_ok=True)
        self.server, self.key = None, None


def step_budgets(url: str) -> dict[str, int | None]:
    """Each backend's max_step_tokens as the server reports it (/v1/backends); None where it does not."""
    try:
        return {b["name"]: b.get("max_step_tokens") for b in httpx.get(f"{url}/v1/backends", timeout=10).json()}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return {}


def warm_up(url: str, model: str | None, requests: list[Request], exp: Experiment, stop: str, vocab: int) -> dict:
    """The first `exp.warmup` requests that open a conversation, sent at once and their replies dropped: a server's
    first steps of each shape may compile or allocate (the GPU's did: gpu-only's first 3 s on a fresh server at
    the trace's 3x point), which no run should time. vLLM's `bench serve --num-warmups` does the same."""
    first = [replace(r, arrival=0.0) for r in requests if r.parent is None][:exp.warmup]
    records, duration, _, _ = generate(url, model, first, exp.request_timeout, exp.client_workers or auto_workers(),
                                       None, stop, vocab)
    return {"requests": len(first), "failed": sum(not r.ok for r in records), "duration_s": round(duration, 3)}


def one_run(exp: Experiment, policy: str, url: str | None, servers: Servers | None, folder: Path, label: str,
            console: Console, quiet: bool, built: Built) -> dict:
    """One run of `built` (exp's workload, built once for all its runs: replays do not change it)."""
    vocab = vocab_of(exp.model, exp.workload)
    prefix, requests = built.prefix if exp.workload.warm else [], built.requests
    meta = {"warm_cached_tokens": None}
    server = None
    try:
        if url is None:
            with console.status(f"{label}: preparing the server"):
                server, log = servers.start(exp, policy, folder)
                meta.update(server_command=server.command, server=servers.mode)
            url = server.url
        model = served_model(url) or exp.model
        stop = "disconnect" if server is None else "field"  # any OpenAI server: stop reading at the length
        if server is not None:
            if servers.new and exp.warmup:  # then its caches emptied and its policy set anew: a fresh state
                with console.status(f"{label}: warming the server up ({exp.warmup} requests at once)"):
                    meta["warmup"] = warm_up(url, model, requests, exp, stop, vocab)
                    servers.reset(policy, exp.goodput if uses_slo(policy) else None)
            with console.status(f"{label}: preparing the server"):
                offset = log.stat().st_size if log.is_file() else 0  # the run's routing log starts here
                if exp.workload.warm and prefix:
                    meta["warm_cached_tokens"] = server.warm(prefix)
            meta["max_step_tokens"] = step_budgets(url)
        display = RunDisplay(console, label, len(requests))
        workers = exp.client_workers or auto_workers()
        with display if not quiet else nullcontext():
            records, duration, start, health = generate(url, model, requests, exp.request_timeout, workers,
                                                        None if quiet else display.done, stop, vocab)
    finally:
        if servers is not None and servers.mode == "fresh":
            servers.stop()
    if server is not None and log.is_file() and (log != folder / "routing.jsonl" or offset):
        with open(log, "rb") as f:  # the run's lines: not a run before's, nor the warm-up's
            f.seek(offset)
            lines = f.read()
        (folder / "routing.jsonl").write_bytes(lines)
        servers.unsliced = False
    workload = asdict(exp.workload) | {"requests": len(requests), "stop": stop if exp.workload.hidden else None}
    summary = {"experiment": exp.name, "policy": policy, "model": exp.model if server else model,  # --url: its own
               "backends": backend_text(exp) if server else None, "max_active": exp.max_active,
               "api_servers": exp.api_servers if server else None,
               "url": url if server is None else None, "profile": str(servers.profile) if server and servers.profile
               else None, "workload": workload, "start_time": start, **meta}
    summary.update(summarize(records, duration, exp.goodput))
    summary["client"] = summarize_client(records, health, summary["median_ttft_ms"])
    write_requests(folder / "requests.csv", records)
    if not quiet and (line := warning(summary["client"])):
        console.print(f"[yellow]{label}: {line}[/yellow]", highlight=False)
    return summary


def workloads(exp: Experiment, out: Path, console: Console, quiet: bool) -> dict:
    """Each sweep point's workload, built once before any server starts (a bad trace fails first); what each
    selected is printed and saved as workload.json ({value: selection} for a sweep)."""
    built = {}
    for value, point in exp.points():
        built[value] = build_all(point.workload, vocab_of(point.model, point.workload), point.model)
        if not quiet:
            line = selection_line(built[value].selection)
            console.print(f"[dim]{'' if value is None else f'{exp.sweep.knob}={value}: '}{line}[/dim]", highlight=False)
    sel = {str(v): b.selection for v, b in built.items()}
    write_json(out / "workload.json", sel[str(None)] if exp.sweep is None else sel)
    return built


def prepare(exp: Experiment, out: Path, policies: list[str] | None, url: str | None, console: Console,
            quiet: bool, home: Path | None = None) -> tuple[list[str], str | None, dict, Path | None]:
    """Everything before the first run, each check before anything slow: the policies (["external"] with a
    url), the url (reached), each sweep point's workload built (`workloads`), the profile (measured where
    "auto", as `home`/profile.json, default `out`'s) and that it serves the policies; the experiment copied
    into `out`."""
    if url is not None and "oracle" in (policies or []):
        raise ExperimentError("policy oracle reads the true output lengths, which bench sends only to the servers "
                              "it starts; a server at --url routes as it is set up and is never told them")
    if url is not None and policies and not quiet:
        console.print("[dim]note: --policy does not apply with --url; the server routes as it is set up[/dim]")
    policies = [check_policy(p) for p in (policies or exp.policies)] if url is None else [EXTERNAL]
    if url is None:
        for _, point in exp.points():
            parse_backends(backend_text(point), point.max_active)
    url = url.rstrip("/") if url else None
    if url is not None:
        check_reachable(url)
    out.mkdir(parents=True, exist_ok=True)
    if exp.path is not None and exp.path.resolve() != (out / "experiment.toml").resolve():
        shutil.copyfile(exp.path, out / "experiment.toml")
    write_json(out / "experiment.json", asdict(exp))
    built = workloads(exp, out, console, quiet)
    if url is not None and exp.warmup:  # a server bench did not start: warmed once, its caches left as they are
        first = next(iter(built.values())).requests
        with console.status(f"warming {url} up ({exp.warmup} requests at once)"):
            done = warm_up(url, served_model(url), first, exp, "disconnect", vocab_of(exp.model, exp.workload))
        if not quiet:
            console.print(f"[dim]warm-up: {done['requests']} requests in {done['duration_s']:.1f} s, {done['failed']} "
                          "failed; the server's caches were not emptied after it[/dim]", highlight=False)
    profile = find_profile(exp, home or out, lambda e, path: measure(e, path, console)) if url is None else None
    if url is None:
        check_profile(exp, policies, profile)
    return policies, url, built, profile


def bench(exp: Experiment, out: Path, policies: list[str] | None = None, runs: int | None = None,
          url: str | None = None, console: Console | None = None, quiet: bool = False) -> list[dict]:
    """Run the experiment; returns the aggregate rows. Each finished run is on disk before the next
    starts, so an error or Ctrl-C loses nothing already measured."""
    console = console or Console(stderr=True)
    runs = runs if runs is not None else exp.runs
    if runs < 1:
        raise ExperimentError(f"--runs must be at least 1, got {runs}")
    policies, url, built, profile = prepare(exp, out, policies, url, console, quiet)
    servers = Servers(exp.server, out, profile) if url is None else None
    total = len(exp.points()) * len(policies) * runs
    knob = exp.sweep.knob if exp.sweep else None
    planned = {run_id(p, i, knob, v) for v, _ in exp.points() for p in policies for i in range(1, runs + 1)}
    kept = sorted(p.parent.name for p in out.glob("*/summary.json") if p.parent.name not in planned)
    if kept and not quiet:
        console.print(f"[dim]note: {len(kept)} earlier run(s) in {out} are kept and aggregated with these: "
                      f"{', '.join(kept[:6])}{' ...' if len(kept) > 6 else ''}[/dim]", highlight=False)
    done = 0
    try:
        for value, point in exp.points():
            specs = parse_backends(backend_text(point), point.max_active) if url is None else None
            for i in range(1, runs + 1):
                for policy in policies:  # runs interleave the policies: drift hits each alike
                    rid = run_id(policy, i, knob, value)
                    folder = out / rid
                    shutil.rmtree(folder, ignore_errors=True)
                    folder.mkdir(parents=True)
                    env = describe(specs)
                    label = f"[{done + 1}/{total}] {rid}"
                    s = one_run(point, policy, url, servers, folder, label, console, quiet, built[value])
                    s.update({"run_id": rid, "run": i, "knob": knob, "value": value, "environment": env})
                    write_json(folder / "summary.json", s)
                    done += 1
                    write_aggregate(out)
                    if not quiet:
                        console.print(run_line(label, s), highlight=False)
    except KeyboardInterrupt:
        raise MvllmError(f"interrupted; {done} finished run(s) are saved in {out}") from None
    except ServerError as e:
        raise ServerError(f"{e}\n{done} finished run(s) are saved in {out}") from None
    finally:
        if servers is not None:
            servers.stop()
    rows = write_aggregate(out)
    if not quiet:
        served = served_model(url) if url else None  # --url: the model that server serves, not the experiment's
        Console(width=None if sys.stdout.isatty() else WIDTH).print(
            table(rows, f"{exp.name}: {served or exp.model}, means over runs (change against gpu-only)"))
    return rows

