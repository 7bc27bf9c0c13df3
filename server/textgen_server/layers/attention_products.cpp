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
//   transposed once per task ([D][8], a key a lane) and two queries at a time summed over them (`key_scores8`):
//   the same products and additions, all of them vertical, without dot_row's unpacking and folds; with a head of 64
//   values and no `unusual` operand, the first additions fused into the products (`key_scores8_pairs`), which
//   gives the same bits with a quarter fewer operations. Scores a row does not see are 0
//   (textgen::causal_softmax_bf16 reads only the others).
// textgen::causal_values_bf16(probs [N, R, T], v, seq, window, slots=None) -> [N, R, D] bf16: probs @ v, as torch's
//   matmul sums a product of two untransposed bf16 matrices: per output, four float32 partial sums (key t into
//   t % 4, the keys after the last whole four into the first), added in order ((0 + 1) + 2) + 3, rounded once.
//   Each product of two bf16 values is exact in float32, so a fused multiply-add adds it as torch's add does; a
//   key the row does not see has probability 0 and adds an exact zero, so it is skipped. v is converted to float32
//   once, 16 columns at a time, and each row's probabilities once (about 2x faster than converting v for each row
//   with its sums in memory), both with their keys grouped by partial sum, so that each sum is computed alone over
//   its keys in order, four rows at a time sharing each key's loaded values (40 queries over 1,541 cached keys, 12
//   heads; benchmark/README.md, "prefix_reuse.py").
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

// f(head, r0, count, lo, hi) for each run of up to `run` consecutive rows of one head (rows r0 .. r0 + count - 1),
// over threads: row r0 + r sees keys [lo[r], hi[r]]. A task's rows share the keys or values it converts.
template <typename F>
void each_run(int64_t heads, int64_t rows, int64_t seq, int64_t total, int64_t window, int64_t run, const F& f) {
  const int64_t runs = (rows + run - 1) / run;
  at::parallel_for(0, heads * runs, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> lo(static_cast<size_t>(run)), hi(static_cast<size_t>(run));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / runs, r0 = head * rows + task % runs * run;
      const int64_t count = std::min(run, (head + 1) * rows - r0);
      for (int64_t r = 0; r < count; ++r) seen(r0 + r, rows, seq, total, window, lo[r], hi[r]);
      f(head, r0, count, lo.data(), hi.data());
    }
  });
}

// The lanes of v that are neither 0 nor of a magnitude in [2^-63, 2^63), all ones: the product of two values
// that are is 0 or a normal float32, never a subnormal, an infinity or a NaN (key_scores8_pairs).
inline __m256i unusual(__m256 v) {
  const __m256i magnitude = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i zero = _mm256_setzero_si256();
  const __m256i usual = _mm256_or_si256(_mm256_cmpeq_epi32(magnitude, zero),
                                        _mm256_and_si256(_mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x1FFFFFFF)),
                                                         _mm256_cmpgt_epi32(_mm256_set1_epi32(0x5F000000), magnitude)));
  return _mm256_andnot_si256(usual, _mm256_set1_epi32(-1));
}

// Eight keys' float32 values [D][8] (value d of key i at d * 8 + i) from keys t0 .. t0 + 7 of `head` (zeros past
// `total`): 8 x 8 blocks converted and transposed in registers. Returns whether no value is `unusual`.
inline bool transpose_keys(const Keys& keys, int64_t head, int64_t t0, int64_t total, int64_t dim, float* kt) {
  __m256i flags = _mm256_setzero_si256();
  for (int64_t d0 = 0; d0 < dim; d0 += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) {
      r[i] = t0 + i < total ? textgen_cpu::load8(keys.at(head, t0 + i) + d0) : _mm256_setzero_ps();
      flags = _mm256_or_si256(flags, unusual(r[i]));
    }
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
  return _mm256_testz_si256(flags, flags);
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
// each of its 64 multiply-adds: those loops' counters and branches cost the op a tenth to a third of its time
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
                __m256 k = _mm256_loadu_ps(kt + d * 8);
                // Held in a register: left alone, the compiler folds the load into each query's multiply-add.
                __asm__("" : "+x"(k));
                for (int q = 0; q < Q; ++q) a[q] = _mm256_fmadd_ps(_mm256_broadcast_ss(x[q] + d), k, a[q]);
              }
            },
            lane);
      },
      out);
}

// key_scores8 for a head of one step (64 values), each pair of products the tree adds first taken by one fused
// multiply-add: f(j) + f(j + 4) is round(p + x * k) with p = f(j). A product of two bf16 values (8 significant
// bits each) is exact in float32 wherever it is a normal number, so the multiply-add rounds what torch's addition
// rounds; only where no operand is `unusual`, so that every product is (a product past float32's largest, rounded
// to infinity before torch adds it, would not be: test_attention_products.py).
template <int Q>
TEXTGEN_INLINE inline void key_scores8_pairs(const float* kt, const float* const* x, __m256* out) {
  tree8<Q>(
      [&](int l, __m256* lane) TEXTGEN_INLINE {
        __m256 p[4][Q];
        constexpr int firsts[4] = {0, 2, 1, 3};  // pairs (0, 4), (2, 6), (1, 5), (3, 7)
        for (int i = 0; i < 4; ++i) {
          const int64_t d0 = 8 * firsts[i] + l, d1 = d0 + 32;
          __m256 k0 = _mm256_loadu_ps(kt + d0 * 8), k1 = _mm256_loadu_ps(kt + d1 * 8);
          __asm__("" : "+x"(k0), "+x"(k1));
          for (int q = 0; q < Q; ++q)
            p[i][q] = _mm256_fmadd_ps(_mm256_broadcast_ss(x[q] + d1), k1,
                                      _mm256_mul_ps(_mm256_broadcast_ss(x[q] + d0), k0));
        }
        for (int q = 0; q < Q; ++q)
          lane[q] = _mm256_add_ps(_mm256_add_ps(p[0][q], p[1][q]), _mm256_add_ps(p[2][q], p[3][q]));
      },
      out);
}

// torch's four partial sums of a product with untransposed v take key t into sum t % 4, and the keys after the last
// whole four (`whole`) into sum 0: each sum in order of t. So each sum can be computed alone, over its own keys in
// order. `Parts` lists every part's keys one after another (part 0: t = 0, 4, .., then the keys from `whole` on;
// part p > 0: t = p, p + 4, ..), so that a part's keys are contiguous and a row's keys of a part, [a, b] of t, are one
// contiguous run of positions.
struct Parts {
  int64_t total, whole, quarter;  // T keys; the keys summed in fours; whole / 4, a part's keys below `whole`
  explicit Parts(int64_t keys) : total(keys), whole(keys - keys % 4), quarter(whole / 4) {}
  int part(int64_t t) const { return t < whole ? static_cast<int>(t % 4) : 0; }  // the partial sum key t joins
  int64_t base(int p) const { return p == 0 ? 0 : quarter + (total - whole) + (p - 1) * quarter; }
  int64_t position(int64_t t) const { return t < whole ? base(part(t)) + t / 4 : quarter + t - whole; }
  // A row of T bf16 values by key into float32 by position: 16 keys at a time, four of each part (a 4 x 4 transpose).
  void gather(const uint16_t* row, float* out) const {
    int64_t t = 0;
    for (; t + 16 <= whole; t += 16) {
      const __m256 first = textgen_cpu::load8(row + t), second = textgen_cpu::load8(row + t + 8);
      __m128 x[4] = {_mm256_castps256_ps128(first), _mm256_extractf128_ps(first, 1),  // keys t .. t + 3, t + 4 ..
                     _mm256_castps256_ps128(second), _mm256_extractf128_ps(second, 1)};
      _MM_TRANSPOSE4_PS(x[0], x[1], x[2], x[3]);  // x[p]: keys t + p, t + p + 4, t + p + 8, t + p + 12
      for (int p = 0; p < 4; ++p) _mm_storeu_ps(out + base(p) + t / 4, x[p]);
    }
    for (; t < total; ++t) out[position(t)] = textgen_cpu::bf16_to_float(row[t]);
  }
  // Positions [begin, end) of part p's keys among keys [a, b] (empty: begin >= end).
  void run(int p, int64_t a, int64_t b, int64_t& begin, int64_t& end) const {
    if (p == 0) {
      begin = a < whole ? (a + 3) / 4 : quarter + a - whole;
      end = b < whole ? b / 4 + 1 : quarter + b - whole + 1;
      return;
    }
    const int64_t top = std::min(b, whole - 1) - p;  // the last key of the part at or below b, as an offset
    begin = base(p) + (a - p + 3) / 4;
    end = top < 0 ? begin : base(p) + top / 4 + 1;
  }
};

// Rows of one head a task of the values op takes (`each_run`): they share the head's converted values in cache.
constexpr int64_t BLOCK_ROWS = 16;

// Up to VALUE_ROWS rows of one part: row r's sums (s[2r]: columns 0-7, s[2r + 1]: 8-15) over positions
// [begin[r], end[r]) of `values` (16 columns a position) weighted by p[r] (the row's probabilities by position), in
// order of position. The positions every row has are summed for all rows at once, each position's 16 values loaded
// once for them all: a row alone costs three loads for two multiply-adds, four rows together six for eight (and
// fewer loads than multiply-adds keep both FMA units busy).
constexpr int VALUE_ROWS = 4;  // (the loop over common positions below is written for four)
inline void add_part(const float* const* p, const float* values, const int64_t* begin, const int64_t* end, int rows,
                     __m256* s) {
  __m256 acc[2 * VALUE_ROWS];
  for (int i = 0; i < 2 * VALUE_ROWS; ++i) acc[i] = _mm256_setzero_ps();
  auto one = [&](int r, int64_t a, int64_t b) {
    __m256 lo = acc[2 * r], hi = acc[2 * r + 1];
    for (int64_t i = a; i < b; ++i) {
      const __m256 w = _mm256_broadcast_ss(p[r] + i);
      lo = _mm256_fmadd_ps(w, _mm256_loadu_ps(values + i * 16), lo);
      hi = _mm256_fmadd_ps(w, _mm256_loadu_ps(values + i * 16 + 8), hi);
    }
    acc[2 * r] = lo, acc[2 * r + 1] = hi;
  };
  int64_t common_begin = begin[0], common_end = end[0];
  for (int r = 1; r < rows; ++r) {
    common_begin = std::max(common_begin, begin[r]);
    common_end = std::min(common_end, end[r]);
  }
  if (rows < VALUE_ROWS || common_begin >= common_end) {
    for (int r = 0; r < rows; ++r) one(r, begin[r], end[r]);
  } else {
    for (int r = 0; r < rows; ++r) one(r, begin[r], common_begin);
    __m256 a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3], a4 = acc[4], a5 = acc[5], a6 = acc[6], a7 = acc[7];
    const float *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3];
    for (int64_t i = common_begin; i < common_end; ++i) {
      __m256 lo = _mm256_loadu_ps(values + i * 16), hi = _mm256_loadu_ps(values + i * 16 + 8);
      // Held in registers: left alone, the compiler folds the loads into each row's multiply-add, loading them four
      // times (twelve loads a position instead of six).
      __asm__("" : "+x"(lo), "+x"(hi));
      __m256 w = _mm256_broadcast_ss(p0 + i);
      a0 = _mm256_fmadd_ps(w, lo, a0), a1 = _mm256_fmadd_ps(w, hi, a1);
      w = _mm256_broadcast_ss(p1 + i);
      a2 = _mm256_fmadd_ps(w, lo, a2), a3 = _mm256_fmadd_ps(w, hi, a3);
      w = _mm256_broadcast_ss(p2 + i);
      a4 = _mm256_fmadd_ps(w, lo, a4), a5 = _mm256_fmadd_ps(w, hi, a5);
      w = _mm256_broadcast_ss(p3 + i);
      a6 = _mm256_fmadd_ps(w, lo, a6), a7 = _mm256_fmadd_ps(w, hi, a7);
    }
    acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3, acc[4] = a4, acc[5] = a5, acc[6] = a6, acc[7] = a7;
    for (int r = 0; r < rows; ++r) one(r, common_end, end[r]);
  }
  for (int i = 0; i < 2 * rows; ++i) s[i] = acc[i];
}

// Q queries' scores of eight keys by the fastest of the sums above that gives torch's bits.
template <int Q>
TEXTGEN_INLINE inline void scores8(bool pairs, const float* kt, const float* const* x, int64_t dim, __m256* sums) {
  if (pairs)
    key_scores8_pairs<Q>(kt, x, sums);
  else if (dim == textgen_cpu::DOT_STEP)
    key_scores8<Q, 1>(kt, x, dim, sums);
  else
    key_scores8<Q, 0>(kt, x, dim, sums);
}

// Key groups a task converts at once (64 keys, 16 KiB of float32 with a head of 64): they stay in L1 while every
// row of the task sums over them.
constexpr int64_t TILE_GROUPS = 8;

// causal_scores_bf16 for a head size of whole steps of 64. Each head's rows are split into as few tasks as keep
// every thread busy; a task converts and transposes the keys its rows see a tile at a time into a buffer of its own,
// then sums each pair of its rows over the tile. With the fused pairs and each key loaded once for both queries,
// 1.2-1.35x faster than converting every head's keys into one buffer first (benchmark/README.md, "prefix_reuse.py").
void key_major_scores(const uint16_t* qp, const Keys& keys, int64_t n, int64_t rows, int64_t seq, int64_t total,
                      int64_t window, int64_t dim, uint16_t* out) {
  const int64_t group_floats = dim * 8;
  const int64_t parts = std::min(rows, (2 * at::get_num_threads() + n - 1) / n);
  each_run(n, rows, seq, total, window, (rows + parts - 1) / parts, [&](int64_t head, int64_t r0, int64_t count,
                                                                      const int64_t* lo, const int64_t* hi) {
    std::vector<float> xs(static_cast<size_t>(count * dim));
    std::vector<float> tile(static_cast<size_t>(TILE_GROUPS * group_floats));
    __m256i flags = _mm256_setzero_si256();
    for (int64_t r = 0; r < count; ++r) {
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 x8 = textgen_cpu::load8(qp + (r0 + r) * dim + d);
        _mm256_storeu_ps(xs.data() + r * dim + d, x8);
        flags = _mm256_or_si256(flags, unusual(x8));
      }
      std::fill(out + (r0 + r) * total, out + (r0 + r + 1) * total, uint16_t(0));
    }
    const bool queries_ordinary = _mm256_testz_si256(flags, flags);
    // Scores of group g for row r0 + r, stored where the row sees the key.
    auto store = [&](int64_t g, int64_t r, __m256 sums) {
      alignas(32) uint16_t b16[8];
      textgen_cpu::store8(b16, sums);
      const int64_t a = std::max(lo[r], 8 * g), b = std::min(hi[r], 8 * g + 7);
      for (int64_t t = a; t <= b; ++t) out[(r0 + r) * total + t] = b16[t - 8 * g];
    };
    const int64_t first = *std::min_element(lo, lo + count) / 8, last = *std::max_element(hi, hi + count) / 8;
    for (int64_t g0 = first; g0 <= last; g0 += TILE_GROUPS) {
      const int64_t g1 = std::min(last, g0 + TILE_GROUPS - 1);
      bool keys_ordinary = true;
      for (int64_t g = g0; g <= g1; ++g)
        keys_ordinary &= transpose_keys(keys, head, g * 8, total, dim, tile.data() + (g - g0) * group_floats);
      const bool pairs = dim == textgen_cpu::DOT_STEP && queries_ordinary && keys_ordinary;
      for (int64_t r = 0; r < count; r += 2) {
        const int pair = r + 1 < count ? 2 : 1;
        const int64_t a = std::max(g0, std::min(lo[r], lo[r + pair - 1]) / 8),
                      b = std::min(g1, std::max(hi[r], hi[r + pair - 1]) / 8);
        const float* x[2] = {xs.data() + r * dim, xs.data() + (r + pair - 1) * dim};
        for (int64_t g = a; g <= b; ++g) {
          const float* kt = tile.data() + (g - g0) * group_floats;
          __m256 sums[2];
          if (pair == 2) {
            scores8<2>(pairs, kt, x, dim, sums);
            store(g, r, sums[0]), store(g, r + 1, sums[1]);
          } else {
            scores8<1>(pairs, kt, x, dim, sums);
            store(g, r, sums[0]);
          }
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
  // v in float32, converted once for every row of its head, 16 columns at a time, its keys in part order (`Parts`):
  // [N, D / 16, T, 16]. A row's key then costs a broadcast and two fused multiply-adds reading 64 contiguous bytes,
  // not a conversion of v's values again for each row.
  const int64_t chunks = dim / 16, tail = dim % 16;
  const Parts parts(total);
  const at::Tensor converted = at::empty({n * chunks * total * 16}, v.options().dtype(at::kFloat));
  float* vf = converted.data_ptr<float>();
  at::parallel_for(0, total, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t position = parts.position(t);
      for (int64_t head = 0; head < n; ++head) {  // a slot's heads one after another: one pool row
        const uint16_t* src = values.at(head, t);
        for (int64_t ci = 0; ci < chunks; ++ci) {
          float* dst = vf + ((head * chunks + ci) * total + position) * 16;
          _mm256_storeu_ps(dst, textgen_cpu::load8(src + ci * 16));
          _mm256_storeu_ps(dst + 8, textgen_cpu::load8(src + ci * 16 + 8));
        }
      }
    }
  });
  // Each part of each 16-column chunk, rows four at a time (`add_part`): on one thread 0.68-0.93x the time of each
  // row adding its keys in order of t into all four sums (benchmark/README.md, "prefix_reuse.py").
  each_run(n, rows, seq, total, window, BLOCK_ROWS, [&](int64_t head, int64_t r0, int64_t count, const int64_t* lo,
                                                      const int64_t* hi) {
    std::vector<float> probs(static_cast<size_t>(count * total));  // by position, as v's keys
    std::vector<__m256> sums(static_cast<size_t>(count * 8));  // row r, part p: columns 0-7 at 8r + 2p, 8-15 next
    int64_t begin[4][BLOCK_ROWS], end[4][BLOCK_ROWS];
    for (int64_t r = 0; r < count; ++r) {
      parts.gather(pp + (r0 + r) * total, probs.data() + r * total);
      for (int part = 0; part < 4; ++part) parts.run(part, lo[r], hi[r], begin[part][r], end[part][r]);
    }
    for (int64_t ci = 0; ci < chunks; ++ci) {
      const float* vc = vf + (head * chunks + ci) * total * 16;  // 16 columns, key after key in part order
      for (int part = 0; part < 4; ++part)
        for (int64_t r = 0; r < count; r += VALUE_ROWS) {
          const int group = static_cast<int>(std::min<int64_t>(VALUE_ROWS, count - r));
          const float* p[VALUE_ROWS];
          __m256 s[2 * VALUE_ROWS];
          for (int i = 0; i < group; ++i) p[i] = probs.data() + (r + i) * total;
          add_part(p, vc, begin[part] + r, end[part] + r, group, s);
          for (int i = 0; i < group; ++i) {
            sums[(r + i) * 8 + 2 * part] = s[2 * i];
            sums[(r + i) * 8 + 2 * part + 1] = s[2 * i + 1];
          }
        }
      for (int64_t r = 0; r < count; ++r) {
        const __m256* sr = sums.data() + r * 8;
        uint16_t* y = op + (r0 + r) * dim + ci * 16;
        textgen_cpu::store8(y, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(sr[0], sr[2]), sr[4]), sr[6]));
        textgen_cpu::store8(y + 8, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(sr[1], sr[3]), sr[5]), sr[7]));
      }
    }
    // A head size not a multiple of 16: its last columns one at a time, in the same order.
    for (int64_t r = 0; r < count; ++r)
      for (int64_t c = dim - tail; c < dim; ++c) {
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        for (int64_t t = lo[r]; t <= hi[r]; ++t) {
          float& sum = part[parts.part(t)];
          sum = std::fma(probs[r * total + parts.position(t)], textgen_cpu::bf16_to_float(values.at(head, t)[c]), sum);
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
