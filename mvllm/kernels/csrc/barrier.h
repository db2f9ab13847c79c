#pragma once

// The spin barrier the C++ layer loop's team of threads meets at (layers.cpp); experiments/probes/team_probe.cpp times it
// outside torch, so it includes nothing of torch's.

#include <atomic>
#include <cstdint>
#include <thread>

namespace mvllm {

// Sense-reversing central barrier of n threads: the last to arrive resets the count and flips the generation. A
// thread that waits runs idle() between polls (idle returns false when it has nothing to do: the thread pauses).
// After SPINS idle polls it yields its core at each poll: where the team has more threads than free cores (an
// emulated or busy machine), the thread everyone waits for is not running, and spinning only keeps it off the
// core (4 threads on 2 busy cores decoded SmolLM2 at 0.8 tok/s). A wait on a machine of free cores ends first.
struct Barrier {
  static constexpr int64_t SPINS = 1 << 12;
  alignas(64) std::atomic<int64_t> count{0};
  alignas(64) std::atomic<int64_t> gen{0};
  int64_t n = 1;

  template <class Idle>
  void wait(Idle&& idle) {
    const int64_t g = gen.load(std::memory_order_acquire);
    if (count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count.store(0, std::memory_order_relaxed);
      gen.store(g + 1, std::memory_order_release);
      return;
    }
    for (int64_t polls = 0; gen.load(std::memory_order_acquire) == g;)
      if (!idle()) {
        if (++polls > SPINS) {
          std::this_thread::yield();
          continue;
        }
#if defined(__x86_64__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("isb" ::: "memory");  // ARM's spin-wait hint (as Rust's spin_loop): polls pace as on x86
#endif
      }
  }
  void wait() {
    wait([] { return false; });
  }
};

}  // namespace mvllm
