// The two bfloat16 products of a causal prefill's attention (layers/attention_kernels.py, `_causal_op`) as torch
// computes them on an x86 CPU with AVX2 and FMA but no AVX-512: there torch has no oneDNN bf16 kernels and
// multiplies bf16 matrices with its own loops, which ran a prefill's attention at about 1 GMAC/s
// (benchmark/README.md, "bfloat16 on AVX2 at every row count, and the prefill's attention"). These ops sum in
// torch's orders, so they give its bits, and compute only what a causal row sees. The rows are a prefill's queries
// with grouped heads folded in ([N, G * S, D]): row r is query s = r % seq, which sees keys
// (T - seq + s - window, T - seq + s] (window 0: every key up to it).
//
// Keys and values: k / v [N, T, D] (any strides, each key's D values contiguous), or with `slots` (int64 [T]) a
// paged KV pool seen as [N, S, D] (`pool.view(-1, N, D).transpose(0, 1)`) whose key t is k[:, slots[t]]: a
// prefill over cached context reads its keys where they lie, with no gather and no contiguous copy of them
// (those took a sixth of its attention: benchmark/README.md, "prefix_reuse.py").
//
// textgen::causal_scores_bf16(q [N, R, D], k, seq, window, slots=None) -> scores [N, R, T] bf16: q @ k^T, each seen
//   score by torch's bf16 dot product (`dot_row`, torch_order.h), as torch's matmul sums a product whose second
//   operand is transposed. Where a head is whole steps of 64 values, eight keys are converted to float32 and
//   transposed once ([D][8], a key a lane) and two queries at a time summed over them (`key_scores8`): the same
//   products and additions, all of them vertical, without dot_row's unpacking and folds. Scores a row does not see
//   are 0 (textgen::causal_softmax_bf16 reads only the others).
// textgen::causal_values_bf16(probs [N, R, T], v, seq, window, slots=None) -> [N, R, D] bf16: probs @ v, as torch's
//   matmul sums a product of two untransposed bf16 matrices: per output, four float32 partial sums (key t into
//   t % 4, the keys after the last whole four into the first), added in order ((0 + 1) + 2) + 3, rounded once.
//   Each product of two bf16 values is exact in float32, so a fused multiply-add adds it as torch's add does; a
//   key the row does not see has probability 0 and adds an exact zero, so it is skipped. v is converted to float32
//   once, 16 columns at a time, and each row's probabilities once; the four sums stay in registers (about 2x
//   faster than converting v for each row with its sums in memory), and a block of rows reads v in tiles that
//   stay in L1 (40 queries over 1,541 cached keys, 12 heads; benchmark/README.md, "prefix_reuse.py").
// textgen::torch_order_products() -> bool: whether this build has them (AVX2 without AVX-512). Whether torch on
//   this CPU sums that way is checked where they are used (attention_kernels.py, `torch_order_products`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "torch_order.h"

namespace {

bool built() {
#if defined(TEXTGEN_TORCH_ORDER)
  return true;
#else
  return false;
#endif
}

// Where key t of head h lies: k[h, t], or with `slots` k[h, slots[t]] (a KV pool seen as [N, S, D], read in place).
struct Keys {
  const uint16_t* base;
  int64_t head_stride, key_stride;
  const int64_t* slots;  // null: t itself
  const uint16_t* at(int64_t head, int64_t t) const {
    return base + head * head_stride + (slots ? slots[t] : t) * key_stride;
  }
};

#if defined(TEXTGEN_TORCH_ORDER)
// The keys [lo, hi] row i of the heads' rows sees (query i % rows % seq).
inline void seen(int64_t i, int64_t rows, int64_t seq, int64_t total, int64_t window, int64_t& lo, int64_t& hi) {
  hi = total - seq + i % rows % seq;
  lo = window > 0 ? std::max<int64_t>(0, hi - window + 1) : 0;
}

// f(i, head, lo, hi) for each row i of the heads' rows, over threads: row i belongs to head i / rows and sees keys
// [lo, hi].
template <typename F>
void each_row(int64_t heads, int64_t rows, int64_t seq, int64_t total, int64_t window, const F& f) {
  at::parallel_for(0, heads * rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t lo = 0, hi = 0;
      seen(i, rows, seq, total, window, lo, hi);
      f(i, i / rows, lo, hi);
    }
  });
}

// Rows of one head a task of the ops takes: they share the head's converted keys or values while in cache.
constexpr int64_t BLOCK_ROWS = 16;

// f(head, r0, count, lo, hi) for each block of up to BLOCK_ROWS consecutive rows of one head (rows r0 .. r0 + count
// - 1), over threads: row r0 + r sees keys [lo[r], hi[r]].
template <typename F>
void each_block(int64_t heads, int64_t rows, int64_t seq, int64_t total, int64_t window, const F& f) {
  const int64_t blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
  at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / blocks, r0 = head * rows + task % blocks * BLOCK_ROWS;
      const int64_t count = std::min(BLOCK_ROWS, (head + 1) * rows - r0);
      int64_t lo[BLOCK_ROWS], hi[BLOCK_ROWS];
      for (int64_t r = 0; r < count; ++r) seen(r0 + r, rows, seq, total, window, lo[r], hi[r]);
      f(head, r0, count, lo, hi);
    }
  });
}

// Eight keys' float32 values [D][8] (value d of key i at d * 8 + i) from keys t0 .. t0 + 7 of `head` (zeros past
// `total`): 8 x 8 blocks converted and transposed in registers.
inline void transpose_keys(const Keys& keys, int64_t head, int64_t t0, int64_t total, int64_t dim, float* kt) {
  for (int64_t d0 = 0; d0 < dim; d0 += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i)
      r[i] = t0 + i < total ? textgen_cpu::load8(keys.at(head, t0 + i) + d0) : _mm256_setzero_ps();
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);      // keys 2i, 2i+1: values 0, 1 | 4, 5
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);  // values 2, 3 | 6, 7
    }
    for (int h = 0; h < 2; ++h)  // keys 4h .. 4h + 3
      for (int i = 0; i < 2; ++i) {
        u[4 * h + 2 * i] = _mm256_shuffle_ps(t[4 * h + i], t[4 * h + 2 + i], 0x44);      // value 2i | 2i + 4
        u[4 * h + 2 * i + 1] = _mm256_shuffle_ps(t[4 * h + i], t[4 * h + 2 + i], 0xEE);  // value 2i+1 | 2i + 5
      }
    for (int v = 0; v < 4; ++v) {
      _mm256_storeu_ps(kt + (d0 + v) * 8, _mm256_permute2f128_ps(u[v], u[4 + v], 0x20));
      _mm256_storeu_ps(kt + (d0 + 4 + v) * 8, _mm256_permute2f128_ps(u[v], u[4 + v], 0x31));
    }
  }
}

// (A lambda's call is inlined only where it is marked so: left to the compiler, these were calls passing their
// sums through memory, three times slower than dot_row.)
#define TEXTGEN_INLINE __attribute__((always_inline))

// ((f(0) + f(4)) + (f(2) + f(6))) + ((f(1) + f(5)) + (f(3) + f(7))) for each of Q queries: f(i, a) sets a[q].
template <int Q, typename F>
TEXTGEN_INLINE inline void tree8(const F& f, __m256* sum) {
  __m256 a[Q], b[Q], u[Q], w[Q];
  f(0, a), f(4, b);
  for (int q = 0; q < Q; ++q) u[q] = _mm256_add_ps(a[q], b[q]);
  f(2, a), f(6, b);
  for (int q = 0; q < Q; ++q) u[q] = _mm256_add_ps(u[q], _mm256_add_ps(a[q], b[q]));
  f(1, a), f(5, b);
  for (int q = 0; q < Q; ++q) w[q] = _mm256_add_ps(a[q], b[q]);
  f(3, a), f(7, b);
  for (int q = 0; q < Q; ++q) sum[q] = _mm256_add_ps(u[q], _mm256_add_ps(w[q], _mm256_add_ps(a[q], b[q])));
}

// Q (1 or 2) queries' scores of eight keys at once, one key a lane, summed as `dot_row` sums each one: value
// d = 64 s + 8 j + l into accumulator j, lane l (a fused multiply-add a step, the first onto zero), the
// accumulators added ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)), then the lanes the same way. With keys in lanes
// every one of those additions is a vertical one, and no value is unpacked or folded. kt: the keys' values
// [D][8]; x[q]: query q's values in float32, in order. STEPS: the head's steps of 64 values where known when
// compiled (0: dim / 64 at run time). A head of one step (64 values, the common size) then sums with no loop around
// each of its 64 multiply-adds: those loops' counters and branches cost the op about a tenth of its time
// (benchmark/README.md, "prefix_reuse.py").
template <int Q, int STEPS>
TEXTGEN_INLINE inline void key_scores8(const float* kt, const float* const* x, int64_t dim, __m256* out) {
  const int64_t steps = STEPS > 0 ? STEPS : dim / textgen_cpu::DOT_STEP;
  tree8<Q>(
      [&](int l, __m256* lane) TEXTGEN_INLINE {
        tree8<Q>(
            [&](int j, __m256* a) TEXTGEN_INLINE {
              for (int q = 0; q < Q; ++q) a[q] = _mm256_setzero_ps();
              for (int64_t s = 0; s < steps; ++s) {
                const int64_t d = textgen_cpu::DOT_STEP * s + 8 * j + l;
                const __m256 k = _mm256_loadu_ps(kt + d * 8);
                for (int q = 0; q < Q; ++q) a[q] = _mm256_fmadd_ps(_mm256_broadcast_ss(x[q] + d), k, a[q]);
              }
            },
            lane);
      },
      out);
}

constexpr int64_t VALUE_TILE = 256;  // keys a tile: 16 KiB of a 16-column chunk's float32 values

// Keys [a, b] of one row into its eight sums s (s[p]: part p of columns 0-7, s[4 + p]: of columns 8-15): key t into
// part t % 4 below `whole`, into part 0 past it, in order of t. `values`: the chunk's 16 columns, key after key.
inline void add_values(const float* p, const float* values, int64_t a, int64_t b, int64_t whole, __m256* s) {
  __m256 a0 = s[0], a1 = s[1], a2 = s[2], a3 = s[3], b0 = s[4], b1 = s[5], b2 = s[6], b3 = s[7];
  // One key into its sum. A switch, not a reference picked at run time: taking a sum's address kept all eight in
  // memory, and the fours' loop then ran at a third of its speed.
  auto one = [&](int64_t t, int part) {
    const __m256 pt = _mm256_broadcast_ss(p + t);
    const __m256 lo8 = _mm256_loadu_ps(values + t * 16), hi8 = _mm256_loadu_ps(values + t * 16 + 8);
    switch (part) {
      case 0: a0 = _mm256_fmadd_ps(pt, lo8, a0); b0 = _mm256_fmadd_ps(pt, hi8, b0); break;
      case 1: a1 = _mm256_fmadd_ps(pt, lo8, a1); b1 = _mm256_fmadd_ps(pt, hi8, b1); break;
      case 2: a2 = _mm256_fmadd_ps(pt, lo8, a2); b2 = _mm256_fmadd_ps(pt, hi8, b2); break;
      default: a3 = _mm256_fmadd_ps(pt, lo8, a3); b3 = _mm256_fmadd_ps(pt, hi8, b3); break;
    }
  };
  // Whole fours from the first multiple of 4 to the last before min(b + 1, whole); the keys around them one by one.
  const int64_t first = std::min({(a + 3) & ~int64_t(3), whole, b + 1});
  const int64_t last = std::max(first, std::min(b + 1, whole) & ~int64_t(3));
  for (int64_t t = a; t < first; ++t) one(t, static_cast<int>(t % 4));
  for (int64_t t = first; t < last; t += 4) {
    const float* vt = values + t * 16;
    const __m256 p0 = _mm256_broadcast_ss(p + t), p1 = _mm256_broadcast_ss(p + t + 1);
    const __m256 p2 = _mm256_broadcast_ss(p + t + 2), p3 = _mm256_broadcast_ss(p + t + 3);
    a0 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vt), a0);
    b0 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vt + 8), b0);
    a1 = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vt + 16), a1);
    b1 = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vt + 24), b1);
    a2 = _mm256_fmadd_ps(p2, _mm256_loadu_ps(vt + 32), a2);
    b2 = _mm256_fmadd_ps(p2, _mm256_loadu_ps(vt + 40), b2);
    a3 = _mm256_fmadd_ps(p3, _mm256_loadu_ps(vt + 48), a3);
    b3 = _mm256_fmadd_ps(p3, _mm256_loadu_ps(vt + 56), b3);
  }
  for (int64_t t = std::max(last, a); t <= b; ++t) one(t, t < whole ? static_cast<int>(t % 4) : 0);
  s[0] = a0, s[1] = a1, s[2] = a2, s[3] = a3, s[4] = b0, s[5] = b1, s[6] = b2, s[7] = b3;
}

// causal_scores_bf16 for a head size of whole steps of 64: each head's keys converted to float32 and transposed
// eight at a time, then each block's rows, two at a time, over them.
void key_major_scores(const uint16_t* qp, const Keys& keys, int64_t n, int64_t rows, int64_t seq, int64_t total,
                      int64_t window, int64_t dim, uint16_t* out) {
  const int64_t groups = (total + 7) / 8, group_floats = dim * 8;
  const at::Tensor transposed = at::empty({n * groups * group_floats}, at::kFloat);
  float* kt = transposed.data_ptr<float>();
  at::parallel_for(0, n * groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t hg = begin; hg < end; ++hg)
      transpose_keys(keys, hg / groups, hg % groups * 8, total, dim, kt + hg * group_floats);
  });
  each_block(n, rows, seq, total, window, [&](int64_t head, int64_t r0, int64_t count, const int64_t* lo,
                                               const int64_t* hi) {
    std::vector<float> xs(static_cast<size_t>(count * dim));
    for (int64_t r = 0; r < count; ++r) {
      for (int64_t d = 0; d < dim; ++d) xs[r * dim + d] = textgen_cpu::bf16_to_float(qp[(r0 + r) * dim + d]);
      std::fill(out + (r0 + r) * total, out + (r0 + r + 1) * total, uint16_t(0));
    }
    const float* heads_keys = kt + head * groups * group_floats;
    // Scores of group g for row r0 + r, stored where the row sees the key.
    auto store = [&](int64_t g, int64_t r, __m256 sums) {
      alignas(32) uint16_t b16[8];
      textgen_cpu::store8(b16, sums);
      const int64_t a = std::max(lo[r], 8 * g), b = std::min(hi[r], 8 * g + 7);
      for (int64_t t = a; t <= b; ++t) out[(r0 + r) * total + t] = b16[t - 8 * g];
    };
    // (Tiles of groups kept in L1 across the block's rows gained 2-4%, within this VM's noise: not kept.)
    const bool one_step = dim == textgen_cpu::DOT_STEP;
    for (int64_t r = 0; r < count; r += 2) {
      const int pair = r + 1 < count ? 2 : 1;
      const int64_t a = std::min(lo[r], lo[r + pair - 1]) / 8, b = std::max(hi[r], hi[r + pair - 1]) / 8;
      const float* x[2] = {xs.data() + r * dim, xs.data() + (r + pair - 1) * dim};
      for (int64_t g = a; g <= b; ++g) {
        const float* kt = heads_keys + g * group_floats;
        __m256 sums[2];
        if (pair == 2) {
          one_step ? key_scores8<2, 1>(kt, x, dim, sums) : key_scores8<2, 0>(kt, x, dim, sums);
          store(g, r, sums[0]), store(g, r + 1, sums[1]);
        } else {
          one_step ? key_scores8<1, 1>(kt, x, dim, sums) : key_scores8<1, 0>(kt, x, dim, sums);
          store(g, r, sums[0]);
        }
      }
    }
  });
}
#endif

// The operands' checks, and `b`'s keys (its last dimension contiguous): T of them, slots' count or else b.size(1).
Keys keys_of(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& slots, int64_t seq,
             int64_t window, const char* op, int64_t& total) {
  TORCH_CHECK(built(), op, ": the library was built without AVX2 and FMA, or with AVX-512");
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && a.dim() == 3 && b.dim() == 3 &&
                  a.size(0) == b.size(0),
              op, ": bf16 operands [N, R, *] and [N, T, *]");
  TORCH_CHECK(seq > 0 && a.size(1) % seq == 0 && window >= 0, op, ": rows must be whole groups of seq queries");
  total = b.size(1);
  const int64_t* index = nullptr;
  if (slots.has_value()) {
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->dim() == 1 && slots->is_contiguous(), op,
                ": slots a contiguous int64 [T]");
    total = slots->numel();
    index = slots->data_ptr<int64_t>();
    for (int64_t t = 0; t < total; ++t) TORCH_CHECK(index[t] >= 0 && index[t] < b.size(1), op, ": a slot out of range");
  }
  TORCH_CHECK(total >= seq, op, ": fewer keys than queries");
  return {reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()), b.stride(0), b.stride(1), index};
}

at::Tensor causal_scores(const at::Tensor& q, const at::Tensor& k, int64_t seq, int64_t window,
                         const c10::optional<at::Tensor>& slots) {
  int64_t total = 0;
  const at::Tensor kc = k.dim() == 3 && k.stride(2) != 1 ? k.contiguous() : k;
  const Keys keys = keys_of(q, kc, slots, seq, window, "causal_scores_bf16", total);
  TORCH_CHECK(q.size(2) == k.size(2), "causal_scores_bf16: queries and keys of one head size");
  const at::Tensor qc = q.contiguous();
  const int64_t n = q.size(0), rows = q.size(1), dim = q.size(2);
  at::Tensor scores = at::empty({n, rows, total}, q.options());
#if defined(TEXTGEN_TORCH_ORDER)
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  auto* out = reinterpret_cast<uint16_t*>(scores.data_ptr<at::BFloat16>());
  if (dim % textgen_cpu::DOT_STEP == 0) {
    key_major_scores(qp, keys, n, rows, seq, total, window, dim, out);
    return scores;
  }
  each_row(n, rows, seq, total, window, [&](int64_t i, int64_t head, int64_t lo, int64_t hi) {
    std::vector<float> xp(static_cast<size_t>(dim));
    textgen_cpu::dot_operand(qp + i * dim, dim, xp.data());
    auto* row = reinterpret_cast<at::BFloat16*>(out + i * total);
    std::fill(row, row + total, at::BFloat16(0.f));
    for (int64_t t = lo; t <= hi; ++t) row[t] = at::BFloat16(textgen_cpu::dot_row(xp.data(), keys.at(head, t), dim));
  });
#endif
  return scores;
}

at::Tensor causal_values(const at::Tensor& probs, const at::Tensor& v, int64_t seq, int64_t window,
                         const c10::optional<at::Tensor>& slots) {
  int64_t total = 0;
  const at::Tensor vc = v.dim() == 3 && v.stride(2) != 1 ? v.contiguous() : v;
  const Keys values = keys_of(probs, vc, slots, seq, window, "causal_values_bf16", total);
  TORCH_CHECK(probs.size(2) == total, "causal_values_bf16: one probability a key");
  const at::Tensor pc = probs.contiguous();
  const int64_t n = probs.size(0), rows = probs.size(1), dim = v.size(2);
  at::Tensor out = at::empty({n, rows, dim}, v.options());
#if defined(TEXTGEN_TORCH_ORDER)
  const auto* pp = reinterpret_cast<const uint16_t*>(pc.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // v in float32, converted once for every row of its head, 16 columns at a time: [N, D / 16, T, 16]. A row's key
  // then costs a broadcast and two fused multiply-adds reading 64 contiguous bytes, not a conversion of v's values
  // again for each row.
  const int64_t chunks = dim / 16, tail = dim % 16;
  const at::Tensor converted = at::empty({n * chunks * total * 16}, v.options().dtype(at::kFloat));
  float* vf = converted.data_ptr<float>();
  at::parallel_for(0, total, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t head = 0; head < n; ++head) {  // a slot's heads one after another: one pool row
        const uint16_t* src = values.at(head, t);
        for (int64_t ci = 0; ci < chunks; ++ci) {
          float* dst = vf + ((head * chunks + ci) * total + t) * 16;
          _mm256_storeu_ps(dst, textgen_cpu::load8(src + ci * 16));
          _mm256_storeu_ps(dst + 8, textgen_cpu::load8(src + ci * 16 + 8));
        }
      }
  });
  const int64_t whole = total - total % 4;  // keys summed in fours; the rest join partial sum 0
  // Each 16-column chunk of v is read in tiles of keys that stay in L1 while every row of a block adds them to its
  // eight sums (kept in `sums` between tiles): 2-17% faster than each row streaming the whole chunk
  // (benchmark/README.md, "Keys and values read in the pool").
  each_block(n, rows, seq, total, window, [&](int64_t head, int64_t r0, int64_t count, const int64_t* lo,
                                               const int64_t* hi) {
    std::vector<float> probs(static_cast<size_t>(count * total), 0.f);
    std::vector<__m256> sums(static_cast<size_t>(count * 8));
    for (int64_t r = 0; r < count; ++r)
      for (int64_t t = lo[r]; t <= hi[r]; ++t) probs[r * total + t] = textgen_cpu::bf16_to_float(pp[(r0 + r) * total + t]);
    const int64_t first = *std::min_element(lo, lo + count), last = *std::max_element(hi, hi + count);
    for (int64_t ci = 0; ci < chunks; ++ci) {
      const float* vc = vf + (head * chunks + ci) * total * 16;  // 16 columns, key after key
      std::fill(sums.begin(), sums.end(), _mm256_setzero_ps());
      for (int64_t t0 = first & ~(VALUE_TILE - 1); t0 <= last; t0 += VALUE_TILE)
        for (int64_t r = 0; r < count; ++r) {
          const int64_t a = std::max(lo[r], t0), b = std::min(hi[r], t0 + VALUE_TILE - 1);
          if (a <= b) add_values(probs.data() + r * total, vc, a, b, whole, sums.data() + r * 8);
        }
      for (int64_t r = 0; r < count; ++r) {
        const __m256* sr = sums.data() + r * 8;  // parts 0-3 of columns 0-7, then of columns 8-15
        uint16_t* y = op + (r0 + r) * dim + ci * 16;
        textgen_cpu::store8(y, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(sr[0], sr[1]), sr[2]), sr[3]));
        textgen_cpu::store8(y + 8, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(sr[4], sr[5]), sr[6]), sr[7]));
      }
    }
    // A head size not a multiple of 16: its last columns one at a time, in the same order.
    for (int64_t r = 0; r < count; ++r)
      for (int64_t c = dim - tail; c < dim; ++c) {
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        for (int64_t t = lo[r]; t <= hi[r]; ++t) {
          float& sum = part[t < whole ? t % 4 : 0];
          sum = std::fma(probs[r * total + t], textgen_cpu::bf16_to_float(values.at(head, t)[c]), sum);
        }
        op[(r0 + r) * dim + c] = textgen_cpu::float_to_bf16(((part[0] + part[1]) + part[2]) + part[3]);
      }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(textgen, m) {
  m.def("causal_scores_bf16(Tensor q, Tensor k, int seq, int window, Tensor? slots=None) -> Tensor");
  m.def("causal_values_bf16(Tensor probs, Tensor v, int seq, int window, Tensor? slots=None) -> Tensor");
  m.def("torch_order_products() -> bool", &built);
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("causal_scores_bf16", &causal_scores);
  m.impl("causal_values_bf16", &causal_values);
}
