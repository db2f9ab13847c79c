"""What one at::parallel_for costs on this machine, with no work in it: the fork and join a decode step pays once per
int8 linear and per attention call (about 5 x 24 + 1 regions a step). Each region is timed back to back, and after
a serial gap on the calling thread of G microseconds (a decode step's norm, RoPE or quantize between two regions;
the Python between two steps), at each thread count. Built inline with the flags the kernels use (-O3 -fopenmp).
Beside it, for the same threads and gaps: a bare `#pragma omp parallel` (the same OpenMP fork and join without
torch's wrapper), and the same empty region run by persistent spinning threads through two spin barriers (a fork
and a join; a layer run in one region, its threads meeting at barriers between ops as ggml's do, pays one barrier
a sync point).

    python experiments/probes/omp_overhead.py [--threads 8,16] [--gaps 0,5,20,100,1000] [--out FILE]

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
#include <omp.h>
#include <torch/extension.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
void spin(double us) {  // busy on the calling thread for `us` microseconds
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(us);
  while (std::chrono::steady_clock::now() < end) {}
}
}  // namespace

// Median microseconds of `reps` calls of `region`, each after `gap_us` of serial work (not counted).
template <class Region>
double median_us(double gap_us, int64_t reps, Region region) {
  std::vector<double> t(reps);
  for (int64_t i = 0; i < reps; ++i) {
    spin(gap_us);
    const auto a = std::chrono::steady_clock::now();
    region();
    t[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count();
  }
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[reps / 2];
}

// An empty at::parallel_for over `threads` threads.
double region_us(int64_t threads, double gap_us, int64_t reps) {
  std::atomic<int64_t> sink{0};
  return median_us(gap_us, reps, [&] {
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) { sink.fetch_add(e - b, std::memory_order_relaxed); });
  });
}

// The same with a bare OpenMP region (no ThreadLocalState, no exception capture).
double omp_us(int64_t threads, double gap_us, int64_t reps) {
  std::atomic<int64_t> sink{0};
  return median_us(gap_us, reps, [&] {
#pragma omp parallel num_threads(threads)
    sink.fetch_add(omp_get_thread_num(), std::memory_order_relaxed);
  });
}

namespace {
// Sense-reversing central barrier: the last to arrive resets the count and flips the generation.
struct Barrier {
  alignas(64) std::atomic<int64_t> count{0};
  alignas(64) std::atomic<int64_t> gen{0};
  int64_t n;
  explicit Barrier(int64_t n) : n(n) {}
  void wait() {
    const int64_t g = gen.load(std::memory_order_acquire);
    if (count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count.store(0, std::memory_order_relaxed);
      gen.store(g + 1, std::memory_order_release);
      return;
    }
    while (gen.load(std::memory_order_acquire) == g) {
#if defined(__x86_64__)
      _mm_pause();
#endif
    }
  }
};
}  // namespace

// Median microseconds of an empty region run by a team of `threads - 1` persistent spinning workers and the
// calling thread: after its gap the caller releases the workers through one barrier and waits for them at a second
// (a fork and a join, as an empty at::parallel_for). A layer run in one region pays one barrier a sync point.
double barrier_us(int64_t threads, double gap_us, int64_t reps) {
  Barrier b(threads);
  std::vector<std::thread> team;
  std::atomic<int64_t> sink{0};
  for (int64_t w = 1; w < threads; ++w)
    team.emplace_back([&, w] {
      for (int64_t i = 0; i < reps; ++i) {
        b.wait();
        sink.fetch_add(w, std::memory_order_relaxed);
        b.wait();
      }
    });
  const double us = median_us(gap_us, reps, [&] {
    b.wait();
    sink.fetch_add(0, std::memory_order_relaxed);
    b.wait();
  });
  for (auto& th : team) th.join();
  return us;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="8,16")
    ap.add_argument("--gaps", default="0,5,20,100,1000")
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--out")
    a = ap.parse_args()
    ext = load_inline("mvllm_omp_overhead", cpp_sources=SOURCE, functions=["region_us", "omp_us", "barrier_us"],
                      extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))}
    rows = []
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        for gap in (float(g) for g in a.gaps.split(",")):
            reps = max(50, a.reps // (1 + int(gap) // 100))
            us = {f: statistics.median(getattr(ext, f)(threads, gap, reps) for _ in range(3))
                  for f in ("region_us", "omp_us", "barrier_us")}
            rows.append({"threads": threads, "gap_us": gap, **us})
            print(f"threads {threads:3} gap {gap:7.0f} us: an empty region {us['region_us']:7.2f} us, bare omp "
                  f"{us['omp_us']:7.2f} us, spin team {us['barrier_us']:7.2f} us {env or ''}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
