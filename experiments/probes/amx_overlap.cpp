// Does a thread's VNNI work overlap its AMX tile work? A warm prefill's 20 rows go 16 on AMX tiles and 4 on VNNI
// (int8_kernels.h, amx_rows mode 1), one after the other over each block of weights. This times, on each thread's
// own data in L2 (20 rows x 256 outputs x 896 inputs, groups of 32, the lanes8 layout), the parts of a block's work
// alone and interleaved a group at a time: T the 16 rows' tile products and their stores, F those rows' float steps,
// V the 4 rows' vpdpbusd and float steps. If TV takes about max(T, V) rather than T + V, the tile unit and the
// vector units work at once, and interleaving the VNNI rows into the AMX pass would pay. Build and run (AMX, Linux):
//   g++ -O3 -march=sapphirerapids -fopenmp -o /tmp/amx_overlap experiments/probes/amx_overlap.cpp && /tmp/amx_overlap 1 8 16
#include "../mvllm/kernels/csrc/amx_tiles.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {
constexpr int kG = 32, kLane = 16, kRows = 20, kOuts = 256, kIn = 896, kGroups = kIn / kG;


struct Work {
  std::vector<uint8_t> w = std::vector<uint8_t>(kOuts * kIn);
  std::vector<int8_t> x = std::vector<int8_t>(kRows * kIn);
  std::vector<uint16_t> sc = std::vector<uint16_t>(kOuts * kGroups);
  std::vector<float> xs = std::vector<float>(kRows * kGroups);
  std::vector<int32_t> xc = std::vector<int32_t>(kRows * kGroups);
  std::vector<float> y = std::vector<float>(kRows * kOuts);
  explicit Work(unsigned seed) {
    std::mt19937 rng(seed);
    for (auto& v : w) v = rng() & 255;
    for (auto& v : x) v = int8_t(int(rng() % 255) - 127);
    for (auto& v : sc) v = _cvtss_sh(0.001f + (rng() % 1000) * 1e-6f, 0);
    for (auto& v : xs) v = 0.01f + (rng() % 1000) * 1e-5f;
    for (auto& v : xc) v = int32_t(rng() % 1000);
  }
};

enum : int { kT = 1, kF = 2, kV = 4 };

// One block of 2 tiles (32 outputs) at tile t: the parts in P, a group at a time.
template <int P>
void block(Work& k, int t) {
  const uint8_t* w0 = k.w.data() + size_t(t) * kLane * kIn;
  const uint8_t* w1 = w0 + kLane * kIn;
  alignas(64) int32_t sums[2][2][256];
  alignas(64) float total[16][32] = {};
  __m512 vt[4][2];
  for (auto& r : vt) r[0] = r[1] = _mm512_setzero_ps();
  auto finish = [&](int g) {
    const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k.sc.data() + (size_t(t) * kGroups + g) * kLane)));
    const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k.sc.data() + (size_t(t + 1) * kGroups + g) * kLane)));
    for (int r = 0; r < 16; ++r) {
      const __m512i off = _mm512_set1_epi32(k.xc[r * kGroups + g]);
      const __m512 xsv = _mm512_set1_ps(k.xs[r * kGroups + g]);
      const __m512 s[2] = {s0, s1};
      for (int j = 0; j < 2; ++j) {
        const __m512i sum = _mm512_sub_epi32(_mm512_load_si512(sums[g & 1][j] + r * kLane), off);
        _mm512_store_ps(total[r] + j * kLane, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s[j], xsv),
                                                               _mm512_load_ps(total[r] + j * kLane)));
      }
    }
  };
  for (int g = 0; g < kGroups; ++g) {
    if constexpr ((P & kT) != 0) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(4, k.x.data() + g * kG, kIn);
      _tile_loadd(6, w0 + g * kLane * kG, 64);
      _tile_loadd(7, w1 + g * kLane * kG, 64);
      _tile_dpbsud(0, 4, 6);
      _tile_dpbsud(1, 4, 7);
      _tile_stored(0, sums[g & 1][0], 64);
      _tile_stored(1, sums[g & 1][1], 64);
    }
    if constexpr ((P & kV) != 0) {  // rows 16-19 on VNNI, both tiles
      __m512i acc[4][2] = {};
      for (int i = 0; i < kG; i += 4) {
        const __m512i a = _mm512_loadu_si512(w0 + (g * kG + i) * kLane), b = _mm512_loadu_si512(w1 + (g * kG + i) * kLane);
        for (int r = 0; r < 4; ++r) {
          int32_t q;
          std::memcpy(&q, k.x.data() + (16 + r) * kIn + g * kG + i, 4);
          const __m512i xv = _mm512_set1_epi32(q);
          acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], a, xv);
          acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], b, xv);
        }
      }
      const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k.sc.data() + (size_t(t) * kGroups + g) * kLane)));
      const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k.sc.data() + (size_t(t + 1) * kGroups + g) * kLane)));
      for (int r = 0; r < 4; ++r) {
        const __m512i off = _mm512_set1_epi32(k.xc[(16 + r) * kGroups + g]);
        const __m512 xsv = _mm512_set1_ps(k.xs[(16 + r) * kGroups + g]);
        vt[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], off)), _mm512_mul_ps(s0, xsv), vt[r][0]);
        vt[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], off)), _mm512_mul_ps(s1, xsv), vt[r][1]);
      }
    }
    if constexpr ((P & kF) != 0)
      if (g) finish(g - 1);
  }
  if constexpr ((P & kF) != 0) finish(kGroups - 1);
  for (int r = 0; r < 16; ++r)
    for (int j = 0; j < 2; ++j) _mm512_storeu_ps(k.y.data() + r * kOuts + (t + j) * kLane, _mm512_load_ps(total[r] + j * kLane));
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 2; ++j) _mm512_storeu_ps(k.y.data() + (16 + r) * kOuts + (t + j) * kLane, vt[r][j]);
}

template <int P>
void run(Work& k) {
  for (int t = 0; t < kOuts / kLane; t += 2) block<P>(k, t);
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <int P>
double timed(std::vector<Work>& works, int threads) {  // us a call, the median of 15 timed rounds of 20 calls
  std::vector<double> us;
  for (int rep = 0; rep < 16; ++rep) {
    double t0 = 0, t1 = 0;
#pragma omp parallel num_threads(threads)
    {
      mvllm::TileConfig c;
      for (int i : {0, 1}) c.rows[i] = 16, c.colsb[i] = 64;
      c.rows[4] = 16, c.colsb[4] = kG;
      for (int i : {6, 7}) c.rows[i] = kG / 4, c.colsb[i] = 64;
      mvllm::load_tile_config(c);
      Work& k = works[omp_get_thread_num()];
#pragma omp barrier
#pragma omp master
      t0 = now();
      for (int i = 0; i < 20; ++i) run<P>(k);
#pragma omp barrier
#pragma omp master
      t1 = now();
      _tile_release();
    }
    if (rep) us.push_back((t1 - t0) / 20 * 1e6);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (!mvllm::request_tile_data()) {
    std::puts("no AMX permission");
    return 1;
  }
  for (int a = 1; a < argc; ++a) {
    const int threads = std::atoi(argv[a]);
    std::vector<Work> works;
    for (int i = 0; i < threads; ++i) works.emplace_back(1234 + i);
    const double t = timed<kT>(works, threads), f = timed<kF>(works, threads), v = timed<kV>(works, threads);
    const double tf = timed<kT | kF>(works, threads), tv = timed<kT | kV>(works, threads);
    const double fv = timed<kF | kV>(works, threads), tfv = timed<kT | kF | kV>(works, threads);
    std::printf("threads %2d, us a call (20 x %d x %d): T %.2f  F %.2f  V %.2f | TF %.2f (T+F %.2f)  TV %.2f (T+V %.2f)"
                "  FV %.2f (F+V %.2f)  TFV %.2f (TF+V %.2f, T+F+V %.2f)\n",
                threads, kOuts, kIn, t, f, v, tf, t + f, tv, t + v, fv, f + v, tfv, tf + v, t + f + v);
  }
  return 0;
}
