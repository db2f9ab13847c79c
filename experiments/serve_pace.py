"""Does the server keep pace with its engine? One call, one table: the client's ceiling, the engine offline,
and the same requests served over HTTP (a burst, all sent at once), with CPU by role.

    python experiments/serve_pace.py --out results/serve-pace/h100.json            # the GPU machine
    python experiments/serve_pace.py --model synthetic:tiny-llama --device cpu --requests 256 --active 32 \\
        --output 64 --out /tmp/pace.json                                            # anywhere, small

Stages (--stages, comma-separated): ceiling (bench --selftest's burst against the stub), offline
(the engine in this process on the same requests, max_active as served, twice with the prefix cache reset before
each: the second is the figure), served (`mvllm serve --backends gpu=DEVICE`,
gpu-only) and mixed (`gpu=DEVICE,cpu=cpu`, policy eta, with a profile measured first into --profile unless it
exists); served:N and mixed:N the same with `--api-servers N` (without :N, serve's default); a stage named again is run
again, its result under served:N#2 and so on. Requests: `--prompt` random tokens, `--output` tokens each, greedy, EOS ignored, lengths told.
served/offline output throughput and TPOT (offline: per request, from the engine's token times) are the
figures; CPU by role is the share of one core each process used over the replay (from /proc, Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mvllm.bench.health import summarize_client  # noqa: E402
from mvllm.bench.loadgen import generate  # noqa: E402
from mvllm.bench.metrics import percentile, summarize  # noqa: E402
from mvllm.bench.process import ServerProcess  # noqa: E402
from mvllm.bench.request import Request  # noqa: E402


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        out += [int(x) for x in task.read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    """Its children and theirs: the workers are the fork server's children."""
    out = children(pid)
    for child in list(out):
        out += descendants(child)
    return out


class CpuByRole:
    """The share of a core each of the server's processes used between start() and stop(): the API process, or
    the core and each API process (`apis`: their pids, from /health), and each backend worker."""

    def __init__(self, server_pid: int, apis: list[int] = ()):
        self.roles = ({"core": server_pid} | {f"api-{i}": pid for i, pid in enumerate(apis)} if apis else
                      {"api": server_pid}) | {f"worker-{pid}": pid for pid in descendants(server_pid) if pid not in apis}

    def start(self):
        self.t0, self.c0 = time.perf_counter(), {r: cpu_seconds(p) for r, p in self.roles.items()}
        return self

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t0
        return {r: round((cpu_seconds(p) - self.c0[r]) / wall, 3) for r, p in self.roles.items()}


class Occupancy:
    """The backends' running and waiting requests, from /metrics every `every` seconds while it runs: a served
    replay slower than offline with a batch below max_active is starved by the API process, not the engine."""

    def __init__(self, url: str, every: float = 0.2):
        import threading

        self.url, self.every, self.samples, self.done = url, every, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def run(self) -> None:
        import urllib.request

        while not self.done.wait(self.every):
            try:
                text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
            except OSError:
                continue
            row = {}
            for line in text.splitlines():
                for key in ("running", "waiting"):
                    if line.startswith(f"mvllm_num_requests_{key}{{"):
                        name = line.split('backend="')[1].split('"')[0]
                        row[f"{name}_{key}"] = float(line.rsplit(" ", 1)[1])
            self.samples.append(row)

    def stop(self) -> dict:
        self.done.set()
        self.thread.join()
        keys = sorted({k for row in self.samples for k in row})
        return {k: round(sum(r.get(k, 0) for r in self.samples) / max(len(self.samples), 1), 1) for k in keys} | {
            "samples": len(self.samples)}


def make_requests(n: int, prompt: int, output: int, vocab: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(10, vocab - 10) for _ in range(prompt)], output, 0.0) for i in range(n)]


def ceiling(args) -> dict:
    from mvllm.bench.selftest import ceiling as measure

    return measure(args.client_workers, None, 1024, 256)


def offline(args, reqs) -> dict:
    import torch

    from mvllm.engine.params import SamplingParams
    from mvllm.llm import LLM

    llm = LLM(args.model, device=args.device, max_active=args.active)
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    llm.generate([r.prompt for r in reqs[:args.active]], SamplingParams(max_tokens=8, temperature=0.0,
                                                                       ignore_eos=True))  # warm
    engine = llm.engine
    walls = []
    for _ in range(2):  # the second replay is the figure: the first may still compile a shape the warm-up missed
        engine.reset_prefix_cache()  # each replay's prompts cold, as the served runs' are
        for r in reqs:
            engine.add_request(r.prompt, params)
        steps, t0 = 0, time.perf_counter()
        seqs = list(engine.scheduler.waiting)
        while engine.has_unfinished():
            engine.step()
            steps += 1
        walls.append(time.perf_counter() - t0)
    wall = walls[-1]
    tpot = [(s.times.finished - s.times.first_token) / (s.num_output_tokens - 1) for s in seqs
            if s.times.finished and s.times.first_token and s.num_output_tokens > 1]
    out = sum(s.num_output_tokens for s in seqs)
    del llm, engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"duration": wall, "first_duration": walls[0], "output_throughput": out / wall, "steps": steps,
            "mean_step_ms": 1000 * wall / steps,
            "median_tpot_ms": 1000 * percentile(tpot, 50), "max_active": args.active}


def served(args, reqs, backends: str, policy: str, profile: str | None, log: Path, apis: str | None) -> dict:
    cmd = ["--model", args.model, "--backends", backends, "--policy", policy]
    if profile:
        cmd += ["--profile", profile]
    if apis:
        cmd += ["--api-servers", apis]
    with ServerProcess(cmd, log) as server:
        server.wait_ready(900)
        warm = make_requests(args.active, args.prompt, 8, args.vocab, seed=1)
        generate(server.url, args.model, warm, 600.0, 1)
        pids = [int(p) for p in server.http.get(f"{server.url}/health").json().get("api_servers", {}).values()]
        roles, occupancy = CpuByRole(server.proc.pid, pids).start(), Occupancy(server.url).start()
        records, duration, _, health = generate(server.url, args.model, reqs, 900.0, args.client_workers)
        cpu, mean_load = roles.stop(), occupancy.stop()
    s = summarize(records, duration)
    keys = ("completed", "failed", "duration", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "mean_tpot_ms", "median_itl_ms", "backend_requests")
    return {k: s[k] for k in keys} | {"client": summarize_client(records, health, s["median_ttft_ms"]),
                                      "server_cpu": cpu, "mean_load": mean_load, "backends": backends, "policy": policy,
                                      "api_servers": max(len(pids), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic:qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--active", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--client-workers", type=int, default=4)
    ap.add_argument("--stages", default="ceiling,offline,served")
    ap.add_argument("--profile", default=None, help="for mixed: a profile of gpu and cpu (made if missing)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from mvllm.bench.experiment import Workload
    from mvllm.bench.request import vocab_of

    args.vocab = min(vocab_of(args.model, Workload()), 32000)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(out.read_text()) if out.is_file() else {}
    result.update(command=" ".join([Path(sys.executable).name, *sys.argv]), model=args.model, device=args.device,
                  requests=args.requests, prompt=args.prompt, output=args.output, client_workers=args.client_workers,
                  git_commit=os.environ.get("MVLLM_GIT_COMMIT"), cores=os.cpu_count())
    reqs = make_requests(args.requests, args.prompt, args.output, args.vocab)
    gpu = f"gpu={args.device}/max_active={args.active}"
    stages = args.stages.split(",")
    for i, stage in enumerate(stages):
        t = time.perf_counter()
        key = stage if stage not in stages[:i] else f"{stage}#{stages[:i].count(stage) + 1}"  # a repeat: served:1#2
        print(f"== {key}", flush=True)
        kind, _, apis = stage.partition(":")
        log = out.with_suffix(f".{key.replace(':', '').replace('#', '-')}.log")
        if stage == "ceiling":
            result[key] = ceiling(args)
        elif stage == "offline":
            result[key] = offline(args, reqs)
        elif kind == "served":
            result[key] = served(args, reqs, gpu, "gpu-only", None, log, apis or None)
        elif kind == "mixed":
            profile = args.profile or str(out.with_suffix(".profile.json"))
            if not Path(profile).is_file():
                subprocess.run([sys.executable, "-m", "mvllm.cli", "profile", "--model", args.model, "--backends",
                                f"{gpu},cpu=cpu", "--out", profile], check=True)
            result[key] = served(args, reqs, f"{gpu},cpu=cpu", "eta", profile, log, apis or None)
        else:
            raise SystemExit(f"unknown stage {stage!r}")
        result[key]["stage_s"] = round(time.perf_counter() - t, 1)
        print(json.dumps(result[key], indent=1, default=str)[:1500], flush=True)
        out.write_text(json.dumps(result, indent=1, default=str))
    if "offline" in result:
        for key in [k for k in result if k.partition(":")[0] in ("served", "mixed") and isinstance(result[k], dict)]:
            result[f"{key}_over_offline"] = result[key]["output_throughput"] / result["offline"]["output_throughput"]
        print({k: v for k, v in result.items() if k.endswith("_over_offline")})
        out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
