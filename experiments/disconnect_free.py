"""How soon a backend frees a request's slot when the client stops reading at the request's true length (what
`mvllm bench --url` does with lengths hidden against any OpenAI server).

Starts `mvllm serve` on the given backends, replays requests with a large cap whose true lengths the client
reads up to before closing the connection, and reads the server's routing log, where every abort is noted with
the tokens the engine had made and the worker's wall time. Per request: the extra tokens made after the ones
the client read, and the delay from the client's close to the abort in decode steps of that request (its
median gap between tokens). Writes a JSON next to printing the medians and maxima.

    python experiments/disconnect_free.py --model synthetic:qwen2.5-0.5b --backends gpu=cuda \\
        --out results/real-traffic/disconnect.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from mvllm import env as envinfo
from mvllm.bench.client import replay, served_model
from mvllm.bench.process import ServerProcess
from mvllm.bench.workload import Request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:tiny-qwen2")
    ap.add_argument("--backends", default="gpu=cpu/threads=1")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--cap", type=int, default=1024)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    log = tmp / "routing.jsonl"
    server = ServerProcess(["--model", a.model, "--backends", a.backends, "--policy", "gpu-only",
                            "--routing-log", str(log), "--max-active", "4"], tmp / "server.log").start()
    try:
        server.wait_ready(600)
        reqs = [Request(i, [100 + i, 200, 300, 400] * 8, 16 + 4 * (i % 8), 0.25 * i, max_tokens=a.cap)
                for i in range(a.requests)]
        records, _, start = asyncio.run(replay(server.url, served_model(server.url), reqs, 300.0, stop="disconnect"))
        asyncio.run(asyncio.sleep(1.0))
    finally:
        server.stop()
    notes = {d["aborted"]: d for d in map(json.loads, log.read_text().splitlines()) if "aborted" in d}
    routed = [d for d in map(json.loads, log.read_text().splitlines()) if "candidates" in d or "choice" in d]
    rows = []
    # decisions are logged in arrival order; requests go 0.25 s apart, so that is the records' order too
    for rec, d in zip(records, routed, strict=False):
        note = notes.get(d["request_id"])
        if note is None or not rec.ok:
            continue
        step = statistics.median(rec.itl) if len(rec.itl) >= 2 else None
        delay = note["time"] - (start + rec.finish)
        rows.append({"id": rec.id, "read": rec.output_tokens, "generated": note["generated"],
                     "extra_tokens": note["generated"] - rec.output_tokens, "delay_ms": 1000 * delay,
                     "step_ms": 1000 * step if step else None, "delay_steps": delay / step if step else None})
    if not rows:
        sys.exit("no abort was noted: the routing log holds no request that the client closed")
    steps = [r["delay_steps"] for r in rows if r["delay_steps"] is not None]
    out = {"command": " ".join(sys.argv), "model": a.model, "backends": a.backends, "requests": len(records),
           "noted": len(rows), "median_extra_tokens": statistics.median(r["extra_tokens"] for r in rows),
           "max_extra_tokens": max(r["extra_tokens"] for r in rows),
           "median_delay_ms": statistics.median(r["delay_ms"] for r in rows),
           "max_delay_ms": max(r["delay_ms"] for r in rows),
           "median_delay_steps": statistics.median(steps) if steps else None,
           "max_delay_steps": max(steps) if steps else None, "rows": rows,
           "environment": envinfo.describe(None)}
    print(json.dumps({k: v for k, v in out.items() if k not in ("rows", "environment")}, indent=2))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
