#pragma once

// Weight-only int8 linear with per-group scales, for CPU decode (a few activation rows).
// y[r, o] = sum_g scales[o, g] * sum_{i in group g} x[r, i] * q[o, i]  (+ bias[o])
// Every weight byte is read from memory once per call: each block of output rows is streamed once
// while all activation rows (small, cache resident) are applied to it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "amx_tiles.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

// No implicit FMA contraction: which products the compiler fuses may differ between template instances (row
// tiles), and a row's result must not depend on its tile (batch invariance). FMAs are written out (fma8).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

namespace mvllm::int8 {
namespace {

constexpr int64_t kOutBlock = 4;     // output rows per block: each x load is reused this many times
constexpr int64_t kRowTile = 8;      // activation rows per pass over a block (float activations)
constexpr int64_t kIntRowBytes = 192 * 1024;  // int16 activations: rows per pass up to this many bytes of them
constexpr int64_t kGrainOuts = 32;   // output rows per thread at least

struct Problem {
  const float* x;
  const int16_t* xq;  // x in int16, one scale per row (xs): the integer path without AVX-512 (else null)
  const float* xs;
  const int8_t* q;
  const float* scales;
  const uint16_t* scales16;  // the lanes layouts' scales, float16
  const uint8_t* q8;         // the lanes8 layout's weights, offset by 128 (else null: another layout)
  const int8_t* x8;          // lanes8: x in int8, one scale (x8s) and one offset term (x8c) per row and group
  const float* x8s;
  const int32_t* x8c;
  const float* bias;
  float* y;
  int64_t rows, in, out, group;
  int64_t block = kOutBlock;  // output rows per block (run's unit of work)
  bool lanes = false;         // q and scales are in the lanes layout (below; cpu_int8.pack)
  bool amx = false;           // lanes8: calls of more than kAmxAbove rows take AMX tiles (each thread loads their config)
  int64_t groups() const { return in / group; }
};

float finish(const Problem& p, int64_t o, float sum) { return p.bias ? sum + p.bias[o] : sum; }

#if defined(__AVX512F__)
// Rows [r0, r0 + R) x output o; the group is a multiple of 16. Each 16-weight vector is de-quantized once (int8 ->
// float, times its group's scale) and applied to all R rows. One flat loop over the inputs keeps the accumulators in
// registers (a loop nest over groups made GCC keep them on the stack). The next block's weights and scales are
// prefetched in software: the hardware prefetchers did not ramp up on short interleaved streams.
template <int R>
void block_avx512(const Problem& p, int64_t r0, int64_t o) {
  const int64_t ng = p.groups();
  const float* x = p.x + r0 * p.in;
  const int8_t* q = p.q + o * p.in;
  const float* scales = p.scales + o * ng;
  const int64_t ahead = p.block * p.in, ahead_scales = p.block * ng;  // the same place a block on
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t i = 0, g = 0, left = p.group; i < p.in; i += 16) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * p.in + i);
    if ((i & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + ahead + i), _MM_HINT_T0);
    if (left == p.group && (g & 15) == 0)
      _mm_prefetch(reinterpret_cast<const char*>(scales + ahead_scales + g), _MM_HINT_T0);
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
    __m512 s = _mm512_set1_ps(scales[g]);
    __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), s);
    for (int r = 0; r < R; ++r) total[r] = _mm512_fmadd_ps(xv[r], w, total[r]);
    if ((left -= 16) == 0) {
      left = p.group;
      ++g;
    }
  }
  for (int r = 0; r < R; ++r) p.y[(r0 + r) * p.out + o] = finish(p, o, _mm512_reduce_add_ps(total[r]));
}
#endif

// Portable path, in GCC/Clang vector extensions (AVX2 or SSE on x86, NEON on aarch64): rows [r0, r0 + R) x
// output o. Each 16 weights are converted and scaled once (w = q * s, as the AVX-512 path does) and applied
// to all R rows in R x 2 accumulators of 8 lanes. A group's inputs past its last multiple of
// 16 are summed one by one. Without AVX-512 it runs where the group is not a multiple of 16 (else block_int), or
// with MVLLM_INT8_PATH=float.
using f32x8 = float __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// a * b + c, fused where the CPU has FMA.
inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) {
#if defined(__FMA__) && defined(__AVX2__)
  __m256 va, vb, vc;
  std::memcpy(&va, &a, sizeof a), std::memcpy(&vb, &b, sizeof b), std::memcpy(&vc, &c, sizeof c);
  const __m256 r = _mm256_fmadd_ps(va, vb, vc);
  f32x8 out;
  std::memcpy(&out, &r, sizeof out);
  return out;
#elif defined(__ARM_NEON) && defined(__aarch64__)
  float32x4_t lo, hi, alo, ahi, blo, bhi;
  std::memcpy(&alo, &a, 16), std::memcpy(&ahi, reinterpret_cast<char*>(&a) + 16, 16);
  std::memcpy(&blo, &b, 16), std::memcpy(&bhi, reinterpret_cast<char*>(&b) + 16, 16);
  std::memcpy(&lo, &c, 16), std::memcpy(&hi, reinterpret_cast<char*>(&c) + 16, 16);
  lo = vfmaq_f32(lo, alo, blo), hi = vfmaq_f32(hi, ahi, bhi);
  f32x8 out;
  std::memcpy(&out, &lo, 16), std::memcpy(reinterpret_cast<char*>(&out) + 16, &hi, 16);
  return out;
#else
  return a * b + c;
#endif
}

// 8 int8 weights as floats, times their scale. GCC scalarises a generic int8 -> float vector conversion, so
// the widening is written per instruction set; elsewhere a plain loop.
inline f32x8 weights8(const int8_t* q, float s) {
  f32x8 v;
#if defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  std::memcpy(&v, &f, sizeof v);
#elif defined(__ARM_NEON)
  const int16x8_t h = vmovl_s8(vld1_s8(q));
  const float32x4_t lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), hi = vcvtq_f32_s32(vmovl_s16(vget_high_s16(h)));
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
#else
  float t[8];
  for (int l = 0; l < 8; ++l) t[l] = static_cast<float>(q[l]);
  std::memcpy(&v, t, sizeof v);
#endif
  return v * s;
}

template <int R>
void block_portable(const Problem& p, int64_t r0, int64_t o) {
  const int64_t ng = p.groups();
  const float* x = p.x + r0 * p.in;
  const int8_t* q = p.q + o * p.in;
  const float* sc = p.scales + o * ng;
  f32x8 total[R][2] = {};
  float tail[R] = {};
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t start = g * p.group, end = start + p.group, full = start + p.group / 16 * 16;
    for (int64_t i = start; i < full; i += 16) {
      const f32x8 w0 = weights8(q + i, sc[g]), w1 = weights8(q + i + 8, sc[g]);
      for (int r = 0; r < R; ++r) {
        total[r][0] = fma8(load8(x + r * p.in + i), w0, total[r][0]);
        total[r][1] = fma8(load8(x + r * p.in + i + 8), w1, total[r][1]);
      }
    }
    for (int64_t i = full; i < end; ++i) {
      const float w = static_cast<float>(q[i]) * sc[g];
      for (int r = 0; r < R; ++r) tail[r] = std::fma(x[r * p.in + i], w, tail[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const f32x8 v = total[r][0] + total[r][1];
    float sum = tail[r];
    for (int l = 0; l < 8; ++l) sum += v[l];
    p.y[(r0 + r) * p.out + o] = finish(p, o, sum);
  }
}

// int8 weights x int16 activations, summed exactly in int32 per group. Each row of x is quantized once per
// call to int16 with one scale per row (absmax / 32767: a relative step of 1.5e-5 of the row's largest value,
// far below the int8 weights' own error), so kStep weights take one widening to int16 and one multiply-add of
// pairs per row (AVX-512 vpdpwssd with VNNI, else vpmaddwd; AVX2 vpmaddwd; NEON smull/smlal), where the float
// path takes a conversion to int32, one to float, a scale and an FMA. Each group's int32 sums are converted once
// and scaled by the weights' group scale; the row's scale multiplies the final sum. Integer sums are exact, so
// a row's result does not depend on its batch here either.
#if defined(__AVX512BW__)
constexpr int64_t kStep = 32;  // weights per multiply-add step
using i32v = int32_t __attribute__((vector_size(64)));
using f32v = float __attribute__((vector_size(64)));
using W16 = __m512i;  // 32 weights widened to int16
inline W16 widen16(const int8_t* q) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))); }
inline i32v madd16(i32v acc, W16 w, const int16_t* x) {
  const __m512i xv = _mm512_loadu_si512(x);
#if defined(__AVX512VNNI__)
  return reinterpret_cast<i32v>(_mm512_dpwssd_epi32(reinterpret_cast<__m512i>(acc), w, xv));
#else
  return acc + reinterpret_cast<i32v>(_mm512_madd_epi16(w, xv));
#endif
}
inline f32v fmav(f32v a, f32v b, f32v c) {
  return reinterpret_cast<f32v>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
}
#else
constexpr int64_t kStep = 16;
using i32v = int32_t __attribute__((vector_size(32)));
using f32v = f32x8;
inline f32v fmav(f32v a, f32v b, f32v c) { return fma8(a, b, c); }
#if defined(__AVX2__)
using W16 = __m256i;  // 16 weights widened to int16
inline W16 widen16(const int8_t* q) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))); }
inline i32v madd16(i32v acc, W16 w, const int16_t* x) {
  const __m256i v = _mm256_madd_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  i32v r;
  std::memcpy(&r, &v, sizeof r);
  return acc + r;
}
#elif defined(__ARM_NEON) && defined(__aarch64__)
struct W16 {
  int16x8_t lo, hi;
};
inline W16 widen16(const int8_t* q) {
  const int8x16_t b = vld1q_s8(q);
  return {vmovl_s8(vget_low_s8(b)), vmovl_high_s8(b)};
}
inline i32v madd16(i32v acc, W16 w, const int16_t* x) {
  const int16x8_t xl = vld1q_s16(x), xh = vld1q_s16(x + 8);
  const int32x4_t a = vmlal_high_s16(vmull_s16(vget_low_s16(w.lo), vget_low_s16(xl)), w.lo, xl);
  const int32x4_t b = vmlal_high_s16(vmull_s16(vget_low_s16(w.hi), vget_low_s16(xh)), w.hi, xh);
  i32v r;
  std::memcpy(&r, &a, sizeof a);
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof a, &b, sizeof b);
  return acc + r;
}
#else
struct W16 {
  int16_t v[16];
};
inline W16 widen16(const int8_t* q) {
  W16 w;
  for (int l = 0; l < 16; ++l) w.v[l] = q[l];
  return w;
}
inline i32v madd16(i32v acc, const W16& w, const int16_t* x) {
  i32v r;
  for (int l = 0; l < 8; ++l) r[l] = int32_t(w.v[2 * l]) * x[2 * l] + int32_t(w.v[2 * l + 1]) * x[2 * l + 1];
  return acc + r;
}
#endif
#endif

inline f32v to_float(i32v v) { return __builtin_convertvector(v, f32v); }
constexpr int kLanes = sizeof(f32v) / sizeof(float);

// Rows [r0, r0 + R) x output o; the group is a multiple of kStep (G: it, known when compiled; 0: p.group).
// Two float accumulators, for even and odd groups, halve the FMA chain a row's groups wait on.
template <int R, int G>
void block_int(const Problem& p, int64_t r0, int64_t o) {
  const int64_t ng = p.groups(), group = G ? G : p.group;
  const int8_t* q = p.q + o * p.in;
  const float* sc = p.scales + o * ng;
  const int16_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.xq + (r0 + r) * p.in;
  f32v total[2][R] = {};
  for (int64_t g = 0; g < ng; ++g) {
    i32v acc[R] = {};
    for (int64_t k = 0; k < group; k += kStep) {
      const W16 w = widen16(q + k);
      for (int r = 0; r < R; ++r) acc[r] = madd16(acc[r], w, x[r] + k);
    }
    const f32v sv = f32v{} + sc[g];
    for (int r = 0; r < R; ++r) total[g & 1][r] = fmav(to_float(acc[r]), sv, total[g & 1][r]);
    q += group;
    for (int r = 0; r < R; ++r) x[r] += group;
  }
  for (int r = 0; r < R; ++r) {
    const f32v v = total[0][r] + total[1][r];
    float sum = 0.f;
    for (int l = 0; l < kLanes; ++l) sum += v[l];
    p.y[(r0 + r) * p.out + o] = finish(p, o, sum * p.xs[r0 + r]);
  }
}

// The lanes layout: outputs in SIMD lanes, so no horizontal sums and one stream of weights per thread. Weights are
// packed at load (cpu_int8.pack) in tiles of kLaneOuts outputs: tile t, group g holds the group's inputs in pairs,
// each pair for all 16 outputs: q[t, g, (k / 2) * 32 + o * 2 + k % 2] = w[16 t + o, g * group + k]; scales[t, g, o]
// (float16) is output 16 t + o's scale for group g. One 32-byte load is 2 inputs x 16 outputs; widened to int16, one
// multiply-add of pairs (vpdpwssd, or vpmaddwd) per activation row applies them to all 16 outputs, the row's two
// int16 inputs broadcast. Each group's int32 sums (exact) are converted once and scaled by the 16 outputs' scales;
// the row's scale multiplies the end. Integer sums do not depend on their order, so a row's result does not
// depend on its batch. Built with AVX-512BW (16 outputs a vector) or AVX2 (8 a vector, two vectors).
constexpr int64_t kLaneOuts = 16;
#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__F16C__))
constexpr bool kHasLanes = true;
#else
constexpr bool kHasLanes = false;
#endif

inline int32_t pair(const int16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

// An environment variable's integer value (fallback where unset), clamped to [lo, hi].
int64_t env_int(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* env = std::getenv(name);
  return std::clamp<int64_t>(env ? std::atoll(env) : fallback, lo, hi);
}
// Bytes ahead of each weight stream the AVX-512 lanes kernels prefetch into L1 (eight groups of a tile): the fastest
// decode of the distances tried; more tiles at once or L2 were no better (results/profile/README.md).
constexpr int64_t kPrefetchBytes = 4096;

#if defined(__AVX512BW__)
constexpr int kMaxLaneRows = 8;  // 8 rows' accumulators and totals, 16 of 32 registers
// Rows [r0, r0 + R) x tile t.
template <int R>
void lanes_block(const Problem& p, int64_t r0, int64_t t) {
  constexpr int A = R == 1 ? 4 : R == 2 ? 2 : 1;  // independent accumulators a row
  const int64_t ng = p.groups(), group = p.group;
  const int8_t* w = p.q + t * kLaneOuts * p.in;
  const uint16_t* sc = p.scales16 + t * kLaneOuts * ng;
  const int16_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.xq + (r0 + r) * p.in;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512i acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm512_setzero_si512();
    for (int64_t b = 0; b < kLaneOuts * group; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + b), _MM_HINT_T0);
    for (int64_t k = 0; k < group; k += 2 * A) {
      for (int a = 0; a < A; ++a) {
        __m512i xv[R];
        for (int r = 0; r < R; ++r) xv[r] = _mm512_set1_epi32(pair(x[r] + k + 2 * a));
        const __m512i wv =
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k + 2 * a) * kLaneOuts)));
        for (int r = 0; r < R; ++r) {
#if defined(__AVX512VNNI__)
          acc[r][a] = _mm512_dpwssd_epi32(acc[r][a], wv, xv[r]);
#else
          acc[r][a] = _mm512_add_epi32(acc[r][a], _mm512_madd_epi16(wv, xv[r]));
#endif
        }
      }
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * kLaneOuts)));
    for (int r = 0; r < R; ++r) {
      __m512i sum = acc[r][0];
      for (int a = 1; a < A; ++a) sum = _mm512_add_epi32(sum, acc[r][a]);
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, total[r]);
    }
    w += kLaneOuts * group;
    for (int r = 0; r < R; ++r) x[r] += group;
  }
  for (int r = 0; r < R; ++r) {
    __m512 v = _mm512_mul_ps(total[r], _mm512_set1_ps(p.xs[r0 + r]));
    if (p.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(p.bias + t * kLaneOuts));
    _mm512_storeu_ps(p.y + (r0 + r) * p.out + t * kLaneOuts, v);
  }
}
#elif defined(__AVX2__) && defined(__F16C__)
constexpr int kMaxLaneRows = 4;  // 4 rows x 2 halves of accumulators and totals, 16 registers
template <int R>
void lanes_block(const Problem& p, int64_t r0, int64_t t) {
  constexpr int A = R == 1 ? 2 : 1;
  const int64_t ng = p.groups(), group = p.group;
  const int8_t* w = p.q + t * kLaneOuts * p.in;
  const uint16_t* sc = p.scales16 + t * kLaneOuts * ng;
  const int16_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.xq + (r0 + r) * p.in;
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256i acc[R][A][2];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a][0] = acc[r][a][1] = _mm256_setzero_si256();
    for (int64_t k = 0; k < group; k += 2 * A) {
      for (int a = 0; a < A; ++a) {
        const int8_t* pw = w + (k + 2 * a) * kLaneOuts;  // outputs 0-7, then 8-15, two inputs each
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pw)));
        const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pw + 16)));
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_set1_epi32(pair(x[r] + k + 2 * a));
          acc[r][a][0] = _mm256_add_epi32(acc[r][a][0], _mm256_madd_epi16(lo, xv));
          acc[r][a][1] = _mm256_add_epi32(acc[r][a][1], _mm256_madd_epi16(hi, xv));
        }
      }
    }
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * kLaneOuts)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * kLaneOuts + 8)));
    for (int r = 0; r < R; ++r) {
      __m256i sum0 = acc[r][0][0], sum1 = acc[r][0][1];
      for (int a = 1; a < A; ++a) {
        sum0 = _mm256_add_epi32(sum0, acc[r][a][0]);
        sum1 = _mm256_add_epi32(sum1, acc[r][a][1]);
      }
      total[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum0), s0, total[r][0]);
      total[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum1), s1, total[r][1]);
      x[r] += group;
    }
    w += kLaneOuts * group;
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      __m256 v = _mm256_mul_ps(total[r][h], _mm256_set1_ps(p.xs[r0 + r]));
      if (p.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(p.bias + t * kLaneOuts + 8 * h));
      _mm256_storeu_ps(p.y + (r0 + r) * p.out + t * kLaneOuts + 8 * h, v);
    }
}
#endif

#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__F16C__))
// K::run<R> for the runtime row count (up to kMaxLaneRows): each count its own instance, accumulators in registers.
template <class K, int R = 1>
void lane_rows(const Problem& p, int64_t r0, int64_t rows, int64_t t) {
  if constexpr (R <= kMaxLaneRows) {
    if (rows == R) return K::template run<R>(p, r0, t);
    lane_rows<K, R + 1>(p, r0, rows, t);
  }
}

struct Lanes {
  template <int R>
  static void run(const Problem& p, int64_t r0, int64_t t) { lanes_block<R>(p, r0, t); }
};

// Rows [r0, r0 + rows) x tiles [t0, t0 + tiles), a tile at a time, kMaxLaneRows rows at a time.
void lanes(const Problem& p, int64_t r0, int64_t rows, int64_t t0, int64_t tiles) {
  for (int64_t t = t0; t < t0 + tiles; ++t)
    for (int64_t r = r0; r < r0 + rows; r += kMaxLaneRows)
      lane_rows<Lanes>(p, r, std::min<int64_t>(kMaxLaneRows, r0 + rows - r), t);
}
#else
void lanes(const Problem&, int64_t, int64_t, int64_t, int64_t) {}
#endif

// The lanes8 layout: int8 activations, AVX-512 VNNI (vpdpbusd: 4 unsigned x 4 signed bytes into each int32
// lane). Tiles of 16 outputs as in the lanes layout, but each group's inputs in fours: q[t, g, (k / 4) * 64 + o * 4
// + k % 4] = w[16 t + o, g * group + k] + 128, as uint8 (cpu_int8.pack). One 64-byte load is 4 inputs x 16
// outputs, and one vpdpbusd per activation row applies them, the row's 4 int8 inputs broadcast: half the
// instructions a weight of the lanes layout (one load and one multiply-add for 64 weights, against a load, a
// widening and a multiply-add for 32), with no widening. Each row is rounded to int8 per group of inputs, with
// one scale per row and group (absmax / 127, as llama.cpp's Q8_0 activations); the offset's 128 * sum(x) per row
// and group (x8c) is taken off each group's int32 sum, which is exact, so a row's result does not depend on its
// batch. The group's sum times the 16 weight scales times the row's group scale adds to the total.
constexpr int kGemmRows = 4, kGemmTiles = 3;  // lanes8 from kGemmMin rows: 12 accumulators, 12 totals
// The fewest rows that take the blocks of kGemmTiles tiles; fewer take one tile at a time, all their rows a pass.
constexpr int64_t kGemmMin = 8;
constexpr int64_t kAmxRows = 16;              // AMX (below): the rows of a tile
// Calls of more rows than this take AMX tiles: decode's few rows are faster on the VNNI blocks
// (results/profile/README.md). A call's rows go in passes of 16 (one A tile; passes of 32 in two were slower), and
// the rows past the last 16, where no more than this, on the VNNI blocks block by block, both tiles of a block at
// once (20 rows: 16 on the tiles, 4 on VNNI, each block read from memory once).
constexpr int64_t kAmxAbove = 8;
// Groups whose AMX products lanes8_amx finishes together, the totals kept in registers through them: faster than
// one group at a time, and 8 no better (results/profile/README.md).
constexpr int64_t kFinishGroups = 4;
// Calls of several passes over a block of weights (lanes8_gemm's kGemmRows rows, AMX's 16, a pass each) read the
// block from memory in the first pass and from L2 in the others, so memory would idle while they compute: each
// pass instead prefetches (into L2) its share of the next block, which is the next bytes of q, and the first pass
// finds it there. A call of one pass prefetches the whole next block, so that it computes on one block while the
// next streams in.

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kHasLanes8 = true;

// The slice of the next block one pass of `passes` over a block prefetches: per group of the pass, `per_group`
// bytes from at + g * per_group (whole cache lines), up to `end` (q's end).
struct Stage {
  const uint8_t* at = nullptr;
  const uint8_t* end = nullptr;
  int64_t per_group = 0;
  void group(int64_t g) const {
    const uint8_t* from = at + g * per_group;
    for (const uint8_t* b = from; b < from + per_group && b < end; b += 64) _mm_prefetch(reinterpret_cast<const char*>(b), _MM_HINT_T1);
  }
};
// Pass `i` of `passes` over a block of `bytes` of weights at w (groups ng): its share of the next block's.
Stage stage(const Problem& p, const uint8_t* w, int64_t bytes, int64_t i, int64_t passes) {
  const int64_t ng = p.groups(), per_group = (bytes + passes * ng * 64 - 1) / (passes * ng * 64) * 64;
  return {w + bytes + i * ng * per_group, p.q8 + p.out * p.in, per_group};
}


inline int32_t quad(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

template <int R>
void lanes8_block(const Problem& p, int64_t r0, int64_t t) {
  constexpr int A = R == 1 ? 4 : R == 2 ? 2 : 1;  // independent accumulators a row: 4 * A inputs a step
  const int64_t ng = p.groups(), group = p.group;
  const uint8_t* w = p.q8 + t * kLaneOuts * p.in;
  const uint16_t* sc = p.scales16 + t * kLaneOuts * ng;
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.x8 + (r0 + r) * p.in;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512i acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm512_setzero_si512();
    for (int64_t b = 0; b < kLaneOuts * group; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + b), _MM_HINT_T0);
    for (int64_t k = 0; k < group; k += 4 * A)
      for (int a = 0; a < A; ++a) {
        const __m512i wv = _mm512_loadu_si512(w + (k + 4 * a) * kLaneOuts);
        for (int r = 0; r < R; ++r)
          acc[r][a] = _mm512_dpbusd_epi32(acc[r][a], wv, _mm512_set1_epi32(quad(x[r] + k + 4 * a)));
      }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * kLaneOuts)));
    for (int r = 0; r < R; ++r) {
      __m512i sum = acc[r][0];
      for (int a = 1; a < A; ++a) sum = _mm512_add_epi32(sum, acc[r][a]);
      sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(p.x8c[(r0 + r) * ng + g]));
      const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(p.x8s[(r0 + r) * ng + g]));
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, total[r]);
      x[r] += group;
    }
    w += kLaneOuts * group;
  }
  for (int r = 0; r < R; ++r) {
    __m512 v = total[r];
    if (p.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(p.bias + t * kLaneOuts));
    _mm512_storeu_ps(p.y + (r0 + r) * p.out + t * kLaneOuts, v);
  }
}

struct Lanes8 {
  template <int R>
  static void run(const Problem& p, int64_t r0, int64_t t) { lanes8_block<R>(p, r0, t); }
};

// Rows [r0, r0 + R) x tiles [t0, t0 + T). A step of 4 inputs loads T weight vectors and R broadcasts for R * T
// vpdpbusd: at 1 tile R + 1 loads for R; at 4 rows x 3 tiles (kGemmRows x kGemmTiles, from kGemmMin rows) 7 for
// 12. Every (row, output, group) gets the same integer sum and the same float steps whatever R and T, so a row's
// result does not depend on its batch. (lanes8_block<R> is this at T = 1, kept apart: with the general loops GCC
// spilled 8 rows' accumulators to the stack.)
template <int R, int T>
void lanes8_gemm(const Problem& p, int64_t r0, int64_t t0, const Stage& next) {
  constexpr int A = R * T == 1 ? 4 : R * T == 2 ? 2 : 1;  // independent accumulators a row and tile
  const int64_t ng = p.groups(), group = p.group;
  const uint8_t* w[T];
  const uint16_t* sc[T];
  for (int j = 0; j < T; ++j) {
    w[j] = p.q8 + (t0 + j) * kLaneOuts * p.in;
    sc[j] = p.scales16 + (t0 + j) * kLaneOuts * ng;
  }
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.x8 + (r0 + r) * p.in;
  __m512 total[R][T];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < T; ++j) total[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512i acc[R][T][A];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < T; ++j)
        for (int a = 0; a < A; ++a) acc[r][j][a] = _mm512_setzero_si512();
    for (int j = 0; j < T; ++j)
      for (int64_t b = 0; b < kLaneOuts * group; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w[j] + kPrefetchBytes + b), _MM_HINT_T0);
    next.group(g);
    for (int64_t k = 0; k < group; k += 4 * A) {
#pragma GCC unroll 4
      for (int a = 0; a < A; ++a) {
        __m512i wv[T];
#pragma GCC unroll 4
        for (int j = 0; j < T; ++j) wv[j] = _mm512_loadu_si512(w[j] + (k + 4 * a) * kLaneOuts);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_set1_epi32(quad(x[r] + k + 4 * a));
#pragma GCC unroll 4
          for (int j = 0; j < T; ++j) acc[r][j][a] = _mm512_dpbusd_epi32(acc[r][j][a], wv[j], xv);
        }
      }
    }
    __m512 s[T];
    for (int j = 0; j < T; ++j)
      s[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc[j] + g * kLaneOuts)));
    for (int r = 0; r < R; ++r) {
      const __m512i c = _mm512_set1_epi32(p.x8c[(r0 + r) * ng + g]);
      const __m512 xs = _mm512_set1_ps(p.x8s[(r0 + r) * ng + g]);
      for (int j = 0; j < T; ++j) {
        __m512i sum = acc[r][j][0];
        for (int a = 1; a < A; ++a) sum = _mm512_add_epi32(sum, acc[r][j][a]);
        sum = _mm512_sub_epi32(sum, c);
        total[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s[j], xs), total[r][j]);
      }
      x[r] += group;
    }
    for (int j = 0; j < T; ++j) w[j] += kLaneOuts * group;
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < T; ++j) {
      __m512 v = total[r][j];
      if (p.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(p.bias + (t0 + j) * kLaneOuts));
      _mm512_storeu_ps(p.y + (r0 + r) * p.out + (t0 + j) * kLaneOuts, v);
    }
}

// lanes8_gemm<rows, T> for the runtime row count, 1 to kGemmRows.
template <int T, int R = 1>
void gemm_rows(const Problem& p, int64_t r0, int64_t rows, int64_t t, const Stage& next) {
  if constexpr (R <= kGemmRows) {
    if (rows == R) return lanes8_gemm<R, T>(p, r0, t, next);
    gemm_rows<T, R + 1>(p, r0, rows, t, next);
  }
}

// AMX (Sapphire Rapids and later): the lanes8 layout is already AMX's B tile. One tile's group, (group / 4) rows
// of 64 bytes (4 inputs x 16 outputs), is B; kAmxRows activation rows of the group (int8, row stride `in`) are A;
// one tdpbsud (A signed, B unsigned) gives the 16 x 16 int32 sums vpdpbusd gives, exactly. They are stored and
// finished by the same float steps as lanes8_block, so a row's result is the same bits on either path. Used in calls
// of more than kAmxAbove rows, in passes of up to 16 rows over blocks of 2 tiles (then 1), where the build has AMX,
// Linux grants the tile state (arch_prctl), the group fits one tile (<= 64 inputs) and MVLLM_INT8_AMX is not 0.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
constexpr bool kHasAmx = true;

bool amx_permitted() {  // the kernel's permission for this process to use the tile data state
  static const bool ok = request_tile_data();
  return ok;
}

// Tiles 0, 1: sums (rows x 16 int32, a weight tile each); 4: activations (rows x group bytes); 6, 7: weights (group /
// 4 rows of 64 bytes); 2, 3 and 5 take the shapes of 0 and 4. Each thread keeps the shape it loaded, so a pass of
// another row count loads a new configuration only when the rows change.
struct AmxShape {
  int64_t group = 0, rows = 0;
};
thread_local AmxShape amx_shape;
void amx_configure(int64_t rows) {
  AmxShape& now = amx_shape;
  if (now.rows == rows) return;
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = 64;
  for (int t : {4, 5}) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = static_cast<uint16_t>(now.group);
  for (int t : {6, 7}) c.rows[t] = static_cast<uint8_t>(now.group / 4), c.colsb[t] = 64;
  load_tile_config(c);
  now.rows = rows;
}
void amx_begin(int64_t group) { amx_shape = {group, 0}; }
void amx_end() {
  if (amx_shape.rows) _tile_release();
  amx_shape = {};
}

// Rows [r0, r0 + m) (m <= 16, the tiles configured so) x tiles [t, t + TB), TB 1 or 2: each group's TB products go
// to sum tiles 0 and 1 and are stored, kFinishGroups groups at a time; then each row's totals are loaded once, take
// those groups in order in registers (the float steps of lanes8_block, so the same bits), and are stored once. The
// next groups' products are issued before these groups' float steps, so the tiles and the vector units work at once.
template <int TB>
void lanes8_amx(const Problem& p, int64_t r0, int64_t m, int64_t t, const Stage& next) {
  constexpr int64_t chunk = kFinishGroups;
  const int64_t ng = p.groups(), in = p.in, group = p.group;
  const uint8_t* w0 = p.q8 + t * kLaneOuts * in;
  const uint8_t* w1 = w0 + kLaneOuts * in;
  const int8_t* x0 = p.x8 + r0 * in;
  // GCC 12's tileloadd asm names no memory it reads: every store to the activations and weights is made first.
  asm volatile("" : : : "memory");
  alignas(64) int32_t sums[2][chunk][TB][kAmxRows * kLaneOuts];
  alignas(64) float total[kAmxRows][TB * kLaneOuts] = {};
  auto products = [&](int64_t g0, int32_t (*c)[TB][kAmxRows * kLaneOuts]) {
    for (int64_t g = g0; g < std::min(ng, g0 + chunk); ++g) {
      int32_t (*out)[kAmxRows * kLaneOuts] = c[g - g0];
      _tile_zero(0);
      if constexpr (TB == 2) _tile_zero(1);
      _tile_loadd(4, x0 + g * group, in);
      _tile_loadd(6, w0 + g * kLaneOuts * group, 64);
      if constexpr (TB == 2) _tile_loadd(7, w1 + g * kLaneOuts * group, 64);
      _tile_dpbsud(0, 4, 6);
      if constexpr (TB == 2) _tile_dpbsud(1, 4, 7);
      _tile_stored(0, out[0], 64);
      if constexpr (TB == 2) _tile_stored(1, out[1], 64);
      next.group(g);
    }
  };
  auto finish = [&](int64_t g0, int32_t (*c)[TB][kAmxRows * kLaneOuts]) {
    const int64_t n = std::min(ng, g0 + chunk) - g0;
    __m512 s[chunk][TB];
    for (int64_t k = 0; k < n; ++k)
      for (int j = 0; j < TB; ++j)
        s[k][j] = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scales16 + ((t + j) * ng + g0 + k) * kLaneOuts)));
    for (int64_t r = 0; r < m; ++r) {
      const int64_t row = r0 + r;
      float* tot = total[r];
      __m512 acc[TB];
      for (int j = 0; j < TB; ++j) acc[j] = _mm512_load_ps(tot + j * kLaneOuts);
      for (int64_t k = 0; k < n; ++k) {
        const __m512i off = _mm512_set1_epi32(p.x8c[row * ng + g0 + k]);
        const __m512 xs = _mm512_set1_ps(p.x8s[row * ng + g0 + k]);
        for (int j = 0; j < TB; ++j) {
          const __m512i sum = _mm512_sub_epi32(_mm512_load_si512(c[k][j] + r * kLaneOuts), off);
          acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s[k][j], xs), acc[j]);
        }
      }
      for (int j = 0; j < TB; ++j) _mm512_store_ps(tot + j * kLaneOuts, acc[j]);
    }
  };
  products(0, sums[0]);
  int64_t b = 0;
  for (int64_t g0 = chunk; g0 < ng; g0 += chunk, b ^= 1) {
    products(g0, sums[b ^ 1]);
    finish(g0 - chunk, sums[b]);
  }
  finish((ng - 1) / chunk * chunk, sums[b]);
  for (int64_t r = 0; r < m; ++r)
    for (int j = 0; j < TB; ++j) {
      __m512 v = _mm512_load_ps(total[r] + j * kLaneOuts);
      if (p.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(p.bias + (t + j) * kLaneOuts));
      _mm512_storeu_ps(p.y + (r0 + r) * p.out + (t + j) * kLaneOuts, v);
    }
}

// One pass over tiles [t, t + TB) for rows [r0, r0 + rows), rows 1-16: one A tile.
template <int TB>
void amx_pass(const Problem& p, int64_t r0, int64_t rows, int64_t t, const Stage& next) {
  amx_configure(rows);
  lanes8_amx<TB>(p, r0, rows, t, next);
}

// Rows [r0, r0 + rows) x tiles [t0, t0 + tiles) in passes of up to 16 rows over blocks of 2 tiles (then 1); the rows
// past the last 16, where no more than kAmxAbove, on the VNNI blocks, block by block.
void amx_rows(const Problem& p, int64_t r0, int64_t rows, int64_t t0, int64_t tiles) {
  const int64_t left = rows % kAmxRows, vnni = std::min<int64_t>(kAmxAbove, kMaxLaneRows);
  const int64_t rest = rows > kAmxRows && left <= vnni ? left : 0;
  const int64_t tiled = rows - rest, passes = (tiled + kAmxRows - 1) / kAmxRows;
  for (int64_t t = t0; t < t0 + tiles; t += 2) {
    const int64_t n = std::min<int64_t>(2, t0 + tiles - t), bytes = n * kLaneOuts * p.in;
    for (int64_t i = 0; i < passes; ++i) {
      const int64_t r = r0 + i * kAmxRows, m = std::min(kAmxRows, r0 + tiled - r);
      const Stage next = stage(p, p.q8 + t * kLaneOuts * p.in, bytes, i, passes);
      if (n == 2) amx_pass<2>(p, r, m, t, next);
      else amx_pass<1>(p, r, m, t, next);
    }
    if (n == 2)  // both tiles at once, up to kGemmRows rows a pass: 2 x rows independent sums
      for (int64_t r = r0 + tiled; r < r0 + rows; r += kGemmRows)
        gemm_rows<2>(p, r, std::min<int64_t>(kGemmRows, r0 + rows - r), t, Stage{});
    else if (rest)
      lane_rows<Lanes8>(p, r0 + tiled, rest, t);
  }
}
#else
constexpr bool kHasAmx = false;
bool amx_permitted() { return false; }
void amx_begin(int64_t) {}
void amx_end() {}
void amx_rows(const Problem&, int64_t, int64_t, int64_t, int64_t) {}
#endif

// AMX is used here (built, permitted, not turned off by MVLLM_INT8_AMX=0), for calls with this group.
bool amx_on(int64_t group) {
  static const bool on = kHasAmx && env_int("MVLLM_INT8_AMX", 1, 0, 1) == 1 && amx_permitted();
  return on && group <= 64 && group % 16 == 0;
}

// Rows [r0, r0 + rows) x tiles [t0, t0 + tiles): from kGemmMin rows kGemmTiles tiles at a time, kGemmRows rows
// at a time; else (and for the tiles left over) one tile, kMaxLaneRows rows at a time.
void lanes8(const Problem& p, int64_t r0, int64_t rows, int64_t t0, int64_t tiles) {
  if (p.amx) return amx_rows(p, r0, rows, t0, tiles);
  int64_t t = t0;
  if (p.rows >= kGemmMin)
    for (; t + kGemmTiles <= t0 + tiles; t += kGemmTiles) {
      const int64_t passes = (rows + kGemmRows - 1) / kGemmRows, bytes = kGemmTiles * kLaneOuts * p.in;
      for (int64_t i = 0; i < passes; ++i)
        gemm_rows<kGemmTiles>(p, r0 + i * kGemmRows, std::min<int64_t>(kGemmRows, rows - i * kGemmRows), t,
                  stage(p, p.q8 + t * kLaneOuts * p.in, bytes, i, passes));
    }
  for (; t < t0 + tiles; ++t)
    for (int64_t r = r0; r < r0 + rows; r += kMaxLaneRows)
      lane_rows<Lanes8>(p, r, std::min<int64_t>(kMaxLaneRows, r0 + rows - r), t);
}

// x rows [begin, end) -> int8 per group: x8 = round(x * (127 / absmax(group))), its scale s = absmax / 127 (0 for a
// zero group), and the offset term 128 * sum(x8) of each row and group. The group is a multiple of 16.
void quantize_groups(const Problem& p, int8_t* xq, float* xs, int32_t* xc, int64_t begin, int64_t end) {
  const int64_t ng = p.groups();
  for (int64_t r = begin; r < end; ++r)
    for (int64_t g = 0; g < ng; ++g) {
      const float* x = p.x + r * p.in + g * p.group;
      int8_t* out = xq + r * p.in + g * p.group;
      __m512 m = _mm512_setzero_ps();
      for (int64_t i = 0; i < p.group; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
      const float top = _mm512_reduce_max_ps(m), inv = top > 0.f ? 127.f / top : 0.f;
      __m512i sum = _mm512_setzero_si512();
      for (int64_t i = 0; i < p.group; i += 16) {  // round to nearest even; |x * inv| <= 127
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)));
        sum = _mm512_add_epi32(sum, v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtsepi32_epi8(v));
      }
      xs[r * ng + g] = top > 0.f ? top / 127.f : 0.f;
      xc[r * ng + g] = 128 * _mm512_reduce_add_epi32(sum);
    }
}
#else
constexpr bool kHasLanes8 = false;
bool amx_on(int64_t) { return false; }
void amx_begin(int64_t) {}
void amx_end() {}
void lanes8(const Problem&, int64_t, int64_t, int64_t, int64_t) {}
void quantize_groups(const Problem&, int8_t*, float*, int32_t*, int64_t, int64_t) {}
#endif

// x rows [begin, end) -> int16 with one scale per row: xq = round(x / s), s = absmax / 32767 (0 for a zero row).
void quantize_rows(const Problem& p, int16_t* xq, float* xs, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* x = p.x + r * p.in;
    float m = 0.f;
    for (int64_t i = 0; i < p.in; ++i) m = std::max(m, std::fabs(x[i]));
    const float inv = m > 0.f ? 32767.f / m : 0.f;
    int16_t* out = xq + r * p.in;
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 k = _mm256_set1_ps(inv);
    for (; i + 16 <= p.in; i += 16) {  // round to nearest even, as nearbyint below
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), k));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), k));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
    }
#endif
    for (; i < p.in; ++i) out[i] = static_cast<int16_t>(std::nearbyint(x[i] * inv));
    xs[r] = m > 0.f ? m / 32767.f : 0.f;
  }
}

// One output row o for R activation rows from r0, by each path.
template <int R>
struct Float {
  static void run(const Problem& p, int64_t r0, int64_t o) { block_portable<R>(p, r0, o); }
};
template <int R>
struct Int {
  static void run(const Problem& p, int64_t r0, int64_t o) {
    p.group == 32 ? block_int<R, 32>(p, r0, o) : block_int<R, 0>(p, r0, o);
  }
};
#if defined(__AVX512F__)
template <int R>
struct Avx512 {
  static void run(const Problem& p, int64_t r0, int64_t o) { block_avx512<R>(p, r0, o); }
};
#endif

// Which path runs, MVLLM_INT8_PATH (read once; for tests and same-run comparisons): "lanes8" (the lanes8 layout: int8
// activations per group, AVX-512 VNNI), "lanes" (the lanes layout, int16 activations; Int8Linear packs its weights
// for the path's layout at load, asking layout()), "int16" (int16 activations, one weight row at a time, wherever
// the group is a multiple of kStep) or "float" (float32 activations, one weight row streaming at a time). Unset or
// anything else: the fastest built, lanes8, else lanes (AVX2 or AVX-512BW without VNNI), else int16 (NEON, plain
// loops) (results/profile/README.md). lanes8 asked where it is not built gives lanes. A packed q (3-D) always takes
// its layout's kernel: uint8 lanes8, int8 lanes.
enum class Path { kInt16, kFloat, kLanes, kLanes8 };
Path path() {
  static const Path chosen = [] {
    const char* env = std::getenv("MVLLM_INT8_PATH");
    const std::string v = env ? env : "";
    if (v == "int16") return Path::kInt16;
    if (v == "float") return Path::kFloat;
    if (v == "lanes" && kHasLanes) return Path::kLanes;
    if (v == "lanes8" && kHasLanes8) return Path::kLanes8;
    if (v == "lanes" || v == "lanes8") return kHasLanes ? Path::kLanes : Path::kInt16;
    if (kHasLanes8) return Path::kLanes8;
    if (kHasLanes) return Path::kLanes;
    return Path::kInt16;
  }();
  return chosen;
}
bool int16_rows(int64_t group) { return path() == Path::kInt16 && group % kStep == 0; }
// Whether weights of this group size are packed in a lanes layout at load, and in which (cpu_int8.pack asks).
bool packs8(int64_t group) { return path() == Path::kLanes8 && group % 16 == 0; }
bool packs(int64_t group) { return packs8(group) || (path() == Path::kLanes && group % 8 == 0); }
std::string layout(int64_t group) { return packs8(group) ? "lanes8" : packs(group) ? "lanes" : ""; }

// The path a call with this group size takes, and its instructions: what the profile records.
std::string path_name(int64_t group) {
  if (packs8(group))
    return std::string("lanes8 (int8 per group, AVX-512 VNNI vpdpbusd, 16 outputs a vector") +
           (amx_on(group) ? "; AMX tiles above " + std::to_string(kAmxAbove) + " rows)" : ")");
  if (packs(group)) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return "lanes (int16, AVX-512 VNNI vpdpwssd, 16 outputs a vector)";
#elif defined(__AVX512BW__)
    return "lanes (int16, AVX-512 vpmaddwd, 16 outputs a vector)";
#else
    return "lanes (int16, AVX2 vpmaddwd, 8 outputs a vector)";
#endif
  }
  if (int16_rows(group)) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return "int16 (AVX-512 VNNI vpdpwssd)";
#elif defined(__AVX512BW__)
    return "int16 (AVX-512 vpmaddwd)";
#elif defined(__AVX2__)
    return "int16 (AVX2 vpmaddwd)";
#elif defined(__ARM_NEON) && defined(__aarch64__)
    return "int16 (NEON smull/smlal)";
#else
    return "int16 (plain loops)";
#endif
  }
#if defined(__AVX512F__)
  if (group % 16 == 0) return "float (AVX-512)";
#endif
  return "float (vector extensions)";
}

// Rows [r0, r0 + rows) x outputs [o0, o0 + outs), outs <= p.block, one output at a time in tiles of 4, 2 or 1
// rows through kernel K (block_portable, float32 activations; or block_int): one weight row streams at a time,
// which the hardware prefetcher follows (faster than 4 interleaved rows on an AVX2 machine).
template <template <int> class K>
void tiles(const Problem& p, int64_t r0, int64_t rows, int64_t o0, int64_t outs) {
  for (int64_t r = r0; r < r0 + rows;) {
    const int64_t left = r0 + rows - r;
    for (int64_t o = o0; o < o0 + outs; ++o) {
      if (left >= 4) {
        K<4>::run(p, r, o);
      } else if (left >= 2) {
        K<2>::run(p, r, o);
      } else {
        K<1>::run(p, r, o);
      }
    }
    r += left >= 4 ? 4 : left >= 2 ? 2 : 1;
  }
}

void block(const Problem& p, int64_t r0, int64_t rows, int64_t o0, int64_t outs) {
  if (p.q8) return lanes8(p, r0, rows, o0 / kLaneOuts, (outs + kLaneOuts - 1) / kLaneOuts);
  if (p.lanes) return lanes(p, r0, rows, o0 / kLaneOuts, (outs + kLaneOuts - 1) / kLaneOuts);
  if (p.xq) return tiles<Int>(p, r0, rows, o0, outs);
#if defined(__AVX512F__)
  if (p.group % 16 == 0) return tiles<Avx512>(p, r0, rows, o0, outs);
#endif
  tiles<Float>(p, r0, rows, o0, outs);
}

// Each thread takes a range of output blocks. A decode step (a few rows) streams each block once for all rows. With
// more rows (prefill) the thread applies one tile of rows to its whole range before the next tile, so its slice of
// the weights is read once per tile: kRowTile rows of float activations (their accumulators in registers), or as
// many int16 (int8) rows as fit in kIntRowBytes (the int path's tiles<> walks them 4 at a time per output row, which
// stays in L1, while the rows' copy stays in L2): at 20 rows, one pass over the weights instead of three. Every row
// gets the same arithmetic whatever the row count: the accumulation order of y[r, o] depends only on the input size,
// so a request's result does not depend on what shares its batch.
// How a call's output blocks are shared among threads: kChunksPerThread chunks a thread, each thread claiming the
// next chunk until none are left (where there are too few, one even range per thread, at::parallel_for's split). A
// thread the host slows (its vCPU sharing a core, or descheduled) then takes fewer chunks instead of holding up the
// rest, as ggml's matmul does with its chunk counter. Chunks are whole blocks of at least kChunkBytes of weights, so
// each still streams; which thread computes an output changes nothing in its arithmetic. 8 beat one range a thread,
// 4 and 16 were level with it (results/profile/README.md).
constexpr int64_t kChunksPerThread = 8;
constexpr int64_t kChunkBytes = 64 << 10;
constexpr int64_t kMinBand = 64;  // rows a work unit at least, where a call's rows are cut into bands (run)

// The rows a pass over a block of weights applies (the rest of a call's rows in later passes; see run).
int64_t row_tile(const Problem& p) {
  const int64_t pair = 2 * kAmxRows;  // AMX: a multiple of 32 rows
  return p.xq    ? std::max<int64_t>(kRowTile, kIntRowBytes / (2 * p.in))
         : p.amx ? std::max<int64_t>(pair, kIntRowBytes / p.in / pair * pair)
         : p.x8  ? std::max<int64_t>(kRowTile, kIntRowBytes / p.in)
                 : kRowTile;
}

// Rows [r0, r1) in bands of `band` rows x output blocks [b0, b1): one of run's units of work.
void bands_by_blocks(const Problem& p, int64_t r0, int64_t r1, int64_t band, int64_t b0, int64_t b1) {
  for (int64_t r = r0; r < r1; r += band)
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * p.block, outs = std::min(p.block, p.out - o0);
      block(p, r, std::min(band, r1 - r), o0, outs);
    }
}

void run(const Problem& p) {
  const int64_t blocks = (p.out + p.block - 1) / p.block;
  const int64_t pair = 2 * kAmxRows, tile = row_tile(p);
  const int64_t grain = std::max<int64_t>(1, kGrainOuts / p.block);
  const int64_t threads = at::get_num_threads(), per = kChunksPerThread;
  const int64_t least = std::max(grain, kChunkBytes / std::max<int64_t>(1, p.block * p.in));  // blocks a chunk
  const int64_t size = std::max(least, (blocks + per * threads - 1) / std::max<int64_t>(1, per * threads));
  const int64_t n_chunks = (blocks + size - 1) / size;
  // Work units: a chunk of blocks x a band of rows (the row tile), the bands outermost. A call of many rows and
  // few chunks (a prefill through a narrow layer: 14 chunks of 64 outputs) gets narrower bands, down to kMinBand
  // rows and while fewer than 4 units a thread, so that every thread has work to the end (faster in prefill than a
  // chunk's bands kept by one thread: results/profile/README.md).
  int64_t band = tile;
  const int64_t step = p.amx ? pair : kRowTile, floor_rows = std::max<int64_t>(kMinBand, step);
  auto bands_of = [&](int64_t b) { return (p.rows + b - 1) / b; };
  while (band > floor_rows && p.rows > floor_rows && n_chunks * bands_of(band) < 4 * threads)
    band = std::max(floor_rows, (band / 2 + step - 1) / step * step);
  const int64_t bands = bands_of(band), unit_rows = band;
  auto unit = [&](int64_t r0, int64_t begin, int64_t end) {  // rows [r0, r0 + unit_rows) in bands
    bands_by_blocks(p, r0, std::min(p.rows, r0 + unit_rows), band, begin, end);
  };
  if (threads == 1 || n_chunks * bands <= threads) {  // too few to share out unevenly: one range each
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
      if (p.amx) amx_begin(p.group);  // the tile configuration is each thread's own
      for (int64_t r0 = 0; r0 < p.rows; r0 += unit_rows) unit(r0, begin, end);
      if (p.amx) amx_end();
    });
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    if (p.amx) amx_begin(p.group);
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks * bands;) {
      const int64_t c = u % n_chunks;
      unit(u / n_chunks * unit_rows, c * size, std::min(blocks, (c + 1) * size));
    }
    if (p.amx) amx_end();
  });
}

// Checks a call's tensors and returns its Problem, y and the activations' int8 or int16 copy not yet set.
Problem problem_of(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.is_cpu() && q.is_cpu() && scales.is_cpu(), "int8_linear runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: contiguous float32 [rows, in]");
  // lanes: q int8 [out / 16, groups, 16 * group]; lanes8: the same shape in uint8; scales [out / 16, groups, 16]
  const bool packed = q.dim() == 3, quads = packed && q.scalar_type() == at::kByte;
  TORCH_CHECK((q.scalar_type() == at::kChar || quads) && q.is_contiguous(),
              "q: contiguous int8 (uint8 in the lanes8 layout)");
  TORCH_CHECK(scales.scalar_type() == (packed ? at::kHalf : at::kFloat) && scales.is_contiguous(),
              "scales: contiguous, float16 in the lanes layouts, else float32");
  int64_t rows = x.size(0), in = x.size(1), out, groups;
  if (packed) {
    TORCH_CHECK(quads ? kHasLanes8 : kHasLanes, "q is in the ", quads ? "lanes8" : "lanes",
                " layout, which this build (", quads ? "no AVX-512 VNNI" : "no AVX2 or AVX-512BW", ") does not have");
    const int64_t multiple = quads ? 16 : 8;
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == q.size(0) && scales.size(1) == q.size(1) &&
                    scales.size(2) == kLaneOuts && q.size(2) % (multiple * kLaneOuts) == 0,
                "lanes layouts: q [tiles, groups, 16 * group] with a group of a multiple of ", multiple,
                ", scales [tiles, groups, 16]");
    out = q.size(0) * kLaneOuts, groups = q.size(1);
    TORCH_CHECK(q.size(1) * q.size(2) / kLaneOuts == in, "q has ", q.size(1) * q.size(2) / kLaneOuts,
                " inputs, x has ", in);
  } else {
    TORCH_CHECK(q.dim() == 2 && scales.dim() == 2, "q [out, in] and scales [out, groups]");
    out = q.size(0), groups = scales.size(1);
    TORCH_CHECK(q.size(1) == in, "q has ", q.size(1), " inputs, x has ", in);
    TORCH_CHECK(scales.size(0) == out && groups > 0 && in % groups == 0, "scales shape does not fit q");
  }
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == out,
                "bias: contiguous float32 [out] on CPU");
    bias_ptr = bias->data_ptr<float>();
  }
  Problem p{x.data_ptr<float>(), nullptr, nullptr, quads ? nullptr : q.data_ptr<int8_t>(),
            packed ? nullptr : scales.data_ptr<float>(),
            packed ? reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()) : nullptr,
            quads ? q.data_ptr<uint8_t>() : nullptr, nullptr, nullptr, nullptr, bias_ptr,
            nullptr, rows, in, out, in / groups};
  p.lanes = packed && !quads;
  p.amx = quads && rows > kAmxAbove && amx_on(p.group);
  if (packed) p.block = kLaneOuts * (p.amx ? 4 : quads && rows >= kGemmMin ? kGemmTiles : 1);
  return p;
}

// Whether the call's path reads x rounded to int16 a row (the lanes layout, the int16 path) into p.xq and p.xs; lanes8
// (p.q8) reads it rounded to int8 per group into p.x8, p.x8s and p.x8c; the float paths read x itself.
bool int16_input(const Problem& p) { return !p.q8 && (p.lanes || int16_rows(p.group)); }

// Rows [r0, r1) of x rounded into the buffers p's path reads (set by the caller, which owns them).
void round_rows(const Problem& p, int64_t r0, int64_t r1) {
  if (p.q8)
    quantize_groups(p, const_cast<int8_t*>(p.x8), const_cast<float*>(p.x8s), const_cast<int32_t*>(p.x8c), r0, r1);
  else if (int16_input(p))
    quantize_rows(p, const_cast<int16_t*>(p.xq), const_cast<float*>(p.xs), r0, r1);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  Problem p = problem_of(x, q, scales, bias);
  const int64_t rows = p.rows, in = p.in, groups = p.groups();
  at::Tensor y = at::empty({rows, p.out}, x.options());
  p.y = y.data_ptr<float>();
  at::Tensor xq, xs, xc;
  if (p.q8) {
    xq = at::empty({rows, in}, x.options().dtype(at::kChar));
    xs = at::empty({rows, groups}, x.options());
    xc = at::empty({rows, groups}, x.options().dtype(at::kInt));
    p.x8 = xq.data_ptr<int8_t>(), p.x8s = xs.data_ptr<float>(), p.x8c = xc.data_ptr<int32_t>();
  } else if (int16_input(p)) {
    xq = at::empty({rows, in}, x.options().dtype(at::kShort));
    xs = at::empty({rows}, x.options());
    p.xq = xq.data_ptr<int16_t>(), p.xs = xs.data_ptr<float>();
  }
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) { round_rows(p, begin, end); });
  run(p);
  return y;
}

}  // namespace
}  // namespace mvllm::int8

// What follows this header (the C++ layer loop includes it) gets the compiler's default contraction back.
#if defined(__clang__)
#pragma clang fp contract(on)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
