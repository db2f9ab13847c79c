// What AMX bf16 tiles could do for a warm prefill's attention, outside torch: the lanes rows of one kv head (19
// tokens x 7 query heads = 133 rows, causal key lengths 497-515, head dim 64) against their keys, every float split
// into two bf16 (hi = bf16(x), lo = bf16(x - hi)) and each product taken as hi*hi + hi*lo + lo*hi in float32 tiles,
// an error near 2^-16 of a product (bf16 alone: 2^-8). Two passes over the keys (the scores of every key, then one
// softmax a row, then P V accumulated in the tiles), so no running rescale. Prints the time per (layer, kv head) on
// 1 thread and on T threads each on its own copy, a phase split, and the largest error against a double-precision
// reference. The engine's float32 attention of the same cell: cpu_attention_speed.py --threads 1 --cells "warm 20"
// (24 layers x 2 kv heads a step). Build and run (AMX, Linux):
//   g++ -O3 -march=sapphirerapids -fopenmp -o /tmp/aap experiments/probes/amx_attention_probe.cpp && /tmp/aap 8
// (`/tmp/aap plain 8`: bf16 alone, one product, the lo halves zero and not loaded.)
#include "../mvllm/kernels/csrc/amx_tiles.h"
#include "../mvllm/kernels/csrc/exp16.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

// -DEMULATE: the tile instructions in scalar code (for checking the layouts on a CPU without AMX; not timed).
#if defined(EMULATE)
namespace emu {
alignas(64) inline uint8_t tiles[8][16][64];
inline float bf(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void zero(int t) { std::memset(tiles[t], 0, 1024); }
inline void load(int t, const void* p, long stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(tiles[t][r], static_cast<const uint8_t*>(p) + r * stride, 64);
}
inline void store(int t, void* p, long stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, tiles[t][r], 64);
}
inline void dp(int c, int a, int b) {
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      float acc;
      std::memcpy(&acc, tiles[c][m] + 4 * n, 4);
      for (int k = 0; k < 16; ++k) {
        uint16_t a0, a1, b0, b1;
        std::memcpy(&a0, tiles[a][m] + 4 * k, 2), std::memcpy(&a1, tiles[a][m] + 4 * k + 2, 2);
        std::memcpy(&b0, tiles[b][k] + 4 * n, 2), std::memcpy(&b1, tiles[b][k] + 4 * n + 2, 2);
        acc += bf(a0) * bf(b0) + bf(a1) * bf(b1);
      }
      std::memcpy(tiles[c][m] + 4 * n, &acc, 4);
    }
}
}  // namespace emu
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#undef _tile_release
#define _tile_zero(t) emu::zero(t)
#define _tile_loadd(t, p, s) emu::load(t, p, s)
#define _tile_stored(t, p, s) emu::store(t, p, s)
#define _tile_dpbf16ps(c, a, b) emu::dp(c, a, b)
#define _tile_release() (void)0
#endif

namespace {
constexpr int D = 64, kTokens = 19, kGroup = 7, R = kTokens * kGroup, RP = (R + 15) / 16 * 16;
constexpr int kFirstLen = 497, N = kFirstLen + kTokens - 1, NP = (N + 31) / 32 * 32, NT = NP / 16;


bool g_plain = false;  // "plain": bf16 alone (lo = 0, one product), for the speed and error of that

inline __m256i bf16(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }
inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline void split(__m512 x, __m256i& hi, __m256i& lo) {
  hi = bf16(x);
  lo = g_plain ? _mm256_setzero_si256() : bf16(_mm512_sub_ps(x, widen(hi)));
}

// 16 x 16 32-bit transpose in place (four rounds swapping the off-diagonal blocks of 1, 2, 4 and 8).
void transpose16(__m512i r[16]) {
  for (int b = 1; b < 16; b *= 2) {
    alignas(64) int32_t lo[16], hi[16];
    for (int j = 0; j < 16; ++j) lo[j] = (j & b) ? 16 + j - b : j, hi[j] = (j & b) ? 16 + j : j + b;
    const __m512i il = _mm512_load_si512(lo), ih = _mm512_load_si512(hi);
    for (int i = 0; i < 16; ++i)
      if (!(i & b)) {
        const __m512i a = r[i], c = r[i + b];
        r[i] = _mm512_permutex2var_epi32(a, il, c);
        r[i + b] = _mm512_permutex2var_epi32(a, ih, c);
      }
  }
}

struct Item {  // one kv head's rows and keys, and the buffers of its passes
  std::vector<float> q = std::vector<float>(RP * D), k = std::vector<float>(NP * D), v = std::vector<float>(NP * D);
  std::vector<int> len = std::vector<int>(RP, 0);
  std::vector<uint16_t> qh = std::vector<uint16_t>(RP * D), ql = qh;                // [RP][D]
  std::vector<uint16_t> kth = std::vector<uint16_t>(NT * 2 * 16 * 32), ktl = kth;  // [tile][half][pair][key, 2]
  std::vector<uint16_t> vph = std::vector<uint16_t>(NP / 32 * 4 * 16 * 32), vpl = vph;  // [step][col tile][pair][col, 2]
  std::vector<float> s = std::vector<float>(RP * NP);
  std::vector<uint16_t> ph = std::vector<uint16_t>(RP * NP), pl = ph;
  std::vector<float> l = std::vector<float>(RP), out = std::vector<float>(RP * D);
  explicit Item(unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    for (int r = 0; r < R; ++r) {
      len[r] = kFirstLen + r / kGroup;
      for (int i = 0; i < D; ++i) q[r * D + i] = nd(rng) * 0.125f * 2.f;
    }
    for (int j = 0; j < N; ++j)
      for (int i = 0; i < D; ++i) k[j * D + i] = nd(rng), v[j * D + i] = nd(rng);
  }
};

uint64_t ticks[4];

// The keys and values into tile layouts: K^T as B tiles (per tile of 16 keys and half of D: 16 rows of dim pairs,
// each row the pair for 16 keys), V as B tiles (per 32 keys and 16 columns: 16 rows of key pairs).
void convert(Item& it) {
  for (int t = 0; t < NT; ++t)
    for (int h = 0; h < 2; ++h) {
      __m512i rh[16], rl[16];
      for (int j = 0; j < 16; ++j) {
        const float* x = it.k.data() + (t * 16 + j) * D + h * 32;
        __m256i a_hi, a_lo, b_hi, b_lo;
        split(_mm512_loadu_ps(x), a_hi, a_lo);
        split(_mm512_loadu_ps(x + 16), b_hi, b_lo);
        rh[j] = _mm512_inserti64x4(_mm512_castsi256_si512(a_hi), b_hi, 1);  // 16 pairs of key j
        rl[j] = _mm512_inserti64x4(_mm512_castsi256_si512(a_lo), b_lo, 1);
      }
      transpose16(rh);
      transpose16(rl);
      uint16_t* dh = it.kth.data() + (t * 2 + h) * 512;
      uint16_t* dl = it.ktl.data() + (t * 2 + h) * 512;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dh + i * 32, rh[i]), _mm512_storeu_si512(dl + i * 32, rl[i]);
    }
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 16; ++i) idx[2 * i] = i, idx[2 * i + 1] = 16 + i;
  const __m512i inter = _mm512_loadu_si512(idx);
  for (int st = 0; st < NP / 32; ++st)
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < 16; ++i) {
        const float* a = it.v.data() + (st * 32 + 2 * i) * D + c * 16;
        __m256i ah, al, bh, bl;
        split(_mm512_loadu_ps(a), ah, al);
        split(_mm512_loadu_ps(a + D), bh, bl);
        const size_t o = ((st * 4 + c) * 16 + i) * 32;
        _mm512_storeu_si512(it.vph.data() + o,
                            _mm512_permutexvar_epi16(inter, _mm512_inserti64x4(_mm512_castsi256_si512(ah), bh, 1)));
        _mm512_storeu_si512(it.vpl.data() + o,
                            _mm512_permutexvar_epi16(inter, _mm512_inserti64x4(_mm512_castsi256_si512(al), bl, 1)));
      }
  for (int r = 0; r < RP; ++r)
    for (int i = 0; i < D; i += 16) {
      __m256i h, lo;
      split(_mm512_loadu_ps(it.q.data() + r * D + i), h, lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(it.qh.data() + r * D + i), h);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(it.ql.data() + r * D + i), lo);
    }
}

void scores(Item& it) {  // S [RP][NP] = Q K^T, four key tiles at a time in tiles 0-3
  for (int rb = 0; rb < RP / 16; ++rb)
    for (int t0 = 0; t0 < NT; t0 += 4) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int h = 0; h < 2; ++h) {
        _tile_loadd(4, it.qh.data() + rb * 16 * D + h * 32, D * 2);
        if (!g_plain) _tile_loadd(5, it.ql.data() + rb * 16 * D + h * 32, D * 2);
#define KT(T)                                                         \
  if (t0 + T < NT) {                                                  \
    _tile_loadd(6, it.kth.data() + ((t0 + T) * 2 + h) * 512, 64);     \
    if (!g_plain) _tile_loadd(7, it.ktl.data() + ((t0 + T) * 2 + h) * 512, 64); \
    _tile_dpbf16ps(T, 4, 6);                                          \
    if (!g_plain) {                                                   \
      _tile_dpbf16ps(T, 4, 7);                                        \
      _tile_dpbf16ps(T, 5, 6);                                        \
    }                                                                 \
  }
        KT(0) KT(1) KT(2) KT(3)
#undef KT
      }
      float* s = it.s.data() + rb * 16 * NP + t0 * 16;
      _tile_stored(0, s, NP * 4);
      if (t0 + 1 < NT) _tile_stored(1, s + 16, NP * 4);
      if (t0 + 2 < NT) _tile_stored(2, s + 32, NP * 4);
      if (t0 + 3 < NT) _tile_stored(3, s + 48, NP * 4);
    }
}

using mvllm::exp16;  // the engine's, as its float32 attention takes it (fused_kernels.h)

void softmax(Item& it) {  // P = exp(S - max) over each row's keys (the rest 0), split; l its sum
  for (int r = 0; r < RP; ++r) {
    const int len = it.len[r];
    float* s = it.s.data() + r * NP;
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < NP; j += 16) {
      const __mmask16 valid = j >= len ? 0 : j + 16 <= len ? 0xFFFF : (1u << (len - j)) - 1;
      m = _mm512_mask_max_ps(m, valid, m, _mm512_loadu_ps(s + j));
    }
    const float mx = _mm512_reduce_max_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < NP; j += 16) {
      const __mmask16 valid = j >= len ? 0 : j + 16 <= len ? 0xFFFF : (1u << (len - j)) - 1;
      const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(mx))));
      sum = _mm512_add_ps(sum, p);
      __m256i h, lo;
      split(p, h, lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(it.ph.data() + r * NP + j), h);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(it.pl.data() + r * NP + j), lo);
    }
    it.l[r] = len ? _mm512_reduce_add_ps(sum) : 0.f;
  }
}

void values(Item& it) {  // out = P V / l, the four column tiles in tiles 0-3 across every key
  for (int rb = 0; rb < RP / 16; ++rb) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int st = 0; st < NP / 32; ++st) {
      _tile_loadd(4, it.ph.data() + rb * 16 * NP + st * 32, NP * 2);
      if (!g_plain) _tile_loadd(5, it.pl.data() + rb * 16 * NP + st * 32, NP * 2);
#define VC(C)                                                   \
  _tile_loadd(6, it.vph.data() + ((st * 4 + C) * 16) * 32, 64); \
  if (!g_plain) _tile_loadd(7, it.vpl.data() + ((st * 4 + C) * 16) * 32, 64); \
  _tile_dpbf16ps(C, 4, 6);                                      \
  if (!g_plain) {                                               \
    _tile_dpbf16ps(C, 4, 7);                                    \
    _tile_dpbf16ps(C, 5, 6);                                    \
  }
      VC(0) VC(1) VC(2) VC(3)
#undef VC
    }
    float* o = it.out.data() + rb * 16 * D;
    _tile_stored(0, o, D * 4); _tile_stored(1, o + 16, D * 4); _tile_stored(2, o + 32, D * 4);
    _tile_stored(3, o + 48, D * 4);
    for (int r = rb * 16; r < rb * 16 + 16; ++r) {
      const __m512 inv = _mm512_set1_ps(it.l[r] > 0 ? 1.f / it.l[r] : 0.f);
      for (int i = 0; i < D; i += 16)
        _mm512_storeu_ps(it.out.data() + r * D + i, _mm512_mul_ps(_mm512_loadu_ps(it.out.data() + r * D + i), inv));
    }
  }
}

void attend(Item& it, bool timed) {
  uint64_t t0 = timed ? __rdtsc() : 0;
  convert(it);
  if (timed) ticks[0] += __rdtsc() - t0, t0 = __rdtsc();
  scores(it);
  if (timed) ticks[1] += __rdtsc() - t0, t0 = __rdtsc();
  softmax(it);
  if (timed) ticks[2] += __rdtsc() - t0, t0 = __rdtsc();
  values(it);
  if (timed) ticks[3] += __rdtsc() - t0;
}

double reference_error(const Item& it, double* rel) {  // the largest |out - exact| and relative to the row's scale
  double worst = 0, worst_rel = 0;
  for (int r = 0; r < R; ++r) {
    std::vector<double> sc(it.len[r]);
    double mx = -1e300;
    for (int j = 0; j < it.len[r]; ++j) {
      double a = 0;
      for (int i = 0; i < D; ++i) a += double(it.q[r * D + i]) * it.k[j * D + i];
      sc[j] = a, mx = std::max(mx, a);
    }
    double l = 0;
    for (double& x : sc) x = std::exp(x - mx), l += x;
    double scale = 0;
    std::vector<double> o(D, 0.0);
    for (int j = 0; j < it.len[r]; ++j)
      for (int i = 0; i < D; ++i) o[i] += sc[j] / l * it.v[j * D + i];
    for (int i = 0; i < D; ++i) scale = std::max(scale, std::fabs(o[i]));
    for (int i = 0; i < D; ++i) {
      const double e = std::fabs(o[i] - it.out[r * D + i]);
      worst = std::max(worst, e), worst_rel = std::max(worst_rel, e / scale);
    }
  }
  *rel = worst_rel;
  return worst;
}

#if defined(EMULATE)
bool permitted() { return true; }
void configure() {}
#else
bool permitted() { return mvllm::request_tile_data(); }
void configure() {
  mvllm::TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  mvllm::load_tile_config(c);
}
#endif

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "plain") == 0) g_plain = true, --argc, ++argv;
  std::printf("%s\n", g_plain ? "plain bf16: one product a pair" : "bf16 hi + lo: three products a pair");
  if (!permitted()) return std::puts("no AMX permission"), 1;
  configure();
  Item one(7);
  attend(one, false);
  double rel = 0;
  const double err = reference_error(one, &rel);
  std::printf("rows %d (padded %d), keys %d-%d (padded %d), D %d: largest error against double %.2e (%.2e of the "
              "row's largest output)\n", R, RP, kFirstLen, N, NP, D, err, rel);
  constexpr int kItems = 48;  // a step: 24 layers x 2 kv heads
  for (int round = 0; round < 3; ++round) {
    std::memset(ticks, 0, sizeof ticks);
    const double t0 = now();
    for (int i = 0; i < kItems; ++i) attend(one, true);
    const double us = (now() - t0) / kItems * 1e6;
    const double all = ticks[0] + ticks[1] + ticks[2] + ticks[3];
    std::printf("1 thread, round %d: %.1f us a (layer, kv head), %.2f ms a step of 48; convert %.0f%%, scores %.0f%%, "
                "softmax %.0f%%, values %.0f%%\n", round, us, us * kItems / 1e3, 100 * ticks[0] / all,
                100 * ticks[1] / all, 100 * ticks[2] / all, 100 * ticks[3] / all);
  }
  _tile_release();
  for (int a = 1; a < argc; ++a) {
    const int threads = std::atoi(argv[a]);
    std::vector<double> per;
    for (int round = 0; round < 3; ++round) {
      double start = 0, end = 0;
#pragma omp parallel num_threads(threads)
      {
        configure();
        Item mine(100 + omp_get_thread_num());
        attend(mine, false);
#pragma omp barrier
#pragma omp master
        start = now();
        for (int i = 0; i < kItems / threads + 1; ++i) attend(mine, false);
#pragma omp barrier
#pragma omp master
        end = now();
        _tile_release();
      }
      per.push_back((end - start) / (kItems / threads + 1) * 1e6);
    }
    std::sort(per.begin(), per.end());
    std::printf("%d threads, each its own item: %.1f us an item (median of 3), a step of 48 items ~ %.2f ms\n", threads,
                per[1], per[1] * kItems / threads / 1e3);
  }
  return 0;
}
