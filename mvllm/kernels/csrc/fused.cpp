// Fused float32 CPU kernels for the decoder's non-matmul work (see mvllm/engine/cpu_fused.py):
//   add_rms_norm     residual add + RMSNorm
//   rope_store       RoPE on q and k of the fused QKV output, k and v written into the paged KV cache
//   paged_attention  softmax attention read straight from the paged cache (flash-decoding: key chunks
//                    in parallel, then a log-sum-exp merge)
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
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGrain = 16384;  // elementwise ops: floats per thread at least
constexpr int64_t kTile = 64;      // attention: keys scored at once
constexpr int64_t kMinChunk = 32;  // attention: keys per work item at least

// ---- vector helpers: AVX-512 where compiled for it, else plain loops ----

#if defined(__AVX512F__)
__mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

// exp(x), x clamped to [-103, 88.3]: Cephes' degree-5 polynomial on [-ln2/2, ln2/2] times 2^n (about 1 ulp).
__m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
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

// exp(x) for x <= 0 (a score minus the running max), clamped at -87: exp16's polynomial, 2^n from the exponent
// bits. Round to nearest by adding and subtracting 1.5 * 2^23.
inline f32x8 exp8(f32x8 x) {
  x = x < -87.f ? f32x8{} - 87.f : x;
  const f32x8 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  f32x8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f32x8 q = f32x8{} + 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  q = q * r * r + (r + 1.f);
  const i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
  f32x8 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return q * two_n;
}
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
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(out + i, _mm512_div_ps(_mm512_mul_ps(g, _mm512_loadu_ps(up + i)), _mm512_add_ps(one, e)));
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
    for (int64_t row = begin; row < end; ++row) {
      const float* r = xp + row * n;
      if (res) {
        float* rr = res + row * n;
        for (int64_t i = 0; i < n; ++i) rr[i] += r[i];
        r = rr;
      }
      const float inv = 1.f / std::sqrt(dot(r, r, n) / static_cast<float>(n) + e);
      float* o = op + row * n;
      for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (r[i] * inv);
    }
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

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cache,
                      const at::Tensor& slots, int64_t heads, int64_t kv_heads) {
  check_float(qkv, "qkv");
  check_float(cos, "cos");
  check_float(sin, "sin");
  check_float(cache, "cache");
  TORCH_CHECK(heads > 0 && kv_heads > 0, "heads and kv_heads must be positive");
  const int64_t per_token = heads + 2 * kv_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) % per_token == 0, "qkv: expected [T, (heads + 2 * kv_heads) * D], got ",
              qkv.sizes());
  const int64_t t_count = qkv.size(0), d = qkv.size(1) / per_token;
  TORCH_CHECK(d % 2 == 0, "head_dim must be even, got ", d);
  TORCH_CHECK(cos.numel() == t_count * d && sin.numel() == t_count * d, "cos/sin: expected [T, D] = [", t_count, ", ",
              d, "], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.size(2) == kv_heads && cache.size(3) == d,
              "cache: expected [2, slots, ", kv_heads, ", ", d, "], got ", cache.sizes());
  check_long(slots, "slots", t_count);
  const int64_t num_slots = cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_count; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range [0, ", num_slots, ")");
  at::Tensor q = at::empty({t_count, heads, d}, qkv.options());
  const float *x = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kc = cache.data_ptr<float>(), *vc = kc + num_slots * kv_heads * d;
  const int64_t work = heads + kv_heads;  // per token: q heads, then (k, v) pairs
  at::parallel_for(0, t_count * work, std::max<int64_t>(1, kGrain / (2 * d)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / work, h = i % work;
      const float *row = x + t * per_token * d, *c = cp + t * d, *s = sn + t * d;
      if (h < heads) {
        rotate(row + h * d, c, s, qp + (t * heads + h) * d, d);
      } else {
        const int64_t kh = h - heads, dst = (sp[t] * kv_heads + kh) * d;
        rotate(row + (heads + kh) * d, c, s, kc + dst, d);
        std::memcpy(vc + dst, row + (heads + kv_heads + kh) * d, d * sizeof(float));
      }
    }
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

struct Item {
  int64_t t, kh, begin, end;  // keys [begin, end) of token t, kv head kh
};

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

// One work item: the g query heads of kv head kh over keys [begin, end), online softmax over tiles of
// kTile keys. Writes the normalised output rows, or (m, l, acc) for each head into partial [g, D + 2] when
// the token's keys are split over several items.
void attend(const Attn& a, const Item& it, Scratch& scratch, float* partial) {
  const int64_t g = a.g, d = a.d, stride = a.kv * a.d;
  float *q = scratch.data.data(), *acc = q + g * d, *m = acc + g * d, *l = m + g, *s = l + g;
  const float* q_in = a.q + (it.t * a.heads + it.kh * g) * d;
  for (int64_t i = 0; i < g * d; ++i) q[i] = q_in[i] * a.scale;
  std::fill(acc, acc + g * d, 0.f);
  std::fill(m, m + g, -std::numeric_limits<float>::infinity());
  std::fill(l, l + g, 0.f);
  const int64_t* table = a.table + a.seq[it.t] * a.width;
  const float* k = a.k + it.kh * d;
  const float** rows = scratch.rows.data();
  for (int64_t p0 = it.begin; p0 < it.end; p0 += kTile) {
    const int64_t n = std::min(kTile, it.end - p0);
    for (int64_t i = 0, block = p0 / a.bs, off = p0 % a.bs; i < n; ++i) {  // no division per key
      rows[i] = k + (table[block] * a.bs + off) * stride;
      if (++off == a.bs) off = 0, ++block;
    }
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
      float* o = a.out + (it.t * a.heads + it.kh * g + j) * d;
      const float inv = 1.f / l[j];
      for (int64_t i = 0; i < d; ++i) o[i] = acc[j * d + i] * inv;
    }
  }
}

// Merges the partials [n, g, D + 2] of one (token, kv head) into the output rows of its g query heads.
void merge(const Attn& a, int64_t t, int64_t kh, const float* partials, int64_t n) {
  const int64_t g = a.g, d = a.d, item = g * (d + 2);
  for (int64_t j = 0; j < g; ++j) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < n; ++c) mx = std::max(mx, partials[c * item + j * (d + 2)]);
    float total = 0.f;
    for (int64_t c = 0; c < n; ++c) {
      const float* p = partials + c * item + j * (d + 2);
      total += p[1] * std::exp(p[0] - mx);
    }
    float* o = a.out + (t * a.heads + kh * g + j) * d;
    std::fill(o, o + d, 0.f);
    for (int64_t c = 0; c < n; ++c) {
      const float* p = partials + c * item + j * (d + 2);
      axpy(o, std::exp(p[0] - mx) / total, p + 2, d);
    }
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
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  const auto table_type = block_table.scalar_type();
  TORCH_CHECK(block_table.dim() == 2 && (table_type == at::kInt || table_type == at::kLong),
              "block_table: expected int32 or int64 [B, max_blocks], got ", block_table.scalar_type(), " ",
              block_table.sizes());
  check_long(seq_of_token, "seq_of_token", t_count);
  check_long(key_len, "key_len", t_count);
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const int64_t rows = table.size(0), width = table.size(1), blocks = num_slots / block_size;
  const int64_t *tp = table.data_ptr<int64_t>(), *sp = seq_of_token.data_ptr<int64_t>(),
                *lp = key_len.data_ptr<int64_t>();

  // Validate once per sequence (its longest key_len), and size the work.
  std::vector<int64_t> longest(rows, 0);
  int64_t total = 0;
  for (int64_t t = 0; t < t_count; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < rows, "seq_of_token[", t, "] = ", sp[t], " out of range [0, ", rows, ")");
    TORCH_CHECK(lp[t] >= 1 && lp[t] <= width * block_size, "key_len[", t, "] = ", lp[t], " out of range [1, ",
                width * block_size, "]");
    longest[sp[t]] = std::max(longest[sp[t]], lp[t]);
    total += lp[t];
  }
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t i = 0; i < (longest[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tp[b * width + i] >= 0 && tp[b * width + i] < blocks, "block_table[", b, ", ", i, "] = ",
                  tp[b * width + i], " out of range [0, ", blocks, ")");

  const int64_t g = heads / kv;
  at::Tensor out = at::empty({t_count, heads * d}, q.options());
  const int64_t nv = d % 16 == 0 && (d == 16 || d == 32 || d == 64 || d == 128) ? d / 16 : 0;
  const Attn a{q.data_ptr<float>(), cache.data_ptr<float>(), num_slots * kv * d, out.data_ptr<float>(), tp, sp, lp,
               width, heads, kv, g, d, block_size, nv, static_cast<float>(scale)};

  // Chunk the keys so that there are about 4 work items per thread (decode: few tokens and kv heads, long
  // contexts); prefill has enough (token, kv head) pairs and keeps each token's keys whole, as does one thread.
  const int64_t threads = at::get_num_threads(), target = 4 * threads;
  int64_t chunk = threads == 1 ? width * block_size : std::max((total * kv + target - 1) / target, kMinChunk);
  chunk = (chunk + block_size - 1) / block_size * block_size;
  std::vector<Item> items;
  std::vector<int64_t> first(t_count * kv + 1);  // items of (token, kv head) p: [first[p], first[p + 1])
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t kh = 0; kh < kv; ++kh) {
      first[t * kv + kh] = static_cast<int64_t>(items.size());
      for (int64_t b = 0; b < lp[t]; b += chunk) items.push_back({t, kh, b, std::min(lp[t], b + chunk)});
    }
  first[t_count * kv] = static_cast<int64_t>(items.size());
  const int64_t n_items = static_cast<int64_t>(items.size());
  // Split pairs write partials; the item that finishes a pair last merges them.
  const bool split = n_items > t_count * kv;
  at::Tensor partials = split ? at::empty({n_items, g, d + 2}, q.options()) : at::Tensor();
  float* pp = split ? partials.data_ptr<float>() : nullptr;
  std::vector<std::atomic<int64_t>> left(split ? t_count * kv : 0);
  for (size_t p = 0; p < left.size(); ++p) left[p].store(first[p + 1] - first[p], std::memory_order_relaxed);

  // Items differ in size (mixed lengths, causal prefill): each thread takes the next one until none are left.
  const int64_t workers = total * heads < 2048 ? 1 : std::min(threads, n_items);  // tiny problems: one thread
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch(g, d);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const Item& it = items[i];
      const int64_t p = it.t * kv + it.kh, n = first[p + 1] - first[p];
      attend(a, it, scratch, n > 1 ? pp + i * g * (d + 2) : nullptr);
      if (n > 1 && left[p].fetch_sub(1, std::memory_order_acq_rel) == 1)
        merge(a, it.t, it.kh, pp + first[p] * g * (d + 2), n);
    }
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

// torch's CPU argmax walks a row one element at a time (about 400 us for a 151,936-entry row on the AVX2
// machine); here one pass in vector lanes keeps each lane's largest value and its first index (strictly greater
// replaces, so ties keep the first), then the lanes are merged. A NaN anywhere: the first NaN, as torch.
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

TORCH_LIBRARY(mvllm_fused, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor", &add_rms_norm);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor slots, int heads, int kv_heads)"
        " -> Tensor", &rope_store);
  m.def("paged_attention(Tensor q, Tensor cache, Tensor block_table, Tensor seq_of_token, Tensor key_len,"
        " int block_size, float scale) -> Tensor", &paged_attention);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("argmax(Tensor x) -> Tensor", &argmax);
}
