// Which of a VM's vCPUs share a physical core: two threads, each pinned to one vCPU of a pair, run the same
// FMA-bound loop at once; a pair whose threads each get well under one thread's rate alone shares the core's FMA
// units (hyperthread siblings the guest is not told about: lscpu may say one thread a core). Then N threads (8 by
// default) on a few CPU sets, and unpinned, for the rate a compute-bound team gets. Build and run (Linux, AVX-512):
//   g++ -O2 -march=native -pthread -o /tmp/sibling_probe experiments/probes/sibling_probe.cpp && /tmp/sibling_probe 8
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// FMAs a second of one thread: 12 independent chains of 16-lane FMAs for `seconds`.
double fma_rate(double seconds) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(1.0f + i * 1e-3f);
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  int64_t n = 0;
  const double t0 = now();
  double t = t0;
  while (t - t0 < seconds) {
    for (int k = 0; k < 1000; ++k) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
    }
    n += 1000 * 12;
    t = now();
  }
  float sink = 0;
  for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(a[i]);
  if (sink == 12345.f) std::puts("");
  return n / (t - t0);
}

void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

// Each thread's rate with threads on `cpus` (-1: unpinned) at once.
std::vector<double> together(const std::vector<int>& cpus, double seconds) {
  std::vector<double> rate(cpus.size());
  std::atomic<int> ready{0};
  std::vector<std::thread> ts;
  for (size_t i = 0; i < cpus.size(); ++i)
    ts.emplace_back([&, i] {
      if (cpus[i] >= 0) pin(cpus[i]);
      ready.fetch_add(1);
      while (ready.load() < static_cast<int>(cpus.size())) {
      }
      rate[i] = fma_rate(seconds);
    });
  for (auto& t : ts) t.join();
  return rate;
}

}  // namespace

int main(int argc, char** argv) {
  const int team = argc > 1 ? std::atoi(argv[1]) : 8;
  const int n = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  const double alone = together({0}, 0.2)[0];
  std::printf("cpus %d; one thread alone on cpu 0: %.2f G FMA/s\n", n, alone / 1e9);
  std::vector<std::vector<double>> pair(n, std::vector<double>(n, 1.0));
  for (int round = 0; round < 2; ++round) {
    std::printf("round %d: pairs whose threads each ran under 0.75x alone:", round);
    for (int a = 0; a < n; ++a)
      for (int b = a + 1; b < n; ++b) {
        const auto r = together({a, b}, 0.03);
        pair[a][b] = std::min(r[0], r[1]) / alone;
        if (pair[a][b] < 0.75) std::printf(" (%d,%d) %.2f", a, b, pair[a][b]);
      }
    std::printf("\n");
  }
  auto report = [&](const char* name, const std::vector<int>& cpus) {
    for (int round = 0; round < 3; ++round) {
      const auto r = together(cpus, 0.1);
      double sum = 0, lo = r[0];
      for (double x : r) sum += x, lo = std::min(lo, x);
      std::printf("%-28s round %d: total %.2fx one thread, slowest thread %.2fx\n", name, round, sum / alone,
                  lo / alone);
    }
  };
  std::vector<int> first, even, unpinned(team, -1);
  for (int i = 0; i < team && i < n; ++i) first.push_back(i);
  for (int i = 0; i < team; ++i) even.push_back((2 * i) % n + (2 * i) / n);
  report("unpinned", unpinned);
  report("cpus 0..team-1", first);
  report("cpus 0,2,4..", even);
  std::vector<int> all(n, -1);
  report("all cpus unpinned", all);
  return 0;
}
