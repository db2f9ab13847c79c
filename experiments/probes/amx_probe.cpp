// Where the AMX int8 kernel's time goes, outside torch: the lanes8 AMX pass of csrc/int8_linear.cpp (rows x 32
// outputs over K inputs in groups of 32, per-group int32 sums finished in float), and variants of it, timed on
// each thread's own data at 1..T threads. Each variant's y is checked against the current kernel's, bit for bit,
// where it computes the same thing. Build and run (a CPU with AMX, Linux):
//   g++ -O3 -march=sapphirerapids -fopenmp -o /tmp/amx_probe experiments/probes/amx_probe.cpp && /tmp/amx_probe 1 8 16
#include "../mvllm/kernels/csrc/amx_tiles.h"

#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#pragma GCC optimize("fp-contract=off")

namespace {
constexpr int kG = 32;    // inputs a group
constexpr int kLane = 16;  // outputs a tile


void configure(int m1, int m2) {
  mvllm::TileConfig c;
  const int m[2] = {m1, m2};
  for (int t = 0; t < 4; ++t) c.rows[t] = m[t / 2], c.colsb[t] = 64;
  for (int t : {4, 5}) c.rows[t] = m[t - 4], c.colsb[t] = kG;
  for (int t : {6, 7}) c.rows[t] = kG / 4, c.colsb[t] = 64;
  mvllm::load_tile_config(c);
}

// One thread's problem: rows x outs over K, weights in lanes8 (per tile of 16 outputs: per group, K/4 rows of 64
// bytes), activations int8 row-major (and group-major for the "amajor" variants), scales fp16 per tile and group.
struct Work {
  int rows, outs, in;
  std::vector<uint8_t> w;      // outs * in
  std::vector<int8_t> ws;      // w - 128 (signed weights: tdpbssd, no offset term)
  std::vector<int8_t> x;       // rows * in
  std::vector<int8_t> xg;      // group-major: [groups][rows][32]
  std::vector<uint16_t> sc;    // outs/16 * groups * 16
  std::vector<float> xs;       // rows * groups
  std::vector<int32_t> xc;     // rows * groups
  std::vector<float> y;        // rows * outs
  int groups() const { return in / kG; }
};

Work make(int rows, int outs, int in, unsigned seed) {
  Work k{rows, outs, in};
  std::mt19937 rng(seed);
  k.w.resize(size_t(outs) * in), k.x.resize(size_t(rows) * in), k.xg.resize(size_t(rows) * in);
  k.sc.resize(size_t(outs) * k.groups()), k.xs.resize(size_t(rows) * k.groups()), k.xc.resize(k.xs.size());
  k.y.assign(size_t(rows) * outs, 0.f);
  for (auto& v : k.w) v = rng() & 255;
  for (uint8_t v : k.w) k.ws.push_back(int8_t(int(v) - 128));
  for (auto& v : k.x) v = int8_t(int(rng() % 255) - 127);
  for (int g = 0; g < k.groups(); ++g)
    for (int r = 0; r < rows; ++r) std::memcpy(&k.xg[(size_t(g) * rows + r) * kG], &k.x[size_t(r) * in + g * kG], kG);
  for (auto& v : k.sc) v = _cvtss_sh(0.001f + (rng() % 1000) * 1e-6f, 0);
  for (size_t i = 0; i < k.xs.size(); ++i) {
    k.xs[i] = 0.01f + (rng() % 1000) * 1e-5f;
    int s = 0;
    const int r = i / k.groups(), g = i % k.groups();
    for (int j = 0; j < kG; ++j) s += k.x[size_t(r) * in + g * kG + j];
    k.xc[i] = 128 * s;
  }
  return k;
}

enum Mode { kCurrent, kTilesOnly, kFinishOnly, kAMajor, kChunked, kChunkedAMajor, kNoStore, kSigned, kSignedChunked, kReorder, kReorderSigned };

// Rows [r0, r0 + 32) x tiles [t, t + 2): the shape of lanes8_amx<2, 2>, with the variant's changes.
template <Mode M>
void pass(Work& k, int r0, int t) {
  const int ng = k.groups(), in = k.in;
  const uint8_t* w0 = k.w.data() + size_t(t) * kLane * in;
  const uint8_t* w1 = w0 + kLane * in;
  constexpr bool amajor = M == kAMajor || M == kChunkedAMajor;
  const int8_t* x0 = amajor ? k.xg.data() + size_t(r0) * kG : k.x.data() + size_t(r0) * in;
  const int8_t* x1 = amajor ? x0 + 16 * kG : x0 + 16 * in;
  const int64_t xstride = amajor ? kG : in, xstep = amajor ? int64_t(k.rows) * kG : kG;
  constexpr bool sign = M == kSigned || M == kSignedChunked || M == kReorderSigned;
  if constexpr (sign) w0 = reinterpret_cast<const uint8_t*>(k.ws.data()) + size_t(t) * kLane * in, w1 = w0 + kLane * in;
  constexpr int C = (M == kChunked || M == kChunkedAMajor || M == kSignedChunked) ? 4 : 1;  // groups a chunk
  alignas(64) static thread_local int32_t sums[2][C][4][256];
  alignas(64) float total[32][32] = {};
  auto products = [&](int g, int32_t (*c)[256]) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, x0 + g * xstep, xstride);
    _tile_loadd(5, x1 + g * xstep, xstride);
    _tile_loadd(6, w0 + g * kLane * kG, 64);
    _tile_loadd(7, w1 + g * kLane * kG, 64);
    if constexpr (sign) {
      _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbsud(0, 4, 6); _tile_dpbsud(1, 4, 7); _tile_dpbsud(2, 5, 6); _tile_dpbsud(3, 5, 7);
    }
    if constexpr (M != kNoStore && M != kReorder && M != kReorderSigned) {
      _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64); _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
    }
  };
  auto finish = [&](int g0, int32_t (*c)[4][256]) {
    __m512 s[C][2];
    for (int q = 0; q < C; ++q)
      for (int j = 0; j < 2; ++j)
        s[q][j] = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(k.sc.data() + (size_t(t + j) * ng + g0 + q) * kLane)));
    for (int i = 0; i < 2; ++i)
      for (int r = 0; r < 16; ++r) {
        const int row = r0 + i * 16 + r;
        for (int j = 0; j < 2; ++j) {
          float* tot = total[i * 16 + r] + j * kLane;
          __m512 acc = _mm512_load_ps(tot);
          for (int q = 0; q < C; ++q) {
            const int g = g0 + q;
            __m512i sum = _mm512_load_si512(c[q][i * 2 + j] + r * kLane);
            if constexpr (!sign) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(k.xc[size_t(row) * ng + g]));
            const __m512 scale = _mm512_mul_ps(s[q][j], _mm512_set1_ps(k.xs[size_t(row) * ng + g]));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc);
          }
          _mm512_store_ps(tot, acc);
        }
      }
  };
  auto stores = [&](int32_t (*c)[256]) {
    _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64); _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
  };
  if constexpr (M == kReorder || M == kReorderSigned) {  // products(g) issued, then finish(g - 1), then g's stores
    for (int g = 0; g < ng; ++g) {
      products(g, nullptr);
      if (g) finish(g - 1, sums[(g - 1) & 1]);
      stores(sums[g & 1][0]);
    }
    finish(ng - 1, sums[(ng - 1) & 1]);
  } else if constexpr (M == kTilesOnly || M == kNoStore) {
    for (int g = 0; g < ng; ++g) products(g, sums[g & 1][0]);
  } else if constexpr (M == kFinishOnly) {
    for (int g = 0; g < ng; g += C) finish(g, sums[(g / C) & 1]);
  } else {
    const int nc = ng / C;  // ng is a multiple of 4 in these shapes
    for (int q = 0; q < C; ++q) products(q, sums[0][q]);
    for (int ch = 1; ch < nc; ++ch) {
      for (int q = 0; q < C; ++q) products(ch * C + q, sums[ch & 1][q]);
      finish((ch - 1) * C, sums[(ch - 1) & 1]);
    }
    finish((nc - 1) * C, sums[(nc - 1) & 1]);
  }
  for (int r = 0; r < 32; ++r)
    for (int j = 0; j < 2; ++j)
      _mm512_storeu_ps(k.y.data() + size_t(r0 + r) * k.outs + (t + j) * kLane, _mm512_load_ps(total[r] + j * kLane));
}

template <Mode M>
void run(Work& k) {  // row tiles of 192 (as int8_linear's run), each over the thread's outputs, passes of 32
  for (int rt = 0; rt < k.rows; rt += 192)
    for (int t = 0; t < k.outs / kLane; t += 2)
      for (int r = rt; r < std::min(k.rows, rt + 192); r += 32) pass<M>(k, r, t);
}

// Rows [r0, r0 + 16) x tile t: one A and one B tile a group, the 16 totals in registers across the groups.
void pass_regs(Work& k, int r0, int t) {
  const int ng = k.groups(), in = k.in;
  const uint8_t* w0 = k.w.data() + size_t(t) * kLane * in;
  const int8_t* x0 = k.x.data() + size_t(r0) * in;
  alignas(64) int32_t sums[2][256];
  __m512 total[16];
  for (auto& v : total) v = _mm512_setzero_ps();
  auto products = [&](int g, int32_t* c) {
    _tile_zero(0);
    _tile_loadd(4, x0 + g * kG, in);
    _tile_loadd(6, w0 + g * kLane * kG, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_stored(0, c, 64);
  };
  auto finish = [&](int g, const int32_t* c) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k.sc.data() + (size_t(t) * ng + g) * kLane)));
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const int row = r0 + r;
      const __m512i sum = _mm512_sub_epi32(_mm512_load_si512(c + r * kLane), _mm512_set1_epi32(k.xc[size_t(row) * ng + g]));
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, _mm512_set1_ps(k.xs[size_t(row) * ng + g])), total[r]);
    }
  };
  products(0, sums[0]);
  for (int g = 1; g < ng; ++g) {
    products(g, sums[g & 1]);
    finish(g - 1, sums[(g - 1) & 1]);
  }
  finish(ng - 1, sums[(ng - 1) & 1]);
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(k.y.data() + size_t(r0 + r) * k.outs + t * kLane, total[r]);
}

// Rows [r0, r0 + 32) x tile t, the sum tiles double-buffered (0, 1 and 2, 3 in turn): group g's products are
// issued, then group g - 1's sums stored and finished, so the tiles of g work while the vector units finish g - 1.
template <bool Sign, bool Finish>
void pass_dbl(Work& k, int r0, int t) {
  const int ng = k.groups(), in = k.in;
  const uint8_t* w0 = Sign ? reinterpret_cast<const uint8_t*>(k.ws.data()) + size_t(t) * kLane * in
                           : k.w.data() + size_t(t) * kLane * in;
  const int8_t* x0 = k.x.data() + size_t(r0) * in;
  const int8_t* x1 = x0 + 16 * in;
  alignas(64) int32_t sums[2][256];
  alignas(64) float total[32][16] = {};
  auto products = [&](int g) {
    if (g & 1) {
      _tile_zero(2); _tile_zero(3);
    } else {
      _tile_zero(0); _tile_zero(1);
    }
    _tile_loadd(4, x0 + g * kG, in);
    _tile_loadd(5, x1 + g * kG, in);
    _tile_loadd(6, w0 + g * kLane * kG, 64);
    if (g & 1) {
      if constexpr (Sign) { _tile_dpbssd(2, 4, 6); _tile_dpbssd(3, 5, 6); }
      else { _tile_dpbsud(2, 4, 6); _tile_dpbsud(3, 5, 6); }
    } else {
      if constexpr (Sign) { _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 5, 6); }
      else { _tile_dpbsud(0, 4, 6); _tile_dpbsud(1, 5, 6); }
    }
  };
  auto stores = [&](int g) {
    if (g & 1) {
      _tile_stored(2, sums[0], 64); _tile_stored(3, sums[1], 64);
    } else {
      _tile_stored(0, sums[0], 64); _tile_stored(1, sums[1], 64);
    }
  };
  auto finish = [&](int g) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k.sc.data() + (size_t(t) * ng + g) * kLane)));
    for (int r = 0; r < 32; ++r) {
      const int row = r0 + r;
      __m512i sum = _mm512_load_si512(sums[r / 16] + (r % 16) * kLane);
      if constexpr (!Sign) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(k.xc[size_t(row) * ng + g]));
      const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(k.xs[size_t(row) * ng + g]));
      _mm512_store_ps(total[r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, _mm512_load_ps(total[r])));
    }
  };
  products(0);
  for (int g = 1; g < ng; ++g) {
    products(g);
    stores(g - 1);
    if constexpr (Finish) finish(g - 1);
  }
  stores(ng - 1);
  if constexpr (Finish) finish(ng - 1);
  for (int r = 0; r < 32; ++r) _mm512_storeu_ps(k.y.data() + size_t(r0 + r) * k.outs + t * kLane, _mm512_load_ps(total[r]));
}

template <bool Sign, bool Finish>
void run_dbl(Work& k) {
  for (int rt = 0; rt < k.rows; rt += 192)
    for (int t = 0; t < k.outs / kLane; ++t)
      for (int r = rt; r < std::min(k.rows, rt + 192); r += 32) pass_dbl<Sign, Finish>(k, r, t);
}

void run_regs(Work& k) {
  for (int rt = 0; rt < k.rows; rt += 192)
    for (int t = 0; t < k.outs / kLane; ++t)
      for (int r = rt; r < std::min(k.rows, rt + 192); r += 16) pass_regs(k, r, t);
}

using Fn = void (*)(Work&);
struct Variant {
  const char* name;
  Fn fn;
  bool same;  // computes what kCurrent computes
};
const Variant kVariants[] = {
    {"current", run<kCurrent>, true},         {"tiles-only", run<kTilesOnly>, false},
    {"tiles-nostore", run<kNoStore>, false},  {"finish-only", run<kFinishOnly>, false},
    {"a-group-major", run<kAMajor>, true},    {"chunk4", run<kChunked>, true},
    {"chunk4+a-major", run<kChunkedAMajor>, true}, {"signed", run<kSigned>, true},
    {"signed+chunk4", run<kSignedChunked>, true},   {"16x1-regs", run_regs, true},
    {"reorder", run<kReorder>, true},                {"reorder+signed", run<kReorderSigned>, true},
    {"32x1-dbl", run_dbl<false, true>, true},        {"32x1-dbl+signed", run_dbl<true, true>, true},
    {"32x1-dbl-tiles", run_dbl<false, false>, false},
};
}  // namespace

int main(int argc, char** argv) {
  if (!mvllm::request_tile_data()) return std::puts("no AMX permission"), 1;
  std::vector<int> threads;
  for (int i = 1; i < argc; ++i) threads.push_back(std::atoi(argv[i]));
  if (threads.empty()) threads = {1};
  const int shapes[][3] = {{192, 256, 896}, {192, 64, 4864}};  // rows, a thread's outputs, in (~0.2 / 0.3 MB of weights)
  for (auto& sh : shapes) {
    for (int T : threads) {
      std::vector<Work> work;
      for (int i = 0; i < T; ++i) work.push_back(make(sh[0], sh[1], sh[2], 1234 + i));
      std::vector<float> ref;
      for (const Variant& v : kVariants) {
        double best = 1e30;
        for (int rep = 0; rep < 7; ++rep) {
          double secs = 0;
#pragma omp parallel num_threads(T) reduction(max : secs)
          {
            Work& k = work[omp_get_thread_num()];
            configure(16, 16);
            v.fn(k);  // warm
            const auto a = std::chrono::steady_clock::now();
            for (int it = 0; it < 5; ++it) v.fn(k);
            secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count() / 5;
            _tile_release();
          }
          best = std::min(best, secs);
        }
        const double macs = double(sh[0]) * sh[1] * sh[2];
        std::string check = "";
        if (v.fn == kVariants[0].fn) ref = work[0].y;
        else if (v.same) check = ref == work[0].y ? " (same bits)" : " (BITS DIFFER)";
        std::printf("rows %d outs %d in %4d threads %2d %-16s %8.1f us  %6.0f GMAC/s a thread  %5.0f MACs/ns%s\n", sh[0],
                    sh[1], sh[2], T, v.name, best * 1e6, macs / best * 1e-9, macs / best * 1e-9 * T, check.c_str());
      }
    }
  }
}
