"""Cold prefills of 516 tokens on a fresh CPU engine, each step's wall time and the process's minor page faults
during it (getrusage), so that MVLLM_KEEP_FREED=0 and 1 (machine.keep_freed_memory) compare in separate
processes of one call. The first two steps are warm-up; the median and the fault counts of the other five print.

    MVLLM_KEEP_FREED=0 python experiments/probes/cpu_prefill_faults.py 8; MVLLM_KEEP_FREED=1 python experiments/probes/cpu_prefill_faults.py 8
"""

from __future__ import annotations

import os
import resource
import sys
import time

from mvllm.engine.engine import Engine, EngineConfig
from mvllm.engine.params import SamplingParams


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    engine = Engine(EngineConfig(model="synthetic:qwen2.5-0.5b", device="cpu", threads=threads, quant="int8w"))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ms, fl = [], []
    for n in range(7):  # a fresh prompt each time: no prefix-cache hits
        engine.add_request([(n * 131 + 17 * k) % 5000 + 1 for k in range(516)], one)
        f0, a = faults(), time.perf_counter()
        engine.step()
        ms.append((time.perf_counter() - a) * 1e3)
        fl.append(faults() - f0)
    ms, fl = ms[2:], fl[2:]
    print(f"threads {threads} keep_freed {os.environ.get('MVLLM_KEEP_FREED', '1')}: cold prefill 516 median "
          f"{sorted(ms)[len(ms) // 2]:.1f} ms (min {min(ms):.1f}), faults a step {fl}", flush=True)


if __name__ == "__main__":
    main()
