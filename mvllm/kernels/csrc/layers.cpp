// The CPU decoder's layer loop for int8w (model/cpu_forward.py's loop, the same ops in the same order), calling the
// fused and int8 kernels directly (fused_kernels.h, int8_kernels.h), so a step pays no Python and no dispatcher
// between them.
//
// Steps of up to kTeamRows tokens (decode, a warm prefill; the weights in any layout the kernel has: lanes8, lanes or
// [out, in], the last the portable path's, an Apple M2's) run their layers in one team of threads (one OpenMP region a
// step) instead of a region an op: the threads split the small work (norms and the activations' rounding, RoPE, SiLU)
// by rows, share each linear and the attention, and meet at spin barriers. With out_rows the last layer computes only
// those rows past its KV write (a warm prefill's last row), in the team too. A linear's output blocks are mostly
// split evenly, the rest claimed in turn (a thread the host slows takes fewer); a thread waiting at a barrier
// prefetches (into its L2) the start of its even share of the next linear, so the memory works through the small
// work and the barriers: faster than a region an op (results/profile/README.md). Every result is bitwise the per-op
// loop's: the same kernels on the same rows, the attention's items planned as its op plans them. MVLLM_TEAM=0 (knob
// "team" 0) keeps a region an op, for tests and same-process comparisons.

#include "barrier.h"
#include "fused_kernels.h"
#include "int8_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <vector>

namespace {

namespace F = mvllm::fused;
namespace I = mvllm::int8;
using Opt = std::optional<at::Tensor>;

constexpr int64_t kTeamRows = 64;  // the most tokens a team step takes (above, a call's own regions cut its rows)
constexpr int64_t kPerLayer = 12;  // the weights of a layer, in this order (kernels/cpu_layers.py packs them)
enum : int64_t { kNorm1, kQkvQ, kQkvS, kQkvB, kOQ, kOS, kOB, kNorm2, kGateUpQ, kGateUpS, kDownQ, kDownS };

std::atomic<int64_t>& team_on() {
  static std::atomic<int64_t> on{I::env_int("MVLLM_TEAM", 1, 0, 1)};
  return on;
}
std::atomic<int64_t> team_calls{0};  // calls the team ran (tests ask which path a step took)
// The percent of a linear's output blocks split evenly among the threads, the rest claimed in turn, and the bytes of
// its next share a thread waiting at a barrier prefetches: neither all claimed nor other shares or distances were
// faster (results/profile/README.md).
constexpr int64_t kEvenPercent = 75;
constexpr int64_t kAheadBytes = 1 << 20;

// Phase times, for experiments (knob "times" 1; off by default, when a phase costs one branch): for each phase of
// a layer, summed over layers and steps, its wall time (thread 0's, from the phase's start to the barrier's
// release), the threads' summed work before the barrier and the slowest thread's work. team_times() returns them
// in milliseconds, [phase, (wall, work, slowest)], and clears them.
enum Phase : int64_t { kNormQkv, kQkv, kRope, kAttention, kRoundO, kO, kNormGateUp, kGateUp, kSilu, kDown, kPhases };
std::atomic<int64_t>& times_on() {
  static std::atomic<int64_t> on{0};
  return on;
}
std::array<std::atomic<int64_t>, 3 * kPhases> phase_ns{};
std::array<std::atomic<int64_t>, kPhases> slowest_now{};  // this phase's slowest work so far (thread 0 clears it)
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
at::Tensor team_times() {
  at::Tensor t = at::empty({kPhases, 3}, at::kDouble);
  for (int64_t i = 0; i < 3 * kPhases; ++i) t.data_ptr<double>()[i] = phase_ns[i].exchange(0) / 1e6;
  return t;
}
// A linear on AMX tiles (p.block 4 tiles) halves its output blocks, down to 1 tile, while it has fewer than this many
// a thread: a 896-output linear has 14 blocks of 64 outputs, 2 of 16 threads idle. Faster in a warm prefill than
// blocks of 64 or 32 outputs (results/profile/README.md).
constexpr int64_t kAmxBlocks = 6;

// A linear of the team: its problem (x, y and the activations' rounding set to the step's buffers), the output
// blocks split evenly among the threads (the first `even` of them) and the rest claimed in turn.
struct TeamLinear {
  I::Problem p;
  int64_t blocks = 0, even = 0, chunk = 1;
  std::atomic<int64_t> next{0};  // the claimed blocks past `even`

  void setup(int64_t threads) {
    if (p.amx)
      while (p.block > I::kLaneOuts && (p.out + p.block - 1) / p.block < kAmxBlocks * threads) p.block /= 2;
    blocks = (p.out + p.block - 1) / p.block;
    even = blocks * kEvenPercent / 100 / threads * threads;  // the rest claimed
    chunk = std::max<int64_t>(1, (blocks - even) / (4 * threads));
    next.store(even, std::memory_order_relaxed);
  }
  void range(int64_t b0, int64_t b1) const { I::bands_by_blocks(p, 0, p.rows, I::row_tile(p), b0, b1); }
  // Thread tid of n: its even share, then claimed chunks until none are left.
  void work(int64_t tid, int64_t n) {
    if (p.amx) I::amx_begin(p.group);  // the tile configuration is each thread's own
    range(even * tid / n, even * (tid + 1) / n);
    for (int64_t b; (b = next.fetch_add(chunk, std::memory_order_relaxed)) < blocks;)
      range(b, std::min(blocks, b + chunk));
    if (p.amx) I::amx_end();
  }
  // The weight bytes of thread tid's even share (in every layout an output block is p.block * in contiguous bytes).
  std::pair<const uint8_t*, const uint8_t*> share(int64_t tid, int64_t n) const {
    const uint8_t* q = p.q8 ? p.q8 : reinterpret_cast<const uint8_t*>(p.q);
    return {q + even * tid / n * p.block * p.in, q + even * (tid + 1) / n * p.block * p.in};
  }
};

// What a waiting thread prefetches: the next lines of its share of the next linear, up to kAheadBytes.
struct Ahead {
  const uint8_t *at = nullptr, *end = nullptr;
  void aim(const TeamLinear& l, int64_t tid, int64_t n) {
    auto [from, to] = l.share(tid, n);
    at = from, end = std::min(to, from + kAheadBytes);
  }
  bool operator()() {
    if (at >= end) return false;
    __builtin_prefetch(at, 0, 2);
    at += 64;
    return true;
  }
};

// The step's buffers between ops, allocated once a call before the team starts.
struct Buffers {
  std::vector<at::Tensor> keep;  // owns those below
  float *h, *qkv, *q, *attn, *o, *gate_up, *act, *x, *res, *partials = nullptr;
  int8_t* x8;  // a linear's input rounded (one set: each linear rounds its input just before it runs): lanes8's int8
  float* xs;   // per group, its scales and offset terms (x8, xs, xc); the lanes layout's int16 a row and a scale a
  int32_t* xc;  // row (xq, xs)
  int16_t* xq;
};

bool team_fits(const std::vector<Opt>& w, int64_t layers, int64_t rows) {
#if defined(_OPENMP)
  if (!team_on().load(std::memory_order_relaxed) || at::get_num_threads() < 2 || at::in_parallel_region())
    return false;
  if (rows < 1 || rows > kTeamRows) return false;
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t k : {kQkvQ, kOQ, kGateUpQ, kDownQ}) {
      const Opt& q = w[l * kPerLayer + k];  // lanes8 (uint8), lanes (int8, 3-D) or [out, in] (int8, 2-D)
      if (!q || (q->dim() == 3 && (q->scalar_type() == at::kByte ? !I::kHasLanes8 : !I::kHasLanes))) return false;
    }
  return true;
#else
  return false;
#endif
}

// Layers [0, layers) in one team: x_in (the embeddings) becomes the residual stream, as in the per-op loop, and the
// last layer's output (its down projection's) is returned, before its residual add, with the residual stream it
// adds to. With out_rows (and those rows' seq_out and len_out), the last layer computes only those rows past its
// KV-cache write, as the per-op loop does: both returned tensors have those rows alone.
std::pair<at::Tensor, at::Tensor> team_layers(const at::Tensor& x_in, const std::vector<Opt>& w,
                                              const at::TensorList caches, int64_t layers, const at::Tensor& cos,
                                              const at::Tensor& sin, const at::Tensor& slots,
                                              const at::Tensor& block_table, const at::Tensor& seq_of_token,
                                              const at::Tensor& key_len, int64_t block_size, double scale,
                                              int64_t heads, int64_t kv_heads, double eps, const Opt& out_rows,
                                              const Opt& seq_out, const Opt& len_out) {
  auto get = [&](int64_t layer, int64_t k) -> const at::Tensor& { return *w[layer * kPerLayer + k]; };
  F::check_float(x_in, "x");
  TORCH_CHECK(x_in.dim() == 2, "x: expected [T, hidden], got ", x_in.sizes());
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads (", heads,
              ") must be a positive multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(caches[0].dim() == 4, "cache: expected [2, slots, kv_heads, D], got ", caches[0].sizes());
  const at::Tensor& down_q = get(0, kDownQ);
  const int64_t rows = x_in.size(0), hidden = x_in.size(1), d = caches[0].size(3), num_slots = caches[0].size(1);
  const int64_t inter = down_q.dim() == 3 ? down_q.size(1) * down_q.size(2) / I::kLaneOuts : down_q.size(1);
  for (int64_t l = 0; l < layers; ++l) {  // as rope_store checks them, every layer's cache
    F::check_rope(rows, d, cos, sin, caches[l], slots, kv_heads);
    TORCH_CHECK(caches[l].size(1) == num_slots, "caches: unequal slot counts");
  }
  const F::AttnMeta meta = F::attn_meta(block_table, seq_of_token, key_len, rows, block_size, num_slots);
  const int64_t* slot = slots.data_ptr<int64_t>();
  // The last layer's rows past its KV write: each row's place among them (-1: not computed).
  const bool trim = out_rows.has_value();
  const int64_t n_out = trim ? out_rows->numel() : rows;
  std::vector<int64_t> place(rows, trim ? -1 : 0);
  if (trim) {
    TORCH_CHECK(out_rows->scalar_type() == at::kLong && out_rows->dim() == 1 && n_out >= 1,
                "out_rows: expected int64 [n], got ", out_rows->scalar_type(), " ", out_rows->sizes());
    const at::Tensor idx = out_rows->contiguous();
    for (int64_t i = 0; i < n_out; ++i) {
      const int64_t t = idx.data_ptr<int64_t>()[i];
      TORCH_CHECK(t >= 0 && t < rows && place[t] < 0, "out_rows[", i, "] = ", t, ": out of range [0, ", rows,
                  ") or repeated");
      place[t] = i;
    }
  }
  const F::AttnMeta meta_out =
      trim ? F::attn_meta(block_table, *seq_out, *len_out, n_out, block_size, num_slots) : meta;

  const auto f32 = x_in.options();
  Buffers s;
  auto buf = [&](int64_t n, at::ScalarType type = at::kFloat) {
    s.keep.push_back(at::empty({std::max<int64_t>(n, 1)}, f32.dtype(type)));
    return s.keep.back().data_ptr();
  };
  const int64_t widest = std::max(hidden, inter), group = I::problem_of(x_in, get(0, kQkvQ), get(0, kQkvS),
                                                                        w[kQkvB]).group;
  s.h = static_cast<float*>(buf(rows * hidden));
  s.qkv = static_cast<float*>(buf(rows * (heads + 2 * kv_heads) * d));
  s.q = static_cast<float*>(buf(rows * heads * d));
  s.attn = static_cast<float*>(buf(rows * heads * d));
  s.o = static_cast<float*>(buf(rows * hidden));
  s.gate_up = static_cast<float*>(buf(rows * 2 * inter));
  s.act = static_cast<float*>(buf(rows * inter));
  at::Tensor x_out = at::empty({rows, hidden}, f32);  // each layer's output (down's)
  s.x = x_out.data_ptr<float>();
  s.res = x_in.data_ptr<float>();  // the residual stream, in place in x as the per-op loop keeps it
  at::Tensor res_out = trim ? at::empty({n_out, hidden}, f32) : x_in;  // the last layer's residual rows
  float* q_out = trim ? static_cast<float*>(buf(n_out * heads * d)) : nullptr;  // and its queries
  s.x8 = static_cast<int8_t*>(buf(rows * widest, at::kChar));
  s.xs = static_cast<float*>(buf(rows * (widest / group + 1)));
  s.xc = static_cast<int32_t*>(buf(rows * (widest / group + 1), at::kInt));
  s.xq = static_cast<int16_t*>(buf(rows * widest, at::kShort));

  // Each linear's problem, checked as its op checks it.
  const int64_t threads = at::get_num_threads();
  const at::Tensor h_in = at::from_blob(s.h, {rows, hidden}, f32);
  const at::Tensor attn_in = at::from_blob(s.attn, {rows, heads * d}, f32);
  const at::Tensor act_in = at::from_blob(s.act, {rows, inter}, f32);
  std::vector<TeamLinear> lin(4 * layers + 3);  // qkv, o, gate_up, down a layer; the trimmed last o, gate_up, down
  auto linear = [&](int64_t i, const at::Tensor& x, float* y, int64_t kq, int64_t ks, const Opt& bias, int64_t out) {
    const int64_t l = std::min(i / 4, layers - 1);
    I::Problem& p = lin[i].p;
    p = I::problem_of(x, get(l, kq), get(l, ks), bias);
    TORCH_CHECK(p.group == group && p.out == out, "layer ", l, ": a linear of ", p.out, " outputs (", out,
                " expected), or of another group");
    p.y = y;
    if (p.q8)
      p.x8 = s.x8, p.x8s = s.xs, p.x8c = s.xc;
    else if (I::int16_input(p))
      p.xq = s.xq, p.xs = s.xs;  // else a float path: it reads x itself
    lin[i].setup(threads);
  };
  std::vector<const float*> norm1(layers), norm2(layers);
  std::vector<float*> kc(layers);
  for (int64_t l = 0; l < layers; ++l) {
    linear(4 * l, h_in, s.qkv, kQkvQ, kQkvS, w[l * kPerLayer + kQkvB], (heads + 2 * kv_heads) * d);
    linear(4 * l + 1, attn_in, s.o, kOQ, kOS, w[l * kPerLayer + kOB], hidden);
    linear(4 * l + 2, h_in, s.gate_up, kGateUpQ, kGateUpS, std::nullopt, 2 * inter);
    linear(4 * l + 3, act_in, s.x, kDownQ, kDownS, std::nullopt, hidden);
    for (int64_t k : {kNorm1, kNorm2}) {
      F::check_float(get(l, k), "norm weight");
      TORCH_CHECK(get(l, k).numel() == hidden, "layer ", l, ": a norm's weight");
    }
    norm1[l] = get(l, kNorm1).data_ptr<float>(), norm2[l] = get(l, kNorm2).data_ptr<float>();
    kc[l] = caches[l].data_ptr<float>();
  }
  if (trim) {  // the last layer's linears past its KV write, on its n_out rows (the buffers' first rows)
    const int64_t l = layers - 1;
    linear(4 * layers, at::from_blob(s.attn, {n_out, heads * d}, f32), s.o, kOQ, kOS, w[l * kPerLayer + kOB], hidden);
    linear(4 * layers + 1, at::from_blob(s.h, {n_out, hidden}, f32), s.gate_up, kGateUpQ, kGateUpS, std::nullopt,
           2 * inter);
    linear(4 * layers + 2, at::from_blob(s.act, {n_out, inter}, f32), s.x, kDownQ, kDownS, std::nullopt, hidden);
  }

  // The attention's plan (the same every layer), its partials, and each layer's counters.
  F::AttnPlan plan;
  F::plan_attention(plan, rows, meta, block_size, heads, kv_heads, d, threads);
  const int64_t n_pairs = static_cast<int64_t>(plan.pairs.size());
  s.partials = plan.split ? static_cast<float*>(buf(static_cast<int64_t>(plan.items.size()) * plan.stride)) : nullptr;
  std::vector<std::atomic<int64_t>> left(layers * n_pairs), next_item(layers);
  for (int64_t l = 0; l < layers; ++l) {
    if (plan.split) F::reset_left(plan, left.data() + l * n_pairs);
    next_item[l].store(0, std::memory_order_relaxed);
  }
  F::AttnPlan plan_out;  // the trimmed last layer's, planned as its op plans it
  if (trim) F::plan_attention(plan_out, n_out, meta_out, block_size, heads, kv_heads, d, threads);
  float* partials_out = trim && plan_out.split ? static_cast<float*>(buf(
                            static_cast<int64_t>(plan_out.items.size()) * plan_out.stride)) : nullptr;
  std::vector<std::atomic<int64_t>> left_out(trim ? plan_out.pairs.size() : 0);
  std::atomic<int64_t> next_out{0};
  if (trim && plan_out.split) F::reset_left(plan_out, left_out.data());
  const float *cp = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();

  mvllm::Barrier bar;
  const float e = static_cast<float>(eps);
  auto norm_rows = [&](const float* x, float* res, const float* weight, float* out, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      F::norm_row(x + r * hidden, res ? res + r * hidden : nullptr, weight, out + r * hidden, hidden, e);
  };
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
#endif
  {
#if defined(_OPENMP)
    const int64_t tid = omp_get_thread_num(), n = omp_get_num_threads();
#pragma omp single
    bar.n = n;  // the team the runtime gave (single's end is a barrier)
#else
    const int64_t tid = 0, n = 1;
#endif
    F::Scratch scratch(heads / kv_heads, d);
    std::unique_ptr<F::LanesScratch> lanes_scratch;
    Ahead ahead;
    const bool timed = times_on().load(std::memory_order_relaxed) != 0;
    int64_t started = timed ? now_ns() : 0;
    auto done = [&](Phase phase, auto&& work) {  // a phase's work, then the barrier (the waiting threads prefetch)
      work();
      if (!timed) return bar.wait(ahead);
      const int64_t worked = now_ns() - started;
      phase_ns[3 * phase + 1].fetch_add(worked, std::memory_order_relaxed);
      std::atomic<int64_t>& slowest = slowest_now[phase];
      for (int64_t most = slowest.load(); worked > most && !slowest.compare_exchange_weak(most, worked);) {
      }
      bar.wait(ahead);
      const int64_t released = now_ns();
      if (tid == 0) {
        phase_ns[3 * phase].fetch_add(released - started, std::memory_order_relaxed);
        phase_ns[3 * phase + 2].fetch_add(slowest_now[phase].exchange(0), std::memory_order_relaxed);
      }
      started = released;
    };
    auto by_rows = [&](Phase phase, auto&& job, int64_t count = -1) {  // the small work, split by rows
      if (count < 0) count = rows;
      const int64_t r0 = count * tid / n, r1 = count * (tid + 1) / n;
      done(phase, [&] {
        if (r0 < r1) job(r0, r1);
      });
    };
    auto share = [&](Phase phase, TeamLinear& now, TeamLinear* following) {  // a linear, all threads
      done(phase, [&] {
        now.work(tid, n);
        if (following)
          ahead.aim(*following, tid, n);
        else
          ahead = {};
      });
    };
    ahead.aim(lin[0], tid, n);
    for (int64_t l = 0; l < layers; ++l) {
      const bool last_trim = trim && l == layers - 1;  // its rows past the KV write: out_rows alone
      const int64_t k = last_trim ? 4 * layers - 1 : 4 * l;  // o, gate_up, down at k + 1, k + 2, k + 3
      TeamLinear &qkv = lin[4 * l], &o = lin[k + 1], &gate_up = lin[k + 2], &down = lin[k + 3];
      TeamLinear* after = l + 1 < layers ? &lin[4 * l + 4] : nullptr;
      const int64_t m = last_trim ? n_out : rows;
      by_rows(kNormQkv, [&](int64_t r0, int64_t r1) {  // input norm (the residual stream takes the last layer's output)
        norm_rows(l == 0 ? s.res : s.x, l == 0 ? nullptr : s.res, norm1[l], s.h, r0, r1);
        I::round_rows(qkv.p, r0, r1);
      });
      share(kQkv, qkv, &o);
      by_rows(kRope, [&](int64_t r0, int64_t r1) {  // RoPE on q and k, k and v into the cache
        const F::Rope r{s.qkv, cp, sn, s.q, kc[l], kc[l] + num_slots * kv_heads * d, slot, heads, kv_heads, d};
        for (int64_t t = r0; t < r1; ++t) {
          for (int64_t h = 0; h < heads + kv_heads; ++h) F::rope_head(r, t, h);
          if (last_trim && place[t] >= 0) {  // the row's query and residual to its place among out_rows
            std::copy_n(s.q + t * heads * d, heads * d, q_out + place[t] * heads * d);
            std::copy_n(s.res + t * hidden, hidden, res_out.data_ptr<float>() + place[t] * hidden);
          }
        }
      });
      done(kAttention, [&] {
        if (last_trim) {
          const F::Attn a = F::attn_of(q_out, kc[l], num_slots, s.attn, meta_out, heads, kv_heads, d, block_size,
                                       scale);
          F::run_items(a, plan_out, partials_out, left_out.data(), next_out, scratch, lanes_scratch);
        } else {
          const F::Attn a = F::attn_of(s.q, kc[l], num_slots, s.attn, meta, heads, kv_heads, d, block_size, scale);
          F::run_items(a, plan, s.partials, left.data() + l * n_pairs, next_item[l], scratch, lanes_scratch);
        }
      });
      float* res = last_trim ? res_out.data_ptr<float>() : s.res;
      by_rows(kRoundO, [&](int64_t r0, int64_t r1) { I::round_rows(o.p, r0, r1); }, m);
      share(kO, o, &gate_up);
      by_rows(kNormGateUp, [&](int64_t r0, int64_t r1) {  // the residual add and post-attention norm
        norm_rows(s.o, res, norm2[l], s.h, r0, r1);
        I::round_rows(gate_up.p, r0, r1);
      }, m);
      share(kGateUp, gate_up, &down);
      by_rows(kSilu, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          F::silu_mul_row(s.gate_up + r * 2 * inter, s.gate_up + r * 2 * inter + inter, s.act + r * inter, inter);
        I::round_rows(down.p, r0, r1);
      }, m);
      share(kDown, down, after);
    }
  }
  return {trim ? x_out.narrow(0, 0, n_out) : x_out, res_out};
}

// x [T, hidden] (the embeddings) through every layer and the final norm; the caches written at `slots`. With
// out_rows (the rows the LM head reads: each prefill's last), the last layer computes only those rows past its
// KV-cache write, and only they are returned; in the team too (as fast as op by op, one region a step fewer, the same
// bits).
at::Tensor decode_layers(const at::Tensor& x_in, const c10::List<Opt>& weights, const at::TensorList caches,
                         const at::Tensor& final_norm, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& seq_of_token,
                         const at::Tensor& key_len, int64_t block_size, double scale, int64_t heads,
                         int64_t kv_heads, double eps, const Opt& out_rows) {
  const int64_t layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == layers * kPerLayer, "weights: expected ",
              kPerLayer, " per layer for ", layers, " layers, got ", weights.size());
  const std::vector<Opt> w(weights.begin(), weights.end());
  for (int64_t i = 0; i < static_cast<int64_t>(w.size()); ++i)
    TORCH_CHECK(w[i].has_value() || i % kPerLayer == kQkvB || i % kPerLayer == kOB, "layer ", i / kPerLayer,
                ": weight ", i % kPerLayer, " is missing");
  auto get = [&](int64_t layer, int64_t k) -> const at::Tensor& { return *w[layer * kPerLayer + k]; };
  at::Tensor x = x_in;
  Opt residual;  // none before the first layer: the first norm's residual is x itself
  int64_t first = 0;  // the first layer run op by op
  if (team_fits(w, layers, x_in.size(0))) {
    team_calls.fetch_add(1, std::memory_order_relaxed);
    Opt rows, seq_out, len_out;  // the last layer's rows past its KV write, where the team trims them
    if (out_rows) {
      rows = *out_rows, seq_out = seq_of_token.index_select(0, *out_rows), len_out = key_len.index_select(0, *out_rows);
    }
    auto [out, res] = team_layers(x_in, w, caches, layers, cos, sin, slots, block_table, seq_of_token, key_len,
                                  block_size, scale, heads, kv_heads, eps, rows, seq_out, len_out);
    x = out, residual = res, first = layers;
  }
  for (int64_t l = first; l < layers; ++l) {
    const at::Tensor h = F::add_rms_norm(x, residual, get(l, kNorm1), eps);
    if (!residual) residual = x;
    const at::Tensor qkv = I::int8_linear(h, get(l, kQkvQ), get(l, kQkvS), w[l * kPerLayer + kQkvB]);
    at::Tensor q = F::rope_store(qkv, cos, sin, caches[l], slots, heads, kv_heads);
    at::Tensor seq = seq_of_token, len = key_len;
    if (l == layers - 1 && out_rows) {  // past the last KV write only the returned rows count
      const at::Tensor& rows = *out_rows;
      q = q.index_select(0, rows);
      residual = residual->index_select(0, rows);
      seq = seq.index_select(0, rows);
      len = len.index_select(0, rows);
    }
    const at::Tensor out = F::paged_attention(q, caches[l], block_table, seq, len, block_size, scale);
    const at::Tensor o = I::int8_linear(out, get(l, kOQ), get(l, kOS), w[l * kPerLayer + kOB]);
    const at::Tensor h2 = F::add_rms_norm(o, residual, get(l, kNorm2), eps);
    const at::Tensor gate_up = I::int8_linear(h2, get(l, kGateUpQ), get(l, kGateUpS), std::nullopt);
    x = I::int8_linear(F::silu_mul(gate_up), get(l, kDownQ), get(l, kDownS), std::nullopt);
  }
  return F::add_rms_norm(x, residual, final_norm, eps);
}

// Tests and same-process comparisons: "team" 0 or 1, "times" 0 or 1 (phase times); the previous value back.
int64_t knob(const std::string& name, int64_t value) {
  if (name == "times") return times_on().exchange(std::clamp<int64_t>(value, 0, 1));
  TORCH_CHECK(name == "team", "layer loop knobs: team and times, got ", name);
  return team_on().exchange(std::clamp<int64_t>(value, 0, 1));
}

}  // namespace

TORCH_LIBRARY(mvllm_layers, m) {
  m.def("decode_layers(Tensor(b!) x, Tensor?[] weights, Tensor(a!)[] caches, Tensor final_norm, Tensor cos, Tensor sin,"
        " Tensor slots, Tensor block_table, Tensor seq_of_token, Tensor key_len, int block_size, float scale,"
        " int heads, int kv_heads, float eps, Tensor? out_rows=None) -> Tensor",
        &decode_layers);
  m.def("knob(str name, int value) -> int", &knob);
  m.def("team_calls() -> int", [] { return team_calls.load(); });
  m.def("team_times() -> Tensor", &team_times);
}
