"""The API process's CPU per streamed token: `mvllm serve` over null backends (tokens on a clock, no model),
driven by the bench client, the code before (a git commit, checked out into a temporary worktree) against the
code after (this working tree), in one run.

    python experiments/api_cost.py --out /tmp/api_cost.json                 # before: the merge-base with main
    python experiments/api_cost.py --before HEAD~3 --concurrency 256 --step-ms 20 --out /tmp/api_cost.json
    python experiments/api_cost.py --api-servers 1,2 --out /tmp/api_cost.json   # this tree, 1 against 2 API processes

Both servers start first and idle on their own ports; then the runs alternate, before and after, --repeats times
each: one run is --concurrency streaming requests sent at once (each --output tokens, greedy, lengths told) to
null backends that run them all at once (--backends, default one of max_active = concurrency). A run's API cost is
the server process's CPU time (user + system, from /proc; its backends' worker processes are apart) over the
tokens its streams carried (with --api-servers: the core's and its API processes' together, each apart, and the
busiest one's, which bounds the pace: one core's worth of it is 1e6 / busiest_us_per_token tokens a second); the
client's is this process's CPU over the same tokens. tokens_per_chunk shows
whether streams kept pace (1.0) or caught up in merged chunks. The figure is each side's median run; the ratio is
after over before. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mvllm.bench.health import summarize_client  # noqa: E402
from mvllm.bench.loadgen import generate  # noqa: E402
from mvllm.bench.metrics import summarize  # noqa: E402
from mvllm.bench.process import ServerProcess  # noqa: E402
from mvllm.bench.request import Request  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """A process's own CPU time, all its threads, user and system (not its children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    return [int(x) for task in Path(f"/proc/{pid}/task").glob("*/children") for x in task.read_text().split()]


def cpu_model() -> str | None:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


class Side:
    """One side's server, started from its own tree (the tree's mvllm is the one imported: the cwd comes first)."""

    def __init__(self, name: str, tree: Path, commit: str, args, log: Path, extra: tuple[str, ...] = ()):
        self.name, self.tree, self.commit, self.runs = name, tree, commit, []
        cmd = ["--model", args.model, "--backends", args.backends, *extra]
        self.server = ServerProcess(cmd, log, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree)

    def run(self, reqs: list[Request], model: str) -> dict:
        pid = self.server.proc.pid
        apis = [int(p) for p in self.server.http.get(f"{self.server.url}/health").json().get("api_servers",
                                                                                              {}).values()]
        serving = [pid, *apis]
        workers = [p for p in children(pid) if p not in apis]
        cpu0 = {p: cpu_seconds(p) for p in serving}
        work0, client0 = sum(map(cpu_seconds, workers)), time.process_time()
        records, duration, _, health = generate(self.server.url, model, reqs, 600.0, 1)
        by = {p: cpu_seconds(p) - cpu0[p] for p in serving}
        api, client = sum(by.values()), time.process_time() - client0
        work = sum(map(cpu_seconds, workers)) - work0
        done = [r for r in records if r.ok]
        tokens = sum(r.output_tokens for r in done)
        s = summarize(records, duration)
        lag = summarize_client(records, health, s["median_ttft_ms"])  # a burst's own send spread shows here too
        run = {"tokens": tokens, "failed": len(records) - len(done), "duration": round(duration, 3),
               "api_cpu_s": round(api, 3), "client_cpu_s": round(client, 3), "workers_cpu_s": round(work, 3),
               "core_cpu_s": round(by[pid], 3) if apis else None,
               "api_processes_cpu_s": [round(by[p], 3) for p in apis] or None,
               "api_us_per_token": round(1e6 * api / max(tokens, 1), 2),
               "busiest_us_per_token": round(1e6 * max(by.values()) / max(tokens, 1), 2),
               "client_us_per_token": round(1e6 * client / max(tokens, 1), 2),
               "tokens_per_chunk": round(s["mean_tokens_per_chunk"] or 0.0, 3),
               "client_loop_lag_p99_ms": lag["loop_lag_ms"]["p99"],
               "output_throughput": round(s["output_throughput"] or 0.0, 1),
               "median_itl_ms": s["median_itl_ms"], "median_tpot_ms": s["median_tpot_ms"]}
        self.runs.append(run)
        return run

    def result(self) -> dict:
        return {"commit": self.commit, "tree": "temporary worktree" if self.name == "before" else str(self.tree),
                **{f"median_{k}": statistics.median(r[k] for r in self.runs)
                   for k in ("api_us_per_token", "busiest_us_per_token", "client_us_per_token", "tokens_per_chunk",
                             "output_throughput")},
                "runs": self.runs}


def make_requests(n: int, prompt: int, output: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(100, 20000) for _ in range(prompt)], output, 0.0) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=None, help="the commit to measure as before (default: the merge-base of "
                    "HEAD with main)")
    ap.add_argument("--sides", default="before,after", help="before, after, or both")
    ap.add_argument("--api-servers", default=None, help="A,B: instead of before and after, this tree with "
                    "--api-servers A against --api-servers B")
    ap.add_argument("--model", default="synthetic:qwen2.5-0.5b", help="its tokenizer and context (a synthetic "
                    "one has no tokenizer: no detokenizing)")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--backends", default=None, help="default: gpu=null/step_ms=STEP/max_active=CONCURRENCY")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.backends = args.backends or f"gpu=null/step_ms={args.step_ms:g}/max_active={args.concurrency}"
    sides = args.sides.split(",")
    if not set(sides) <= {"before", "after"} or not sides:
        raise SystemExit(f"--sides: before, after or both, got {args.sides!r}")
    load0 = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="api-cost-"))
    head = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    made: list[Side] = []
    worktree = None
    try:
        if args.api_servers:
            head_commit = head + ("+changes" if dirty else "")
            for n in args.api_servers.split(","):
                made.append(Side(f"api-servers={n}", ROOT, head_commit, args, tmp / f"api{n}.log",
                                 ("--api-servers", n)))
            sides = []
        if "before" in sides:
            rev = args.before or git("merge-base", "HEAD", "main")
            commit = git("rev-parse", "--short", rev)
            worktree = tmp / "before"
            git("worktree", "add", "--detach", str(worktree), commit)
            if not (worktree / "mvllm" / "backends" / "null.py").is_file():
                raise SystemExit(f"commit {commit} has no null backend (mvllm/backends/null.py); pass --before a "
                                 "commit that has one")
            made.append(Side("before", worktree, commit, args, tmp / "before.log"))
        if "after" in sides:
            made.append(Side("after", ROOT, head + ("+changes" if dirty else ""), args, tmp / "after.log"))
        for side in made:
            side.server.start()
        for side in made:
            side.server.wait_ready(300)
            generate(side.server.url, args.model, make_requests(args.concurrency, args.prompt, 16, seed=1), 600.0, 1)
        reqs = make_requests(args.concurrency, args.prompt, args.output)
        for i in range(args.repeats):
            for side in made:
                run = side.run(reqs, args.model)
                print(f"{side.name} run {i + 1}: {run['api_us_per_token']:.2f} us API CPU a token, client "
                      f"{run['client_us_per_token']:.2f}; {run['tokens']} tokens, {run['tokens_per_chunk']:.2f} a "
                      f"chunk, {run['output_throughput']:.0f} tok/s", flush=True)
    finally:
        for side in made:
            side.server.stop()
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "host_cores": os.cpu_count(),
              "cpu": cpu_model(), "load_average": [load0, os.getloadavg()],
              "model": args.model, "backends": args.backends, "concurrency": args.concurrency, "output": args.output,
              "prompt": args.prompt, "repeats": args.repeats, **{s.name: s.result() for s in made}}
    line = "; ".join(f"{s.name} ({s.commit}) {result[s.name]['median_api_us_per_token']:.2f} us API CPU a token, "
                     f"client {result[s.name]['median_client_us_per_token']:.2f}" for s in made)
    if len(made) == 2:
        a, b = made
        result["ratio"] = round(result[b.name]["median_api_us_per_token"]
                                / result[a.name]["median_api_us_per_token"], 3)
        line += f"; {b.name}/{a.name} {result['ratio']:.3f}"
    out.write_text(json.dumps(result, indent=1))
    print(line)


if __name__ == "__main__":
    main()
