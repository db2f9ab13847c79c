// What a decode step's layout of threads costs on this host, outside torch: a step of qwen2.5-0.5b's
// int8 weights (24 layers of four linears, 1.18 / 0.92 / 9.30 / 4.65 MB, and the LM head, 145 MB) read by T threads
// as the int8 kernel's decode rows read them (each thread its slice of each linear, summed with 64-byte loads),
// with a serial gap of G us on thread 0 after each linear (the norms, RoPE, attention, allocations and dispatcher
// calls a real step runs between its linears: 75-120 us a layer at 16 threads on the H200 machine's Xeon).
//   fork   one OpenMP region a linear, the gap between regions (today's layout: at::parallel_for per op)
//   team   one region a step, the threads meeting at spin barriers (the layer loop's, csrc/barrier.h): after each
//          linear, and after the gap
//   team+prefetch   as team, but the threads waiting out the gap prefetch (into L2) the start of their slice of
//          the next linear, checking between cache lines whether the gap is over (the memory works through the gap)
// Prints each layout's median step in ms and the weights' rate, beside a plain read of the same bytes (no gaps).
//   g++ -O3 -march=native -fopenmp -o /tmp/team_probe experiments/probes/team_probe.cpp
//   /tmp/team_probe THREADS GAPS_US STEPS           e.g. /tmp/team_probe 8,16 0,20 30
#include "../mvllm/kernels/csrc/barrier.h"

#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
using u64x8 = uint64_t __attribute__((vector_size(64)));
using Clock = std::chrono::steady_clock;

std::vector<double> list(const char* s) {
  std::vector<double> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) v.push_back(std::atof(item.c_str()));
  return v;
}

struct Linear {
  const u64x8* p;
  int64_t lines;
};

uint64_t read_lines(const u64x8* p, int64_t begin, int64_t end) {
  u64x8 a = {}, b = {};
  int64_t i = begin;
  for (; i + 2 <= end; i += 2) a ^= p[i], b ^= p[i + 1];
  for (; i < end; ++i) a ^= p[i];
  const u64x8 s = a ^ b;
  uint64_t r = 0;
  for (int k = 0; k < 8; ++k) r ^= s[k];
  return r;
}

uint64_t read_share(const Linear& l, int tid, int n) {
  return read_lines(l.p, l.lines * tid / n, l.lines * (tid + 1) / n);
}

void spin_us(double us) {
  const auto end = Clock::now() + std::chrono::duration<double, std::micro>(us);
  while (Clock::now() < end) {}
}

constexpr int64_t kPrefetchLines = 4096;  // 256 KB of a thread's next slice at most

double step_ms(const std::vector<Linear>& ls, int n, double gap, int mode, uint64_t* sink) {
  const auto start = Clock::now();
  uint64_t s = 0;
  if (mode == 0) {  // fork: a region a linear
    for (const Linear& l : ls) {
#pragma omp parallel num_threads(n) reduction(^ : s)
      s ^= read_share(l, omp_get_thread_num(), omp_get_num_threads());
      spin_us(gap);
    }
  } else {
    mvllm::Barrier b;
    b.n = n;
#pragma omp parallel num_threads(n) reduction(^ : s)
    {
      const int tid = omp_get_thread_num(), team = omp_get_num_threads();
      if (team != n) std::abort();  // the barrier counts n
      for (size_t k = 0; k < ls.size(); ++k) {
        s ^= read_share(ls[k], tid, team);
        b.wait();  // the linear is done
        if (tid == 0) {
          spin_us(gap);
          b.wait();
        } else if (mode == 1 || k + 1 == ls.size()) {
          b.wait();
        } else {  // team+prefetch: the start of this thread's slice of the next linear, while thread 0 works
          const Linear& next = ls[k + 1];
          const int64_t from = next.lines * tid / team, to = std::min(next.lines * (tid + 1) / team, from + kPrefetchLines);
          int64_t at = from;
          b.wait([&] {
            if (at >= to) return false;
            _mm_prefetch(reinterpret_cast<const char*>(next.p + at), _MM_HINT_T1);
            ++at;
            return true;
          });
        }
      }
    }
  }
  *sink ^= s;
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s THREADS GAPS_US STEPS (e.g. 8,16 0,20 30)\n", argv[0]);
    return 2;
  }
  const std::vector<double> threads = list(argv[1]), gaps = list(argv[2]);
  const int steps = std::max(3, std::atoi(argv[3]));
  const double mb[4] = {1.1776, 0.9184, 9.2986, 4.6493}, head_mb = 145.0;  // int8 + a float16 scale a 32
  std::vector<double> sizes;
  for (int l = 0; l < 24; ++l) sizes.insert(sizes.end(), mb, mb + 4);
  sizes.push_back(head_mb);
  std::vector<Linear> ls;
  int64_t total = 0;
  for (double m : sizes) total += static_cast<int64_t>(m * 1e6) / 64;
  constexpr size_t kHuge = size_t{2} << 20;
  auto* base = static_cast<u64x8*>(std::aligned_alloc(kHuge, (total * 64 + kHuge - 1) / kHuge * kHuge));
  madvise(base, total * 64, MADV_HUGEPAGE);
  for (int64_t i = 0; i < total; ++i) base[i] = u64x8{} + static_cast<uint64_t>(i);
  int64_t off = 0;
  for (double m : sizes) {
    const int64_t lines = static_cast<int64_t>(m * 1e6) / 64;
    ls.push_back({base + off, lines});
    off += lines;
  }
  uint64_t sink = 0;
  const char* names[3] = {"fork", "team", "team+prefetch"};
  for (double t : threads) {
    const int n = static_cast<int>(t);
    for (double gap : gaps) {
      std::vector<double> ms[4];
      for (int k = 0; k <= steps; ++k)
        for (int mode = 0; mode < 4; ++mode) {  // in turn, so the host's drift falls on all of them
          const double v = mode == 3 ? step_ms({{base, total}}, n, 0, 0, &sink) : step_ms(ls, n, gap, mode, &sink);
          if (k > 0) ms[mode].push_back(v);
        }
      for (auto& v : ms) std::sort(v.begin(), v.end());
      const double read = ms[3][ms[3].size() / 2];
      std::printf("threads %2d gap %5.1f us: plain read %.2f ms (%.1f GB/s)", n, gap, read, total * 64 / read / 1e6);
      for (int mode = 0; mode < 3; ++mode) {
        const double m = ms[mode][ms[mode].size() / 2];
        std::printf(", %s %.2f ms (%.2fx the read)", names[mode], m, m / read);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  std::free(base);
  return sink == 42 ? 3 : 0;
}
