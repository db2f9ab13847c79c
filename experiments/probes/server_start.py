"""How long `mvllm serve` takes to be ready, its workers started each way (MVLLM_START: spawn, forkserver), in one
run, alternating: a tiny model on two one-thread CPU backends, as the tests start it.

    .venv/bin/python experiments/probes/server_start.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from mvllm.bench.process import ServerProcess


def ready_s(how: str, folder: Path) -> float:
    env = {**os.environ, "MVLLM_START": how}
    start = time.perf_counter()
    server = ServerProcess(["--model", "synthetic:tiny-qwen2", "--backends", "gpu=cpu/threads=1,cpu=cpu/threads=1"],
                           folder / f"{how}.log", env=env).start()
    try:
        server.wait_ready(120)
        return time.perf_counter() - start
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for how in times:
                times[how].append(ready_s(how, Path(tmp)))
    med = {how: statistics.median(t) for how, t in times.items()}
    print(json.dumps({"ready_s": times, "median_s": med, "forkserver_over_spawn": med["forkserver"] / med["spawn"],
                      "cpus": os.cpu_count(), "load_before": os.getloadavg()[0]}, indent=2))


if __name__ == "__main__":
    main()
