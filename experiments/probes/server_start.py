"""How long `mvllm serve` takes to be ready, its workers started each way (MVLLM_START: spawn, forkserver), in one
run, alternating: a tiny model on two one-thread CPU backends, as the tests start it. Also the CPU time a worker
spends building that model's engine, after its imports (a fresh process each, the mvllm it finds first).

    .venv/bin/python experiments/probes/server_start.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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


BUILD = """import time
import torch
from mvllm.engine.engine import Engine, EngineConfig
t = time.process_time()
Engine(EngineConfig("synthetic:tiny-qwen2", dtype="float32"))
print(time.process_time() - t)"""


def build_cpu_s() -> float:
    out = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


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
    builds = [build_cpu_s() for _ in range(args.repeats)]
    print(json.dumps({"ready_s": times, "median_s": med, "forkserver_over_spawn": med["forkserver"] / med["spawn"],
                      "engine_build_cpu_s": builds, "engine_build_cpu_median_s": statistics.median(builds),
                      "cpus": os.cpu_count(), "load_before": os.getloadavg()[0]}, indent=2))


if __name__ == "__main__":
    main()
