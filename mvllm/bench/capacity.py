"""`mvllm bench --slo`: each point of the capacity search (mvllm/capacity.py) is one bench run of the experiment
at that load against live servers, saved as bench saves a run (<out>/capacity/<knob>=<value>-<policy>-run1/,
with the aggregate beside: `mvllm report` draws them as a sweep), its share meeting the SLO counted by bench's
own summary (metrics.summarize's good_requests, by `meets`) over every request sent, failed ones included.

The servers are bench's (runner.Servers): one server per policy, reused across that policy's points with its
prefix caches emptied and its policy set anew before each (a fresh router state, as a fresh server's); with
`server = "shared"` one server for every policy. With --url every point runs against that server.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rich.console import Console

from mvllm.backends.spec import parse_backends
from mvllm.bench.display import run_line
from mvllm.bench.experiment import Experiment
from mvllm.bench.loadgen import auto_workers
from mvllm.bench.results import run_id, write_aggregate, write_json
from mvllm.bench.runner import Servers, backend_text, describe, one_run, prepare
from mvllm.bench.workload import build_all, vocab_of
from mvllm.errors import MvllmError


class Live:
    """`with Live(exp, folder, ...) as live:` then live.measure(policy, load, the experiment at that load) runs
    one point and returns its row; live.policies are the policies run (["external"] with a url), live.info
    what capacity.json adds. The servers stop at the end."""

    def __init__(self, exp: Experiment, folder: Path, policies: list[str] | None, url: str | None, slo: dict,
                 knob: str, unit: str, console: Console, quiet: bool = False, home: Path | None = None):
        self.exp, self.folder, self.slo, self.knob, self.unit = exp, folder, slo, knob, unit
        self.console, self.quiet = console, quiet
        kept = [p.parent.name for p in folder.glob("*/summary.json")]
        if kept and not quiet:
            console.print(f"[dim]note: {len(kept)} earlier run(s) in {folder} are kept and aggregated with these "
                          "(aggregate.json; capacity.json holds this search's alone)[/dim]", highlight=False)
        self.policies, self.url, _, profile = prepare(exp, folder, policies, url, console, quiet, home)
        self.servers = Servers("shared", folder, profile) if self.url is None else None
        self.policy: str | None = None
        self.count = 0
        self.info = {"measured": True, "url": self.url, "profile": str(profile) if profile else None,
                     "server": None if self.url else ("one for every policy" if exp.server == "shared" else
                                                      "one per policy, kept across its points"),
                     "client_workers": exp.client_workers or auto_workers()}

    def measure(self, policy: str, load: float, point: Experiment) -> dict:
        if self.servers is not None and policy != self.policy and self.exp.server != "shared":
            self.servers.stop()  # the policy before's server: each policy starts on a fresh one
        self.policy = policy
        self.count += 1
        point.goodput = dict(self.slo)
        value = getattr(point.workload, self.knob.removeprefix("workload."))
        rid = run_id(policy, 1, self.knob, f"{value:.6g}")
        out = self.folder / rid
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        label = f"[{self.count}] {policy} at {load:.4g} {self.unit}"
        try:
            built = build_all(point.workload, vocab_of(point.model, point.workload), point.model)
            s = one_run(point, policy, self.url, self.servers, out, label, self.console, self.quiet, built)
        except MvllmError as e:  # one line: the message's first, and a server log's last after it
            lines = str(e).splitlines()
            last = f" {lines[-1].strip()}" if len(lines) > 1 else ""
            raise MvllmError(f"{policy} at {load:.4g} {self.unit}: {lines[0]}{last}") from None
        specs = parse_backends(backend_text(point), point.max_active) if self.url is None else None
        s.update({"run_id": rid, "run": 1, "knob": self.knob, "value": value, "load": load,
                  "environment": describe(specs)})
        write_json(out / "summary.json", s)
        write_aggregate(self.folder)
        if not self.quiet:
            self.console.print(run_line(label, s), highlight=False)
        sent = s["completed"] + s["failed"]
        return {"share": s["good_requests"] / max(sent, 1), "goodput": s["request_goodput"],
                "p99_ttft_ms": s["p99_ttft_ms"], "p99_tpot_ms": s["p99_tpot_ms"],
                "backend_requests": s["backend_requests"], "run": rid, "requests": sent, "failed": s["failed"],
                "max_send_delay_ms": s["max_send_delay_ms"], "client": s["client"]}

    def __enter__(self) -> Live:
        return self

    def __exit__(self, *exc) -> None:
        if self.servers is not None:
            self.servers.stop()
