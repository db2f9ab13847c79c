"""Where a measured run's time went, from its own files: the stretches in which no request got a token, the
prefill its profile prices for the run's prompts, and how long after the client's send the server routed each
request.

    python experiments/probes/token_gaps.py RUN_FOLDER PROFILE [--backend gpu] [--gap-ms 30]

RUN_FOLDER holds requests.csv(.gz) and routing.jsonl(.gz) (a bench run); PROFILE is the profile the simulator
prices it from. Token stamps are every request's first token plus its inter-token gaps, merged; a gap is a
stretch longer than --gap-ms between two of them. The routing lag pairs each routing-log decision with the
client's send of a prompt of the same length, in order, with both clocks set to zero at the first request.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from mvllm.bench.results import find_file, open_text, request_rows
from mvllm.routing.eta import Timing


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("profile")
    ap.add_argument("--backend", default="gpu")
    ap.add_argument("--gap-ms", type=float, default=30.0)
    a = ap.parse_args()
    run = Path(a.run)
    rows = request_rows(run)
    stamps = set()
    for r in rows:
        if r["first_token"]:
            t = float(r["first_token"])
            stamps.add(round(t, 5))
            for gap in r["itl_ms"].split():
                t += float(gap) / 1000
                stamps.add(round(t, 5))
    times = sorted(stamps)
    gaps = [(b - a_, a_) for a_, b in zip(times, times[1:]) if b - a_ > a.gap_ms / 1000]
    longest = max(gaps, default=(0.0, 0.0))
    span = max(float(r["finish"]) for r in rows if r["finish"])
    print(f"{len(rows)} requests, {span:.2f} s: {len(gaps)} gaps over {a.gap_ms:g} ms without a token, "
          f"{sum(g for g, _ in gaps):.1f} s in all, the longest {longest[0]:.2f} s at {longest[1]:.1f} s")
    timing = Timing.from_profile(json.loads(Path(a.profile).read_text())["backends"][a.backend])
    uncached = [int(r["prompt_tokens"]) - int(r["cached_tokens"] or 0) for r in rows]
    print(f"priced prefill ({a.backend} of {a.profile}): {sum(map(timing.prefill_s, uncached)):.1f} s for "
          f"{sum(uncached):,} uncached prompt tokens (longest {max(uncached):,})")
    with open_text(find_file(run, "routing.jsonl")) as f:
        log = [d for d in map(json.loads, f) if "choice" in d]
    sent = defaultdict(list)
    for r in sorted(rows, key=lambda r: float(r["sent"])):
        sent[int(r["prompt_tokens"])].append(float(r["sent"]))
    t0, s0 = log[0]["time"], min(float(r["sent"]) for r in rows)
    lags = sorted(1000 * ((d["time"] - t0) - (sent[d["prompt_tokens"]].pop(0) - s0)) for d in log
                  if sent[d["prompt_tokens"]])
    q = statistics.quantiles(lags, n=100)
    print(f"routing lag over {len(lags)} requests: median {statistics.median(lags):.1f} ms, p90 {q[89]:.1f} ms, "
          f"p99 {q[98]:.1f} ms, max {lags[-1]:.1f} ms")


if __name__ == "__main__":
    main()
