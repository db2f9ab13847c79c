"""The router alone: the median time of one decision, per policy, with 4 backends of 32 running requests each.

    python experiments/router_speed.py [--profile results/real-traffic/profile.json] [--out FILE]

Each backend is the profile's gpu or cpu entry (gpu, cpu, cpu2, cpu3), served at max_active 32, each holding 32
running requests of 2,000-token prompts part-way through their cap of 2,048 and 4 queued ones. The length
estimate has learned from 2,048 lengths drawn from the conversation trace. A decision is `Router.route` (the
request is then taken off again, so every decision sees the same state); the time includes the block hashes'
look-ups of sglang-cache but not their hashing, which the server does (timed in /metrics with the rest).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mvllm.bench.traces import output_lengths  # noqa: E402
from mvllm.routing.cost import Booking  # noqa: E402
from mvllm.routing.rates import load_profile, rates_as_served  # noqa: E402
from mvllm.routing.router import Router  # noqa: E402

POLICIES = ("gpu-only", "round-robin", "mixed", "eta-caps", "eta", "new-token-ratio", "oracle", "makespan",
            "sglang-cache", "kv-cost")
RUNNING, QUEUED, DECISIONS = 32, 4, 2000


def trace_lengths() -> list[int]:
    return output_lengths(str(ROOT / "experiments" / "traces" / "conversation-10min.jsonl.gz"))


def state(router: Router, lengths: list[int], rng: random.Random) -> None:
    for b in router.backends:
        for i in range(RUNNING + QUEUED):
            length = rng.choice(lengths)
            made = rng.randrange(0, min(length, 2048)) if i < RUNNING else 0
            router.bookings[b][f"{b}-{i}"] = Booking(f"{b}-{i}", 2000, 1024, 2048, active=i < RUNNING,
                                                    actual_cached=1024, generated=made, length=length)
        router.sent[b].insert([hash((b, k)) for k in range(64)])
    for _ in range(2048):
        length = rng.choice(lengths)
        router.lengths.finished(min(length, 2048), length < 2048)


def time_policy(policy: str, rates: dict, lengths: list[int]) -> float:
    rng = random.Random(0)
    router = Router(list(rates), policy, rates)
    state(router, lengths, rng)
    cached = {b: 1024 for b in rates}
    blocks = [hash(("gpu", k)) for k in range(125)]
    times = []
    for i in range(DECISIONS):
        start = time.perf_counter()
        name = router.route(f"new-{i}", 2000, 2048, cached, blocks=blocks, length=300)
        times.append(time.perf_counter() - start)
        router.bookings[name].pop(f"new-{i}")
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(ROOT / "results" / "real-traffic" / "profile.json"))
    ap.add_argument("--out")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    entries = profile["backends"]
    profile = {"backends": {"gpu": entries["gpu"], "cpu": entries["cpu"], "cpu2": entries["cpu"],
                            "cpu3": entries["cpu"]}}
    rates = rates_as_served(profile, {b: RUNNING for b in profile["backends"]})
    lengths = trace_lengths()
    rows = {p: round(time_policy(p, rates, lengths), 1) for p in POLICIES}
    for p, us in rows.items():
        print(f"{p:16s} {us:8.1f} us median per decision")
    if args.out:
        Path(args.out).write_text(json.dumps({"backends": 4, "running": RUNNING, "queued": QUEUED,
                                              "median_us": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
