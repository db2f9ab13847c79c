"""What one at::parallel_for costs on this machine, with no work in it: the fork and join a decode step pays once per
int8 linear and per attention call (about 5 x 24 + 1 regions a step). Each region is timed back to back, and after
a serial gap on the calling thread of G microseconds (a decode step's norm, RoPE or quantize between two regions;
the Python between two steps), at each thread count. Built inline with the flags the kernels use (-O3 -fopenmp).

    python experiments/omp_overhead.py [--threads 8,16] [--gaps 0,5,20,100,1000] [--out FILE]

Run it under OMP_WAIT_POLICY=ACTIVE or GOMP_SPINCOUNT=... to see the OpenMP runtime's waiting policy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <atomic>
#include <chrono>

namespace {
void spin(double us) {  // busy on the calling thread for `us` microseconds
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(us);
  while (std::chrono::steady_clock::now() < end) {}
}
}  // namespace

// Median microseconds of `reps` empty regions over `threads` threads, each after `gap_us` of serial work (not counted).
double region_us(int64_t threads, double gap_us, int64_t reps) {
  std::vector<double> t(reps);
  std::atomic<int64_t> sink{0};
  for (int64_t i = 0; i < reps; ++i) {
    spin(gap_us);
    const auto a = std::chrono::steady_clock::now();
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) { sink.fetch_add(e - b, std::memory_order_relaxed); });
    t[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count();
  }
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[reps / 2];
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="8,16")
    ap.add_argument("--gaps", default="0,5,20,100,1000")
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--out")
    a = ap.parse_args()
    ext = load_inline("mvllm_omp_overhead", cpp_sources=SOURCE, functions=["region_us"],
                      extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))}
    rows = []
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        for gap in (float(g) for g in a.gaps.split(",")):
            us = statistics.median(ext.region_us(threads, gap, max(50, a.reps // (1 + int(gap) // 100)))
                                   for _ in range(3))
            rows.append({"threads": threads, "gap_us": gap, "region_us": us})
            print(f"threads {threads:3} gap {gap:7.0f} us: an empty region {us:7.2f} us {env or ''}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
