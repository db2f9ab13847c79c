// How fast this host's cores read memory: the floor under a decode step, which reads every weight once.
// Each thread sums its own contiguous slice of one buffer (first touched by that thread, 2 MB pages advised as for
// mvllm's int8 weights) with 64-byte vector loads, and the whole buffer is read pass after pass, as steps read the
// weights. A buffer of the weights' size keeps whatever part of it the L3 holds between passes, as a step does; one
// much larger than the L3 gives DRAM alone. For each size and thread count, one JSON line: the median and best GB/s
// of the passes (the first pass, which faults the pages in, is not counted).
//   g++ -O3 -march=native -fopenmp -o /tmp/read_bw experiments/read_bandwidth.cpp
//   /tmp/read_bw SIZES_MB THREADS PASSES       e.g. /tmp/read_bw 525,4096 1,8,16 20
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace {
using u64x8 = uint64_t __attribute__((vector_size(64)));

std::vector<int64_t> list(const char* s) {
  std::vector<int64_t> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) v.push_back(std::atoll(item.c_str()));
  return v;
}

// Thread `tid` of `n`: its slice of `lines` 64-byte lines.
void slice(int64_t lines, int tid, int n, int64_t* begin, int64_t* end) {
  *begin = lines * tid / n;
  *end = lines * (tid + 1) / n;
}

uint64_t read_slice(const u64x8* p, int64_t begin, int64_t end) {
  u64x8 a = {}, b = {}, c = {}, d = {};  // four chains: the loads, not the adds, set the pace
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) a ^= p[i], b ^= p[i + 1], c ^= p[i + 2], d ^= p[i + 3];
  for (; i < end; ++i) a ^= p[i];
  const u64x8 s = a ^ b ^ c ^ d;
  uint64_t r = 0;
  for (int k = 0; k < 8; ++k) r ^= s[k];
  return r;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s SIZES_MB THREADS PASSES (e.g. 525,4096 1,8,16 20)\n", argv[0]);
    return 2;
  }
  const std::vector<int64_t> sizes = list(argv[1]), threads = list(argv[2]);
  const int passes = std::max(2, std::atoi(argv[3]));
  uint64_t sink = 0;
  for (const int64_t mb : sizes) {
    const int64_t bytes = mb * 1000 * 1000 / 64 * 64, lines = bytes / 64;
    constexpr size_t kHuge = size_t{2} << 20;
    void* mem = std::aligned_alloc(kHuge, (bytes + kHuge - 1) / kHuge * kHuge);
    if (!mem) {
      std::fprintf(stderr, "%lld MB: allocation failed\n", static_cast<long long>(mb));
      return 1;
    }
    madvise(mem, bytes, MADV_HUGEPAGE);
    auto* p = static_cast<u64x8*>(mem);
    for (const int64_t t : threads) {
      const int n = static_cast<int>(t);
#pragma omp parallel num_threads(n)  // first touch by the thread that reads the slice (harmless when repeated)
      {
        int64_t b, e;
        slice(lines, omp_get_thread_num(), omp_get_num_threads(), &b, &e);
        for (int64_t i = b; i < e; ++i) p[i] = u64x8{} + static_cast<uint64_t>(i);
      }
      std::vector<double> gbs;
      for (int k = 0; k <= passes; ++k) {
        const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(n) reduction(^ : sink)
        {
          int64_t b, e;
          slice(lines, omp_get_thread_num(), omp_get_num_threads(), &b, &e);
          sink ^= read_slice(p, b, e);
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (k > 0) gbs.push_back(bytes / s / 1e9);
      }
      std::sort(gbs.begin(), gbs.end());
      std::printf("{\"mb\": %lld, \"threads\": %d, \"passes\": %d, \"median_gb_s\": %.2f, \"best_gb_s\": %.2f}\n",
                  static_cast<long long>(mb), n, passes, gbs[gbs.size() / 2], gbs.back());
      std::fflush(stdout);
    }
    std::free(mem);
  }
  return sink == 42 ? 3 : 0;  // keeps the reads
}
