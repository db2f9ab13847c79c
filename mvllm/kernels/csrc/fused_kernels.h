#pragma once

// Fused float32 CPU kernels for the decoder's non-matmul work (see mvllm/kernels/cpu_fused.py):
//   add_rms_norm     residual add + RMSNorm
//   rope_store       RoPE on q and k of the fused QKV output, k and v written into the paged KV cache
//   paged_attention  softmax attention read straight from the paged cache (flash-decoding: key chunks
//                    in parallel, then a log-sum-exp merge); query rows in vector lanes (keys broadcast, no
//                    horizontal sums) for a prefill's rows but its newest, or for every row where lanes are 8 wide
//   silu_mul         silu(gate) * up
//   argmax           each row's first index of its largest value (a NaN counts as largest), as torch.argmax
// Threading goes through at::parallel_for, so torch.set_num_threads applies.

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
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "exp16.h"

namespace mvllm::fused {
namespace {

constexpr int64_t kGrain = 16384;  // elementwise ops: floats per thread at least
constexpr int64_t kTile = 64;      // attention: keys scored at once
constexpr int64_t kMinChunk = 32;  // attention: keys per work item at least

// ---- vector helpers: AVX-512 where compiled for it, else plain loops ----

#if defined(__AVX512F__)
__mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
#endif

#if !defined(__AVX512F__)
// Without AVX-512: 8-lane vectors in GCC/Clang vector extensions (AVX2 on x86, two NEON registers on aarch64).
using f32x8 = float __attribute__((vector_size(32)));
using i32x8 = int32_t __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }

inline f32x8 exp8(f32x8 x);
#endif

// exp(x) for x <= 0 (a score minus the running max), clamped at -87, in a GCC/Clang vector of any width (F floats,
// I the int32 vector of as many lanes): exp16's polynomial (exp16.h), 2^n from the exponent bits. Round to nearest by adding
// and subtracting 1.5 * 2^23.
template <class F, class I>
inline F exp_lanes(F x) {
  x = x < -87.f ? F{} - 87.f : x;
  const F n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  F r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F q = F{} + 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  q = q * r * r + (r + 1.f);
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  F two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return q * two_n;
}

#if !defined(__AVX512F__)
inline f32x8 exp8(f32x8 x) { return exp_lanes<f32x8, i32x8>(x); }
#endif

float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float lanes[16] = {};  // 16 independent sums: vectorised without -ffast-math
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += a[i + l] * b[i + l];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int l = 0; l < 16; ++l) s += lanes[l];
  return s;
#endif
}

// y += a * x
void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void scale_by(float* __restrict y, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// x[i] = exp(x[i] - m); returns the sum.
float exp_sum(float* __restrict x, float m, int64_t n) {
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv));
    _mm512_mask_storeu_ps(x + i, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#else
  f32x8 sum = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const f32x8 e = exp8(load8(x + i) - m);
    store8(x + i, e);
    sum += e;
  }
  float s = 0.f;
  for (int l = 0; l < 8; ++l) s += sum[l];
  for (; i < n; ++i) s += (x[i] = std::exp(x[i] - m));
  return s;
#endif
}

void silu_mul_row(const float* __restrict gate, const float* __restrict up, float* __restrict out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    // 1 / e: the 14-bit estimate and one Newton step (about 1 ulp; vdivps took most of the op's time)
    const __m512 r0 = _mm512_rcp14_ps(e);
    const __m512 r = _mm512_mul_ps(r0, _mm512_fnmadd_ps(e, r0, _mm512_set1_ps(2.f)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, _mm512_loadu_ps(up + i)), r));
  }
#else
  for (; i + 8 <= n; i += 8) {  // 8 lanes (AVX2, NEON): exp_lanes, clamped above at 88 (exp(88) is finite)
    const f32x8 g = load8(gate + i), x = f32x8{} - g;
    const f32x8 e = exp_lanes<f32x8, i32x8>(x > 88.f ? f32x8{} + 88.f : x);
    store8(out + i, g * load8(up + i) / (e + 1.f));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), name,
              ": expected a contiguous float32 CPU tensor, got ", t.scalar_type(), " ", t.sizes());
}

void check_long(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == numel, name,
              ": expected a contiguous int64 tensor of ", numel, " elements, got ", t.scalar_type(), " ",
              t.sizes());
}

// ---- add_rms_norm ----

// One row of add_rms_norm: res (if not null) += x; out = w * r / sqrt(mean(r^2) + eps), r = res or x.
void norm_row(const float* x, float* res, const float* w, float* out, int64_t n, float eps) {
  const float* r = x;
  if (res) {
    for (int64_t i = 0; i < n; ++i) res[i] += x[i];
    r = res;
  }
  const float inv = 1.f / std::sqrt(dot(r, r, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (r[i] * inv);
}

// residual (if given) += x; returns weight * r / sqrt(mean(r^2) + eps), r = residual or x.
at::Tensor add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                        double eps) {
  check_float(x, "x");
  check_float(weight, "weight");
  TORCH_CHECK(x.dim() == 2, "x: expected [T, hidden], got ", x.sizes());
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n, "weight has ", weight.numel(), " elements, hidden is ", n);
  float* res = nullptr;
  if (residual.has_value()) {
    check_float(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual ", residual->sizes(), " vs x ", x.sizes());
    res = residual->data_ptr<float>();
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      norm_row(xp + row * n, res ? res + row * n : nullptr, w, op + row * n, n, e);
  });
  return out;
}

// ---- rope_store ----

// out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2])
void rotate(const float* __restrict x, const float* __restrict c, const float* __restrict s, float* __restrict out,
            int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) out[i] = x[i] * c[i] - x[i + h] * s[i];
  for (int64_t i = 0; i < h; ++i) out[i + h] = x[i + h] * c[i + h] + x[i] * s[i + h];
}

struct Rope {
  const float *qkv, *cos, *sin;  // qkv [T, (heads + 2 * kv) * D]; cos, sin [T, D]
  float *q, *k, *v;              // q [T, heads, D]; the cache's K and V halves [slots, kv, D]
  const int64_t* slots;
  int64_t heads, kv, d;
};

// Head h of token t: a query head (h < heads) rotated into q, or kv head h - heads rotated into K and copied into V
// at the token's slot.
void rope_head(const Rope& r, int64_t t, int64_t h) {
  const int64_t d = r.d;
  const float *row = r.qkv + t * (r.heads + 2 * r.kv) * d, *c = r.cos + t * d, *s = r.sin + t * d;
  if (h < r.heads) {
    rotate(row + h * d, c, s, r.q + (t * r.heads + h) * d, d);
  } else {
    const int64_t kh = h - r.heads, dst = (r.slots[t] * r.kv + kh) * d;
    rotate(row + (r.heads + kh) * d, c, s, r.k + dst, d);
    std::memcpy(r.v + dst, row + (r.heads + r.kv + kh) * d, d * sizeof(float));
  }
}

// Checks RoPE's inputs for t_count tokens of head size d: cos and sin [T, D], a cache [2, slots, kv_heads, D] and
// each token's slot in it.
void check_rope(int64_t t_count, int64_t d, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cache,
                const at::Tensor& slots, int64_t kv_heads) {
  check_float(cos, "cos");
  check_float(sin, "sin");
  check_float(cache, "cache");
  TORCH_CHECK(cos.numel() == t_count * d && sin.numel() == t_count * d, "cos/sin: expected [T, D] = [", t_count, ", ",
              d, "], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.size(2) == kv_heads && cache.size(3) == d,
              "cache: expected [2, slots, ", kv_heads, ", ", d, "], got ", cache.sizes());
  check_long(slots, "slots", t_count);
  const int64_t num_slots = cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_count; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range [0, ", num_slots, ")");
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cache,
                      const at::Tensor& slots, int64_t heads, int64_t kv_heads) {
  check_float(qkv, "qkv");
  TORCH_CHECK(heads > 0 && kv_heads > 0, "heads and kv_heads must be positive");
  const int64_t per_token = heads + 2 * kv_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) % per_token == 0, "qkv: expected [T, (heads + 2 * kv_heads) * D], got ",
              qkv.sizes());
  const int64_t t_count = qkv.size(0), d = qkv.size(1) / per_token;
  TORCH_CHECK(d % 2 == 0, "head_dim must be even, got ", d);
  check_rope(t_count, d, cos, sin, cache, slots, kv_heads);
  const int64_t num_slots = cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::Tensor q = at::empty({t_count, heads, d}, qkv.options());
  const float *x = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kc = cache.data_ptr<float>(), *vc = kc + num_slots * kv_heads * d;
  const int64_t work = heads + kv_heads;  // per token: q heads, then (k, v) pairs
  const Rope r{x, cp, sn, qp, kc, vc, sp, heads, kv_heads, d};
  at::parallel_for(0, t_count * work, std::max<int64_t>(1, kGrain / (2 * d)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) rope_head(r, i / work, i % work);
  });
  return q;
}

// ---- paged_attention ----

struct Attn {
  const float *q, *k;  // q [T, heads, D]; k: the cache's K half [slots, kv, D]
  int64_t voff;        // V half minus K half, in floats
  float* out;          // [T, heads * D]
  const int64_t *table, *seq, *len;
  int64_t width, heads, kv, g, d, bs, nv;  // nv: D / 16 for the AVX-512 kernels, 0 for the plain loops
  float scale;
};

// The rows one (merged) result covers: the g query heads of kv head kh for token t, or, on the lanes path,
// `rows` rows from r0 of a sequence's rows (token toks[r / g], head r % g), all of kv head kh.
struct Pair {
  int64_t t, kh, r0, rows;
  const int64_t* toks;  // lanes only (else null)
};

struct Item {
  int64_t pair, begin, end;  // keys [begin, end) of one pair's rows
};

// Key rows of keys [p0, p0 + n) of one kv head (k: its first key's K) through the block table.
void key_rows(const Attn& a, const int64_t* table, const float* k, int64_t p0, int64_t n, const float** rows) {
  const int64_t stride = a.kv * a.d;
  for (int64_t i = 0, block = p0 / a.bs, off = p0 % a.bs; i < n; ++i) {  // no division per key
    rows[i] = k + (table[block] * a.bs + off) * stride;
    if (++off == a.bs) off = 0, ++block;
  }
}

// Output row j of a pair.
float* out_row(const Attn& a, const Pair& p, int64_t j) {
  if (!p.toks) return a.out + (p.t * a.heads + p.kh * a.g + j) * a.d;
  const int64_t r = p.r0 + j;
  return a.out + (p.toks[r / a.g] * a.heads + p.kh * a.g + r % a.g) * a.d;
}

// scores s[j * kTile + i] = q_j . key_i for the g (scaled) query rows q [g, D] and keys rows[0, n), and
// acc[j] += sum_i p[j * kTile + i] * value_i (value_i = rows[i] + voff), acc [g, D].
#if defined(__AVX512F__)
// Lane i of the result = the sum of the lanes of a[i].
__m512 hsum16(const __m512* a) {
  __m512 b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

// rows holds a multiple of 16 valid pointers (n rounded up).
template <int NV>
void scores_avx512(const float* q, int64_t g, const float* const* rows, int64_t n, float* s) {
  for (int64_t j = 0; j < g; ++j) {
    __m512 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(q + j * NV * 16 + v * 16);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        const float* r = rows[i0 + i];
        acc[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(r));
        for (int v = 1; v < NV; ++v) acc[i] = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(r + v * 16), acc[i]);
      }
      _mm512_storeu_ps(s + j * kTile + i0, hsum16(acc));
    }
  }
}

// Query heads per pass of values: their accumulators, one broadcast each and a value vector fit in 32 registers.
constexpr int kMaxGroup(int nv) { return nv >= 8 ? 3 : nv >= 4 ? 6 : 8; }

template <int NV, int G>
void values_group(float* acc, const float* p, const float* const* rows, int64_t voff, int64_t n) {
  __m512 a[G][NV];
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < NV; ++v) a[j][v] = _mm512_loadu_ps(acc + j * NV * 16 + v * 16);
  for (int64_t i = 0; i < n; ++i) {
    const float* r = rows[i] + voff;
    __m512 w[G];
    for (int j = 0; j < G; ++j) w[j] = _mm512_set1_ps(p[j * kTile + i]);
    for (int v = 0; v < NV; ++v) {
      const __m512 x = _mm512_loadu_ps(r + v * 16);
      for (int j = 0; j < G; ++j) a[j][v] = _mm512_fmadd_ps(w[j], x, a[j][v]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + j * NV * 16 + v * 16, a[j][v]);
}

template <int NV, int G = 1>
void values_n(int64_t count, float* acc, const float* p, const float* const* rows, int64_t voff, int64_t n) {
  if constexpr (G <= kMaxGroup(NV)) {
    if (count == G) return values_group<NV, G>(acc, p, rows, voff, n);
    values_n<NV, G + 1>(count, acc, p, rows, voff, n);
  }
}

// The g heads in near-equal groups of at most kMaxGroup (7 heads: 4 + 3, not 6 + 1).
template <int NV>
void values_avx512(float* acc, int64_t g, const float* p, const float* const* rows, int64_t voff, int64_t n) {
  const int64_t groups = (g + kMaxGroup(NV) - 1) / kMaxGroup(NV);
  for (int64_t k = 0, j = 0; k < groups; ++k) {
    const int64_t count = g / groups + (k < g % groups);
    values_n<NV>(count, acc + j * NV * 16, p + j * kTile, rows, voff, n);
    j += count;
  }
}
#endif

void scores(const Attn& a, const float* q, const float* const* rows, int64_t n, float* s) {
#if defined(__AVX512F__)
  switch (a.nv) {
    case 1: return scores_avx512<1>(q, a.g, rows, n, s);
    case 2: return scores_avx512<2>(q, a.g, rows, n, s);
    case 4: return scores_avx512<4>(q, a.g, rows, n, s);
    case 8: return scores_avx512<8>(q, a.g, rows, n, s);
  }
#endif
  for (int64_t j = 0; j < a.g; ++j)
    for (int64_t i = 0; i < n; ++i) s[j * kTile + i] = dot(q + j * a.d, rows[i], a.d);
}

#if !defined(__AVX512F__)
// acc[j] += sum_i p[j, i] * value_i for D = 8 * NV, NV vectors of one head at a time.
template <int NV>
void values_portable(const Attn& a, float* acc, const float* p, const float* const* rows, int64_t n) {
  for (int64_t j = 0; j < a.g; ++j) {
    f32x8 o[NV];
    for (int v = 0; v < NV; ++v) o[v] = load8(acc + j * a.d + 8 * v);
    for (int64_t i = 0; i < n; ++i) {
      const float w = p[j * kTile + i];
      const float* row = rows[i] + a.voff;
      for (int v = 0; v < NV; ++v) o[v] += load8(row + 8 * v) * w;
    }
    for (int v = 0; v < NV; ++v) store8(acc + j * a.d + 8 * v, o[v]);
  }
}
#endif

void values(const Attn& a, float* acc, const float* p, const float* const* rows, int64_t n) {
#if defined(__AVX512F__)
  switch (a.nv) {
    case 1: return values_avx512<1>(acc, a.g, p, rows, a.voff, n);
    case 2: return values_avx512<2>(acc, a.g, p, rows, a.voff, n);
    case 4: return values_avx512<4>(acc, a.g, p, rows, a.voff, n);
    case 8: return values_avx512<8>(acc, a.g, p, rows, a.voff, n);
  }
#else
  switch (a.d) {  // each head's output in registers across the tile's keys
    case 64: return values_portable<8>(a, acc, p, rows, n);
    case 128: return values_portable<16>(a, acc, p, rows, n);
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < a.g; ++j) axpy(acc + j * a.d, p[j * kTile + i], rows[i] + a.voff, a.d);
}

float max_of(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(mv);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// Per-thread scratch: queries, accumulators, (m, l) and scores of the g heads, and the tile's key rows.
struct Scratch {
  std::vector<float> data;
  std::vector<const float*> rows;
  Scratch(int64_t g, int64_t d) : data(g * (2 * d + 2 + kTile)), rows(kTile) {}
};

// One work item of a (token, kv head) pair: its g query heads over keys [begin, end), online softmax over tiles of
// kTile keys. Writes the normalised output rows, or (m, l, acc) for each head into partial [g, D + 2] when
// the token's keys are split over several items.
void attend(const Attn& a, const Pair& p, int64_t begin, int64_t end, Scratch& scratch, float* partial) {
  const int64_t g = a.g, d = a.d;
  float *q = scratch.data.data(), *acc = q + g * d, *m = acc + g * d, *l = m + g, *s = l + g;
  const float* q_in = a.q + (p.t * a.heads + p.kh * g) * d;
  for (int64_t i = 0; i < g * d; ++i) q[i] = q_in[i] * a.scale;
  std::fill(acc, acc + g * d, 0.f);
  std::fill(m, m + g, -std::numeric_limits<float>::infinity());
  std::fill(l, l + g, 0.f);
  const int64_t* table = a.table + a.seq[p.t] * a.width;
  const float* k = a.k + p.kh * d;
  const float** rows = scratch.rows.data();
  for (int64_t p0 = begin; p0 < end; p0 += kTile) {
    const int64_t n = std::min(kTile, end - p0);
    key_rows(a, table, k, p0, n, rows);
    for (int64_t i = n; i < (n + 15) / 16 * 16; ++i) rows[i] = rows[0];  // padding for the 16-key kernels
    scores(a, q, rows, n, s);
    for (int64_t j = 0; j < g; ++j) {
      float* sj = s + j * kTile;
      const float mx = max_of(sj, n);
      if (mx > m[j]) {
        const float f = std::exp(m[j] - mx);
        l[j] *= f;
        scale_by(acc + j * d, f, d);
        m[j] = mx;
      }
      l[j] += exp_sum(sj, m[j], n);
    }
    values(a, acc, s, rows, n);
  }
  for (int64_t j = 0; j < g; ++j) {
    if (partial) {
      float* pj = partial + j * (d + 2);
      pj[0] = m[j];
      pj[1] = l[j];
      std::memcpy(pj + 2, acc + j * d, d * sizeof(float));
    } else {
      float* o = out_row(a, p, j);
      const float inv = 1.f / l[j];
      for (int64_t i = 0; i < d; ++i) o[i] = acc[j * d + i] * inv;
    }
  }
}

// Merges the partials [n, stride] (each [rows, D + 2]) of one pair into its output rows.
void merge(const Attn& a, const Pair& pair, const float* partials, int64_t n, int64_t item) {
  const int64_t d = a.d;
  for (int64_t j = 0; j < pair.rows; ++j) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < n; ++c) mx = std::max(mx, partials[c * item + j * (d + 2)]);
    float total = 0.f;
    for (int64_t c = 0; c < n; ++c) {
      const float* p = partials + c * item + j * (d + 2);
      total += p[1] * std::exp(p[0] - mx);
    }
    float* o = out_row(a, pair, j);
    std::fill(o, o + d, 0.f);
    for (int64_t c = 0; c < n; ++c) {
      const float* p = partials + c * item + j * (d + 2);
      axpy(o, std::exp(p[0] - mx) / total, p + 2, d);
    }
  }
}

// ---- the lanes path: a block of up to 2 * kL query rows in vector lanes ----
// Scores are S^T [key][row]: each key's element broadcast against a vector of the rows' query elements, so a
// score needs no horizontal sum, and every row's softmax and values run vertically. A row's result depends only
// on its own lane (and the key tiles of its item), never on the rows beside it.
#if defined(__AVX512F__)
constexpr int kL = 16, kKB = 8, kDB = 8;  // lanes; keys a score block; output columns a value block
#else
constexpr int kL = 8, kKB = 4, kDB = 4;
#endif
constexpr int kRL = 2 * kL;  // rows of a lanes pair at most
using vf = float __attribute__((vector_size(4 * kL)));
using vi = int32_t __attribute__((vector_size(4 * kL)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// x in every lane: one broadcast. (vf{} + x must add 0.0 first, -0 + 0 being +0, an extra op per use; x - 0 is x
// for every x, so the compiler drops the subtraction.)
inline vf splat(float x) { return x - vf{}; }

// Which rows take the lanes path (MVLLM_ATTN_LANES, read on first use; attention_knob "lanes" in a running
// process): 0 none; 1 a prefill's rows but its newest (the default with AVX-512, where a decode row's 7 query heads
// would fill 7 of 16 lanes, slower than the per-token path); 2 every row (the default where the lanes are 8 wide,
// AVX2 and NEON: faster for decode too, results/profile/dev2core-attention-8wide.txt).
std::atomic<int64_t> g_lanes{-1};
constexpr int64_t kLanesDefault = kL == 8 ? 2 : 1;
int64_t lanes_mode() {
  int64_t v = g_lanes.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("MVLLM_ATTN_LANES");
    v = env && *env ? std::max<int64_t>(0, std::atoll(env)) : kLanesDefault;
    g_lanes.store(v, std::memory_order_relaxed);
  }
  return std::min<int64_t>(v, 2);
}
// The work a thread in items of lanes pairs, and of (token, kv head) pairs (decode's: a split costs a merge, and one
// item a thread was faster than four there; results/profile/README.md).
constexpr int64_t kItemsPerThread = 4, kTokenItemsPerThread = 1;

struct LanesScratch {  // [D][kRL] queries and outputs, [kTile][kRL] scores, m and l, key lengths, key rows
  std::vector<float> qt, acc, st, m, l;
  std::vector<int32_t> len;
  std::vector<const float*> rows, next;
  explicit LanesScratch(int64_t d)
      : qt(d * kRL), acc(d * kRL), st(kTile * kRL), m(kRL), l(kRL), len(kRL), rows(kTile + kKB), next(kTile) {}
};

template <int NR>
void attend_lanes(const Attn& a, const Pair& p, int64_t begin, int64_t end, LanesScratch& sc, float* partial) {
  const int64_t d = a.d, g = a.g;
  float *qt = sc.qt.data(), *acc = sc.acc.data(), *st = sc.st.data();
  for (int64_t j = 0; j < NR * kL; ++j) {
    const bool row = j < p.rows;
    const int64_t r = p.r0 + j, t = row ? p.toks[r / g] : 0;
    const float* q = a.q + (t * a.heads + p.kh * g + r % g) * d;
    for (int64_t i = 0; i < d; ++i) qt[i * kRL + j] = row ? q[i] * a.scale : 0.f;
    sc.len[j] = row ? static_cast<int32_t>(a.len[t]) : 0;  // a lane past the rows: every key masked
  }
  std::fill(acc, acc + d * kRL, 0.f);
  vf m[NR], l[NR];
  vi len[NR];
  for (int v = 0; v < NR; ++v) {
    m[v] = vf{} - std::numeric_limits<float>::infinity();
    l[v] = vf{};
    std::memcpy(&len[v], sc.len.data() + v * kL, sizeof len[v]);
  }
  const int64_t* table = a.table + a.seq[p.toks[p.r0 / g]] * a.width;
  const float* k = a.k + p.kh * d;
  const float **rows = sc.rows.data(), **next = sc.next.data();
  const vf neg_inf = vf{} - std::numeric_limits<float>::infinity();
  key_rows(a, table, k, begin, std::min(kTile, end - begin), next);
  for (int64_t p0 = begin; p0 < end; p0 += kTile) {
    const int64_t n = std::min(kTile, end - p0), padded = (n + kKB - 1) / kKB * kKB;
    const int64_t n_next = std::min(kTile, std::max<int64_t>(end - p0 - kTile, 0));
    std::copy(next, next + n, rows);
    for (int64_t i = n; i < padded; ++i) rows[i] = rows[0];
    key_rows(a, table, k, p0 + kTile, n_next, next);
    for (int64_t i0 = 0; i0 < padded; i0 += kKB) {  // scores: kKB keys x NR vectors of rows
      // the next tile's keys and values into L2 meanwhile, kKB keys a block (the keys come from memory in a step)
      for (int64_t i = i0 * n_next / padded; i < (i0 + kKB) * n_next / padded; ++i)
        for (int64_t c = 0; c < d; c += 16) {
          __builtin_prefetch(next[i] + c, 0, 2);
          __builtin_prefetch(next[i] + a.voff + c, 0, 2);
        }
      vf s[kKB][NR] = {};
      for (int64_t i = 0; i < d; ++i) {
        vf qv[NR];
        for (int v = 0; v < NR; ++v) qv[v] = loadv(qt + i * kRL + v * kL);
        for (int kk = 0; kk < kKB; ++kk) {
          const vf kb = splat(rows[i0 + kk][i]);
          for (int v = 0; v < NR; ++v) s[kk][v] += kb * qv[v];
        }
      }
      for (int kk = 0; kk < kKB && i0 + kk < n; ++kk)
        for (int v = 0; v < NR; ++v) storev(st + (i0 + kk) * kRL + v * kL, s[kk][v]);
    }
    for (int v = 0; v < NR; ++v) {  // online softmax, each lane its own row; keys at or past a row's length masked
      vf mx = neg_inf;
      for (int64_t i = 0; i < n; ++i) {
        const vi valid = static_cast<int32_t>(p0 + i) < len[v];
        const vf x = valid ? loadv(st + i * kRL + v * kL) : neg_inf;
        mx = mx > x ? mx : x;
      }
      const vf mnew = m[v] > mx ? m[v] : mx;
      const vi none = mnew == neg_inf;  // no key yet in this lane: nothing to rescale
      const vf f = none ? vf{} + 1.f : exp_lanes<vf, vi>(m[v] - mnew);
      vf sum = vf{};
      for (int64_t i = 0; i < n; ++i) {
        const vi valid = static_cast<int32_t>(p0 + i) < len[v];
        const vf e = exp_lanes<vf, vi>(loadv(st + i * kRL + v * kL) - mnew);
        const vf pr = valid ? e : vf{};
        storev(st + i * kRL + v * kL, pr);
        sum += pr;
      }
      l[v] = l[v] * f + sum;
      m[v] = mnew;
      for (int64_t i = 0; i < d; ++i) storev(acc + i * kRL + v * kL, loadv(acc + i * kRL + v * kL) * f);
    }
    for (int64_t i0 = 0; i0 < d; i0 += kDB) {  // values: kDB output columns x NR vectors of rows
      vf o[kDB][NR];
      for (int c = 0; c < kDB; ++c)
        for (int v = 0; v < NR; ++v) o[c][v] = loadv(acc + (i0 + c) * kRL + v * kL);
      for (int64_t i = 0; i < n; ++i) {
        vf pv[NR];
        for (int v = 0; v < NR; ++v) pv[v] = loadv(st + i * kRL + v * kL);
        const float* val = rows[i] + a.voff + i0;
        for (int c = 0; c < kDB; ++c) {
          const vf vb = splat(val[c]);
          for (int v = 0; v < NR; ++v) o[c][v] += vb * pv[v];
        }
      }
      for (int c = 0; c < kDB; ++c)
        for (int v = 0; v < NR; ++v) storev(acc + (i0 + c) * kRL + v * kL, o[c][v]);
    }
  }
  float ms[kRL], ls[kRL];
  for (int v = 0; v < NR; ++v) storev(ms + v * kL, m[v]), storev(ls + v * kL, l[v]);
  for (int64_t j = 0; j < p.rows; ++j) {
    if (partial) {
      float* pj = partial + j * (d + 2);
      pj[0] = ms[j];
      pj[1] = ls[j];
      for (int64_t i = 0; i < d; ++i) pj[2 + i] = acc[i * kRL + j];
    } else {
      float* o = out_row(a, p, j);
      const float inv = 1.f / ls[j];
      for (int64_t i = 0; i < d; ++i) o[i] = acc[i * kRL + j] * inv;
    }
  }
}

// Sets the lanes mode in this process (tests, same-process comparisons); its previous value back.
int64_t attention_knob(const std::string& name, int64_t value) {
  TORCH_CHECK(name == "lanes", "attention knobs: lanes, got ", name);
  const int64_t old = lanes_mode();
  g_lanes.store(std::clamp<int64_t>(value, 0, 2));
  return old;
}

// A call's attention metadata, checked (every token's sequence and key count, and the block table's entries those
// reach): the block table as int64 [rows, width], each token's sequence sp and key count lp.
struct AttnMeta {
  at::Tensor table;
  const int64_t *tp, *sp, *lp;
  int64_t rows, width;
};

AttnMeta attn_meta(const at::Tensor& block_table, const at::Tensor& seq_of_token, const at::Tensor& key_len,
                   int64_t t_count, int64_t block_size, int64_t num_slots) {
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  const auto table_type = block_table.scalar_type();
  TORCH_CHECK(block_table.dim() == 2 && (table_type == at::kInt || table_type == at::kLong),
              "block_table: expected int32 or int64 [B, max_blocks], got ", block_table.scalar_type(), " ",
              block_table.sizes());
  check_long(seq_of_token, "seq_of_token", t_count);
  check_long(key_len, "key_len", t_count);
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const AttnMeta m{table, table.data_ptr<int64_t>(), seq_of_token.data_ptr<int64_t>(), key_len.data_ptr<int64_t>(),
                   table.size(0), table.size(1)};
  const int64_t *tp = m.tp, *sp = m.sp, *lp = m.lp, rows = m.rows, width = m.width, blocks = num_slots / block_size;
  std::vector<int64_t> longest(rows, 0);
  for (int64_t t = 0; t < t_count; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < rows, "seq_of_token[", t, "] = ", sp[t], " out of range [0, ", rows, ")");
    TORCH_CHECK(lp[t] >= 1 && lp[t] <= width * block_size, "key_len[", t, "] = ", lp[t], " out of range [1, ",
                width * block_size, "]");
    longest[sp[t]] = std::max(longest[sp[t]], lp[t]);
  }
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t i = 0; i < (longest[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tp[b * width + i] >= 0 && tp[b * width + i] < blocks, "block_table[", b, ", ", i, "] = ",
                  tp[b * width + i], " out of range [0, ", blocks, ")");
  return m;
}

// The attention of a layer: q [T, heads, D] against a cache of num_slots slots (its K half at k), into out.
Attn attn_of(const float* q, const float* k, int64_t num_slots, float* out, const AttnMeta& m, int64_t heads,
             int64_t kv, int64_t d, int64_t block_size, double scale) {
  const int64_t nv = d % 16 == 0 && (d == 16 || d == 32 || d == 64 || d == 128) ? d / 16 : 0;
  return {q, k, num_slots * kv * d, out, m.tp, m.sp, m.lp, m.width, heads, kv, heads / kv, d, block_size, nv,
          static_cast<float>(scale)};
}

// A call's attention work, the same for every layer of a step: its pairs of rows, their keys cut into items, and
// the order the threads take the items in. Pairs on the lanes path point into `toks` (so a plan is not copied).
struct AttnPlan {
  std::vector<std::vector<int64_t>> toks;  // each sequence's rows on the lanes path
  std::vector<Pair> pairs;
  std::vector<Item> items;
  std::vector<int64_t> first;  // items of pair p: [first[p], first[p + 1])
  std::vector<int64_t> order;  // items, the largest first
  int64_t stride = 0;          // floats a partial (split pairs write one an item)
  bool split = false;
  int64_t workers = 1;  // threads worth starting
  AttnPlan() = default;
  AttnPlan(const AttnPlan&) = delete;
  AttnPlan& operator=(const AttnPlan&) = delete;
};

// Plans the attention of t_count tokens (m: each token's sequence and key count) for `threads` threads.
void plan_attention(AttnPlan& plan, int64_t t_count, const AttnMeta& m, int64_t block_size, int64_t heads, int64_t kv,
                    int64_t d, int64_t threads) {
  const int64_t *sp = m.sp, *lp = m.lp, rows = m.rows, width = m.width, g = heads / kv;
  std::vector<int64_t> longest(rows, 0);
  int64_t total = 0;
  for (int64_t t = 0; t < t_count; ++t) longest[sp[t]] = std::max(longest[sp[t]], lp[t]), total += lp[t];
  // Pairs: a prefill's rows but its newest (fewer keys than another row of its sequence in this call), or every row
  // (lanes mode 2), in lanes blocks of up to kRL rows; every other row (decode, a prefill's newest) as (token, kv
  // head). Which path a row takes depends on its own sequence alone.
  const bool lanes = lanes_mode() > 0 && d % kDB == 0, every_row = lanes && lanes_mode() == 2;
  auto in_lanes = [&](int64_t t) { return lanes && (every_row || lp[t] < longest[sp[t]]); };
  auto& toks = plan.toks;
  auto& pairs = plan.pairs;
  toks.assign(lanes ? rows : 0, {});
  for (int64_t t = 0; t < t_count; ++t)
    if (in_lanes(t)) toks[sp[t]].push_back(t);
  std::vector<int64_t> keys;  // each pair's keys: [0, keys)
  int64_t work = 0;           // rows x keys over every pair
  for (int64_t b = 0; lanes && b < rows; ++b) {
    const int64_t n_rows = static_cast<int64_t>(toks[b].size()) * g;
    if (n_rows == 0) continue;
    const int64_t blocks = (n_rows + kRL - 1) / kRL, per = (n_rows + blocks - 1) / blocks;
    for (int64_t blk = blocks - 1; blk >= 0; --blk) {
      const int64_t r0 = blk * per, cnt = std::min(per, n_rows - r0);
      int64_t most = 0;  // the block's keys: its rows' longest
      for (int64_t j = r0 / g; j <= (r0 + cnt - 1) / g; ++j) most = std::max(most, lp[toks[b][j]]);
      for (int64_t kh = 0; kh < kv; ++kh) pairs.push_back({-1, kh, r0, cnt, toks[b].data()}), keys.push_back(most);
      work += cnt * most * kv;
    }
  }
  for (int64_t t = 0; t < t_count; ++t) {
    if (in_lanes(t)) continue;
    for (int64_t kh = 0; kh < kv; ++kh) pairs.push_back({t, kh, 0, g, nullptr}), keys.push_back(lp[t]);
    work += g * lp[t] * kv;
  }

  // Chunk the keys so that the work comes in about 4 items a thread where it is in lanes pairs, 1 in (token, kv
  // head) pairs (decode: few tokens and kv heads, long contexts; a split costs a merge); prefill has enough pairs
  // and keeps each pair's keys whole, as does one thread.
  const int64_t target = kItemsPerThread * threads, token_target = kTokenItemsPerThread * threads;
  const int64_t per_item = (work + target - 1) / target, per_token_item = (work + token_target - 1) / token_target;
  const int64_t n_pairs = static_cast<int64_t>(pairs.size());
  auto& items = plan.items;
  plan.first.assign(n_pairs + 1, 0);
  int64_t most_rows = g;
  for (int64_t p = 0; p < n_pairs; ++p) {
    const Pair& pr = pairs[p];
    int64_t chunk = width * block_size;
    if (threads > 1 && pr.toks)
      chunk = (std::max((per_item + pr.rows - 1) / pr.rows, kTile) + kTile - 1) / kTile * kTile;
    else if (threads > 1)
      chunk = (std::max((per_token_item + g - 1) / g, kMinChunk) + block_size - 1) / block_size * block_size;
    plan.first[p] = static_cast<int64_t>(items.size());
    for (int64_t b = 0; b < keys[p]; b += chunk) items.push_back({p, b, std::min(keys[p], b + chunk)});
    most_rows = std::max(most_rows, pr.rows);
  }
  plan.first[n_pairs] = static_cast<int64_t>(items.size());
  const int64_t n_items = static_cast<int64_t>(items.size());
  // Split pairs write partials; the item that finishes a pair last merges them.
  plan.split = n_items > n_pairs;
  plan.stride = most_rows * (d + 2);

  // Items differ in size (mixed lengths, causal prefill): each thread takes the next one until none are left,
  // the largest first (a long decode row's item last would be the step's tail). Order changes no bits: an item
  // keeps its partial's slot, and a merge reads the slots in order.
  auto& order = plan.order;
  order.resize(n_items);
  for (int64_t i = 0; i < n_items; ++i) order[i] = i;
  auto size = [&](int64_t i) { return (items[i].end - items[i].begin) * pairs[items[i].pair].rows; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return size(x) > size(y); });
  plan.workers = total * heads < 2048 ? 1 : std::min(threads, n_items);  // tiny problems: one thread
}

// Each pair's items left to finish (set before a layer's items run; the last to finish a split pair merges it).
void reset_left(const AttnPlan& plan, std::atomic<int64_t>* left) {
  for (size_t p = 0; p + 1 < plan.first.size(); ++p)
    left[p].store(plan.first[p + 1] - plan.first[p], std::memory_order_relaxed);
}

// One thread's share of a layer's attention: the plan's items in order, as `next` hands them out, until none are left.
void run_items(const Attn& a, const AttnPlan& plan, float* partials, std::atomic<int64_t>* left,
               std::atomic<int64_t>& next, Scratch& scratch, std::unique_ptr<LanesScratch>& lanes_scratch) {
  const int64_t n_items = static_cast<int64_t>(plan.items.size());
  for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
    const int64_t i = plan.order[k];
    const Item& it = plan.items[i];
    const Pair& pr = plan.pairs[it.pair];
    const int64_t n = plan.first[it.pair + 1] - plan.first[it.pair];
    float* part = n > 1 ? partials + i * plan.stride : nullptr;
    if (pr.toks) {
      if (!lanes_scratch) lanes_scratch = std::make_unique<LanesScratch>(a.d);
      if (pr.rows > kL)
        attend_lanes<2>(a, pr, it.begin, it.end, *lanes_scratch, part);
      else
        attend_lanes<1>(a, pr, it.begin, it.end, *lanes_scratch, part);
    } else {
      attend(a, pr, it.begin, it.end, scratch, part);
    }
    if (n > 1 && left[it.pair].fetch_sub(1, std::memory_order_acq_rel) == 1)
      merge(a, pr, partials + plan.first[it.pair] * plan.stride, n, plan.stride);
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                           const at::Tensor& seq_of_token, const at::Tensor& key_len, int64_t block_size,
                           double scale) {
  check_float(q, "q");
  check_float(cache, "cache");
  TORCH_CHECK(q.dim() == 3, "q: expected [T, heads, D], got ", q.sizes());
  const int64_t t_count = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.size(3) == d,
              "cache: expected [2, slots, kv_heads, ", d, "], got ", cache.sizes());
  const int64_t kv = cache.size(2), num_slots = cache.size(1);
  TORCH_CHECK(kv > 0 && heads % kv == 0, "heads (", heads, ") must be a multiple of kv_heads (", kv, ")");
  const AttnMeta m = attn_meta(block_table, seq_of_token, key_len, t_count, block_size, num_slots);
  at::Tensor out = at::empty({t_count, heads * d}, q.options());
  const Attn a = attn_of(q.data_ptr<float>(), cache.data_ptr<float>(), num_slots, out.data_ptr<float>(), m, heads, kv,
                         d, block_size, scale);
  AttnPlan plan;
  plan_attention(plan, t_count, m, block_size, heads, kv, d, at::get_num_threads());
  const int64_t n_items = static_cast<int64_t>(plan.items.size());
  at::Tensor partials = plan.split ? at::empty({n_items, plan.stride}, q.options()) : at::Tensor();
  float* pp = plan.split ? partials.data_ptr<float>() : nullptr;
  std::vector<std::atomic<int64_t>> left(plan.split ? plan.pairs.size() : 0);
  if (plan.split) reset_left(plan, left.data());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, plan.workers, 1, [&](int64_t, int64_t) {
    Scratch scratch(heads / kv, d);
    std::unique_ptr<LanesScratch> lanes_scratch;
    run_items(a, plan, pp, left.data(), next, scratch, lanes_scratch);
  });
  return out;
}

// ---- silu_mul ----

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up: expected [T, 2 * I], got ", gate_up.sizes());
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* x = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  constexpr int64_t kCols = 1024;  // columns per work item: a single row still splits over threads
  const int64_t pieces = (n + kCols - 1) / kCols;
  at::parallel_for(0, rows * pieces, std::max<int64_t>(1, kGrain / kCols), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / pieces, c = (i % pieces) * kCols, len = std::min(kCols, n - c);
      silu_mul_row(x + r * 2 * n + c, x + r * 2 * n + n + c, o + r * n + c, len);
    }
  });
  return out;
}

// ---- argmax ----

// torch's CPU argmax walks a row one element at a time (slow on a vocabulary-sized row); here one pass in vector
// lanes keeps each lane's largest value and its first index (strictly greater replaces, so ties keep the first),
// then the lanes are merged. A NaN anywhere: the first NaN, as torch.
#if defined(__AVX512F__)
constexpr int kArgLanes = 16;
#else
constexpr int kArgLanes = 8;
#endif
using argf = float __attribute__((vector_size(4 * kArgLanes)));
using argi = int32_t __attribute__((vector_size(4 * kArgLanes)));

int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best_i = 0;
  float best_v = -std::numeric_limits<float>::infinity();
  bool nan = false;
  if (n >= kArgLanes && n < (int64_t{1} << 31)) {
    argf best, v;
    argi idx, at, seen_nan = argi{} + 0;
    std::memcpy(&best, x, sizeof best);
    for (int l = 0; l < kArgLanes; ++l) idx[l] = l;
    at = idx;
    seen_nan |= best != best;
    for (i = kArgLanes; i + kArgLanes <= n; i += kArgLanes) {
      std::memcpy(&v, x + i, sizeof v);
      at += kArgLanes;
      const argi greater = v > best;
      best = greater ? v : best;
      idx = greater ? at : idx;
      seen_nan |= v != v;
    }
    for (int l = 0; l < kArgLanes; ++l) {
      nan |= seen_nan[l] != 0;
      if (best[l] > best_v || (best[l] == best_v && idx[l] < best_i) || l == 0) best_v = best[l], best_i = idx[l];
    }
  } else {
    best_v = x[0], nan = std::isnan(x[0]), i = 1;
  }
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    if (x[i] > best_v) best_v = x[i], best_i = i;
  }
  if (nan)
    for (int64_t k = 0; k < n; ++k)
      if (std::isnan(x[k])) return k;
  return best_i;
}

at::Tensor argmax(const at::Tensor& x) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x: expected [rows, n > 0], got ", x.sizes());
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

}  // namespace
}  // namespace mvllm::fused
