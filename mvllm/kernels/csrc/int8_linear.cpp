// Weight-only int8 linear with per-group scales, for CPU decode (a few activation rows).
// y[r, o] = sum_g scales[o, g] * sum_{i in group g} x[r, i] * q[o, i]  (+ bias[o])
// Every weight byte is read from memory once per call: each block of output rows is streamed once
// while all activation rows (small, cache resident) are applied to it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace {

constexpr int64_t kOutBlock = 4;     // output rows per block: each x load is reused this many times
constexpr int64_t kRowTile = 8;      // activation rows per pass over a block
constexpr int64_t kGrainOuts = 32;   // output rows per thread at least

struct Problem {
  const float* x;
  const int8_t* q;
  const float* scales;
  const float* bias;
  float* y;
  int64_t rows, in, out, group;
  int64_t groups() const { return in / group; }
};

float finish(const Problem& p, int64_t o, float sum) { return p.bias ? sum + p.bias[o] : sum; }

#if defined(__AVX512F__)
// Rows [r0, r0 + R) x outputs [o0, o0 + B); the group is a multiple of 16. Each 16-weight vector is
// de-quantized once (int8 -> float, times its group's scale) and applied to all R rows. One flat loop
// over the inputs keeps the R x B accumulators in registers (a loop nest over groups made GCC keep them
// on the stack). Software prefetch of the next block's weights and scales doubled the bandwidth on
// Zen 5: the hardware prefetchers do not ramp up on B short interleaved streams.
template <int R, int B>
void block_avx512(const Problem& p, int64_t r0, int64_t o0) {
  const int64_t ng = p.groups();
  const float* x = p.x + r0 * p.in;
  const int8_t* q = p.q + o0 * p.in;
  const float* scales = p.scales + o0 * ng;
  const int64_t ahead = kOutBlock * p.in, ahead_scales = kOutBlock * ng;  // the same place in the next block
  __m512 total[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) total[r][b] = _mm512_setzero_ps();
  for (int64_t i = 0, g = 0, left = p.group; i < p.in; i += 16) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * p.in + i);
    for (int b = 0; b < B; ++b) {
      const int8_t* row = q + b * p.in;
      if ((i & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + ahead + i), _MM_HINT_T0);
      if (left == p.group && (g & 15) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(scales + ahead_scales + b * ng + g), _MM_HINT_T0);
      __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
      __m512 s = _mm512_set1_ps(scales[b * ng + g]);
      __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), s);
      for (int r = 0; r < R; ++r) total[r][b] = _mm512_fmadd_ps(xv[r], w, total[r][b]);
    }
    if ((left -= 16) == 0) {
      left = p.group;
      ++g;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b)
      p.y[(r0 + r) * p.out + o0 + b] = finish(p, o0 + b, _mm512_reduce_add_ps(total[r][b]));
}
#endif

// Portable path, in GCC/Clang vector extensions (AVX2 or SSE on x86, NEON on aarch64): rows [r0, r0 + R) x
// outputs [o0, o0 + B). Each 16 weights are converted and scaled once (w = q * s, as the AVX-512 path does)
// and applied to all R rows; R x B x 2 accumulators of 8 lanes (8 at the sizes dispatched) hide the FMA's
// latency. A group's inputs past its last multiple of 16 are summed one by one.
using f32x8 = float __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
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

template <int R, int B>
void block_portable(const Problem& p, int64_t r0, int64_t o0) {
  const int64_t ng = p.groups();
  const float* x = p.x + r0 * p.in;
  f32x8 total[R][B][2] = {};
  float tail[R][B] = {};
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t start = g * p.group, end = start + p.group, full = start + p.group / 16 * 16;
    for (int64_t i = start; i < full; i += 16) {
      f32x8 w[B][2];
      for (int b = 0; b < B; ++b) {
        const float s = p.scales[(o0 + b) * ng + g];
        const int8_t* q = p.q + (o0 + b) * p.in + i;
        w[b][0] = weights8(q, s);
        w[b][1] = weights8(q + 8, s);
      }
      for (int r = 0; r < R; ++r) {
        const f32x8 lo = load8(x + r * p.in + i), hi = load8(x + r * p.in + i + 8);
        for (int b = 0; b < B; ++b) {
          total[r][b][0] += lo * w[b][0];
          total[r][b][1] += hi * w[b][1];
        }
      }
    }
    for (int64_t i = full; i < end; ++i)
      for (int b = 0; b < B; ++b) {
        const float w = static_cast<float>(p.q[(o0 + b) * p.in + i]) * p.scales[(o0 + b) * ng + g];
        for (int r = 0; r < R; ++r) tail[r][b] += x[r * p.in + i] * w;
      }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      const f32x8 v = total[r][b][0] + total[r][b][1];
      float sum = tail[r][b];
      for (int l = 0; l < 8; ++l) sum += v[l];
      p.y[(r0 + r) * p.out + o0 + b] = finish(p, o0 + b, sum);
    }
}

// Rows [r0, r0 + rows) x outputs [o0, o0 + outs), outs <= kOutBlock, in tiles of 8 accumulators.
void block_tiles(const Problem& p, int64_t r0, int64_t rows, int64_t o0, int64_t outs) {
  for (int64_t r = r0; r < r0 + rows;) {
    const int64_t left = r0 + rows - r;
    if (left >= 4) {
      for (int64_t o = o0; o < o0 + outs; ++o) block_portable<4, 1>(p, r, o);
      r += 4;
    } else if (left >= 2) {
      int64_t o = o0;
      for (; o + 2 <= o0 + outs; o += 2) block_portable<2, 2>(p, r, o);
      if (o < o0 + outs) block_portable<2, 1>(p, r, o);
      r += 2;
    } else {
      int64_t o = o0;
      if (outs == 4) {
        block_portable<1, 4>(p, r, o);
      } else {
        for (; o < o0 + outs; ++o) block_portable<1, 1>(p, r, o);
      }
      r += 1;
    }
  }
}

#if defined(__AVX512F__)
// block_avx512<R, B> for the runtime row count; R up to kMaxRows(B) keeps all accumulators in registers.
constexpr int kMaxRows(int B) { return B >= 4 ? 4 : 8; }

template <int B, int R = 1>
void block_rows(const Problem& p, int64_t r0, int64_t rows, int64_t o0) {
  if constexpr (R <= kMaxRows(B)) {
    if (rows == R) return block_avx512<R, B>(p, r0, o0);
    block_rows<B, R + 1>(p, r0, rows, o0);
  }
}

void block(const Problem& p, int64_t r0, int64_t rows, int64_t o0, int64_t outs) {
  if (p.group % 16) return block_tiles(p, r0, rows, o0, outs);
  if (outs == kOutBlock && rows <= kMaxRows(4)) return block_rows<4>(p, r0, rows, o0);
  for (int64_t o = o0; o + 2 <= o0 + outs; o += 2) block_rows<2>(p, r0, rows, o);
  if (outs % 2) block_rows<1>(p, r0, rows, o0 + outs - 1);
}
#else
void block(const Problem& p, int64_t r0, int64_t rows, int64_t o0, int64_t outs) {
  block_tiles(p, r0, rows, o0, outs);
}
#endif

// Each thread takes a range of output blocks. A decode step (rows <= kRowTile) streams each block once for
// all rows. With more rows (prefill) the thread applies one tile of kRowTile rows to its whole range before
// the next tile, so its slice of the weights is read from memory once and then from its cache, and the
// activations are read once per tile. Every row gets the same arithmetic whatever the row count: the
// accumulation order of y[r, o] depends only on the input size, so a request's result does not depend on
// what shares its batch (batch-invariant).
void run(const Problem& p) {
  const int64_t blocks = (p.out + kOutBlock - 1) / kOutBlock;
  at::parallel_for(0, blocks, kGrainOuts / kOutBlock, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < p.rows; r0 += kRowTile)
      for (int64_t b = begin; b < end; ++b) {
        const int64_t o0 = b * kOutBlock, outs = std::min(kOutBlock, p.out - o0);
        block(p, r0, std::min(kRowTile, p.rows - r0), o0, outs);
      }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.is_cpu() && q.is_cpu() && scales.is_cpu(), "int8_linear runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: contiguous float32 [rows, in]");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "q: contiguous int8 [out, in]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales: contiguous float32 [out, groups]");
  const int64_t rows = x.size(0), in = x.size(1), out = q.size(0), groups = scales.size(1);
  TORCH_CHECK(q.size(1) == in, "q has ", q.size(1), " inputs, x has ", in);
  TORCH_CHECK(scales.size(0) == out && groups > 0 && in % groups == 0, "scales shape does not fit q");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == out,
                "bias: contiguous float32 [out] on CPU");
    bias_ptr = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({rows, out}, x.options());
  run({x.data_ptr<float>(), q.data_ptr<int8_t>(), scales.data_ptr<float>(), bias_ptr, y.data_ptr<float>(),
       rows, in, out, in / groups});
  return y;
}

}  // namespace

TORCH_LIBRARY(mvllm_int8, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scales, Tensor? bias=None) -> Tensor", &int8_linear);
}
