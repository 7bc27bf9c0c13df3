// Prefill attention through the paged KV pool on an AVX-512 CPU: every row of several query tokens in a step
// (prefills, prefill chunks, prefix-cache hits) in one call per layer, reading the keys and values where they lie
// in the pool. The torch path it replaces there (paged_attention.py, `_row`) gathers each row's keys and runs about
// ten small ops per row, whose copies and OpenMP waits took as long as the products (benchmark/README.md, "W2 on
// AVX-512"; the op's figures: "Prefill attention in one C++ call per layer").
//
// textgen::paged_prefill_attention(out, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, window)
//   writes out[cu[b]:cu[b + 1]] for every row b of at least two queries and leaves the other rows' tokens as they
//   are (decode rows are paged_decode_attention's). Shapes as paged_decode_attention's (decode_attention.cpp): q /
//   out [T, H, D] bfloat16 or float32 (q: any token and head strides; out contiguous), k_cache / v_cache
//   [N, S, Hkv, D] of q's dtype (contiguous or head-major, kv_pool.h), block_tables int32 [B, M], seq_lens int64
//   [B], cu_seqlens_q int64 [B + 1]. Query i of row b's n queries sits at position seq_lens[b] - n + i and sees the
//   positions up to it (window > 0: the last `window` of them). D a multiple of 32, at most 64 query heads a KV
//   head.
// shared_prefix_decode (namespace textgen_cpu, called by decode_attention.cpp's paged_decode_attention): the decode
//   rows of a step that share the first blocks of their tables, a group at a time, with the same tasks (below).
// textgen::paged_prefill_attention_built(dtype) -> bool: whether this build has the op's products for `dtype`:
//   float32 with AVX-512, bfloat16 with AVX512-BF16 too; the op refuses the others.
//
// bfloat16 rounds where transformers' eager attention rounds: the scaled query (`q * scale`) and the scores are
// rounded to bf16, the softmax takes torch's max, sum order (a shared task's, below: in the order of its keys) and
// e * (1 / sum) over those scores with the decode op's exp (`exp_nonpositive`, within about a float32 ulp of torch's
// vector exp, which made the softmax 1.7x slower here), the probabilities are rounded to bf16 and the values'
// weighted sum is rounded once. The two products are float32 sums of exact bf16 pair products (vdpbf16ps) in another
// order than oneDNN's, as the decode op's are.
// float32 rounds nowhere in between, as SDPA, whose flash kernel sums in yet another order.
//
// A task is one row's KV head and a block of its queries: up to 64 query rows (its queries times the query heads
// of the group), 16 to a vector lane group. Rows that begin with the same blocks (a prefix-cache hit's questions)
// share tasks where that fills lanes one row's queries would leave empty: the shared keys then come once, followed
// by each row's own, and each query sees the shared keys and its own row's (benchmark/README.md, "Prefill rows
// sharing a cached prefix"). Scores are computed key by key for all of them at once, a key's values
// (bf16: pairs) broadcast against the queries' laid out lane by lane (no transposition of the keys), into a
// key-major buffer, so that the softmax runs down the keys vertically, 16 queries at a time. Each block of query
// rows then sums the values with its accumulators in registers: in bf16 by pair products over keys interleaved two
// at a time once per task, in float32 straight from the pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "kv_pool.h"

namespace {

using namespace textgen_cpu;

bool built([[maybe_unused]] at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

// Query rows of a task at most: four lane groups of 16.
constexpr int64_t MAX_ROWS = 64;
// Keys ahead whose lines are asked for: the pool's slots scatter them, where the hardware prefetcher cannot follow.
constexpr int64_t AHEAD = 16;

#if defined(__AVX512F__)

// Queries [s0, s1) of row b.
struct Segment {
  int64_t b, s0, s1;
};

// One task of each KV head: up to MAX_ROWS query rows: some of one row's queries (prefix 0), or the queries of rows
// whose block tables begin with the same blocks (a prefix-cache hit's questions), positions [0, prefix) shared. A
// shared task's keys are the shared ones once, then each segment's own positions (from prefix to its last query's)
// in turn: each query sees the shared keys and its own row's up to its position. Its lanes are filled with the
// queries of several rows where one row's would leave some empty, and each shared key is read once for them all.
struct Task {
  std::vector<Segment> segments;
  int64_t prefix;
};

// A thread's scratch, reused from task to task.
struct Scratch {
  std::vector<int64_t> offsets;   // each key's element offset in the pool (its slot and the task's KV head)
  std::vector<__m512i> queries;   // [pairs][groups] (bf16: lane r of group g, query row 16g + r's pair i) or
                                  // [dim][groups] (float32)
  std::vector<float> scores;      // [keys][rows]: key-major, rows padded to whole groups; then the weights
  std::vector<__m512i> values;    // [keys / 2][dim / 16]: keys 2j, 2j + 1 interleaved column by column
  std::vector<int64_t> paired;    // the offsets of the keys `values` holds, in its order (bf16)
  std::vector<float> zeros;       // a key of zeros, for the keys past a tile's last
};

// acc[k][g] = the dots of the KT keys `key` (dim values) with the query rows of NG lane groups (`queries`, [dim or
// pairs][NG]); KT * NG <= 16 accumulators stay in registers. float32: fused multiply-adds.
template <int NG, int KT>
inline void score_tile(const __m512i* queries, const float* const* key, int64_t dim, __m512* acc) {
  for (int a = 0; a < NG * KT; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    __m512 q[NG];
    for (int g = 0; g < NG; ++g) q[g] = _mm512_castsi512_ps(_mm512_loadu_si512(queries + d * NG + g));
    for (int k = 0; k < KT; ++k) {
      const __m512 kv = _mm512_set1_ps(key[k][d]);
      for (int g = 0; g < NG; ++g) acc[k * NG + g] = _mm512_fmadd_ps(kv, q[g], acc[k * NG + g]);
    }
  }
}

#if defined(__AVX512BF16__)
// bfloat16: pair products (vdpbf16ps), a key's pairs read as uint32.
template <int NG, int KT>
inline void score_tile(const __m512i* queries, const uint16_t* const* key, int64_t dim, __m512* acc) {
  for (int a = 0; a < NG * KT; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim / 2; ++i) {
    __m512bh q[NG];
    for (int g = 0; g < NG; ++g) q[g] = (__m512bh)_mm512_loadu_si512(queries + i * NG + g);
    for (int k = 0; k < KT; ++k) {
      uint32_t pair;
      std::memcpy(&pair, key[k] + 2 * i, sizeof(pair));
      const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int g = 0; g < NG; ++g) acc[k * NG + g] = _mm512_dpbf16_ps(acc[k * NG + g], kv, q[g]);
    }
  }
}
#endif

// The task's scores: scores[t][r] = q_r . k_t (bf16: rounded to bf16) where query row r sees key t (lo[r] <= first
// + t <= hi[r], or first + t within seen_by_all's range below), else -inf; top[g] = each row's largest. Keys
// [seen_by_all[2g], seen_by_all[2g + 1]], which every row of group g sees, are stored without a mask.
template <typename T, int NG>
void task_scores(const T* K, const int64_t* offsets, int64_t keys, int64_t first, int64_t dim, const __m512i* queries,
                 const __m512i* lo, const __m512i* hi, const int64_t* seen_by_all, const T* zeros, float* scores,
                 __m512* top) {
  constexpr int KT = 16 / NG;
  constexpr int64_t width = NG * 16;
  const __m512 none = _mm512_set1_ps(-INFINITY);
  // Each group's largest so far in a register: through `top`, which may alias `scores` for all the compiler knows,
  // every key's max was a load and a store (benchmark/README.md, "Where issue 42 stands (2026-12-07 session 3)").
  __m512 best[NG];
  for (int g = 0; g < NG; ++g) best[g] = none;
  __m512 acc[NG * KT];
  const T* key[KT];
  for (int64_t t = 0; t < keys; t += KT) {
    const int n = static_cast<int>(std::min<int64_t>(KT, keys - t));
    for (int64_t u = t + AHEAD; u < std::min(t + KT + AHEAD, keys); ++u) {
      prefetch_lines(K + offsets[u], dim * static_cast<int64_t>(sizeof(T)));
    }
    for (int k = 0; k < KT; ++k) key[k] = k < n ? K + offsets[t + k] : zeros;
    score_tile<NG, KT>(queries, key, dim, acc);
    for (int g = 0; g < NG; ++g) {
      for (int k = 0; k < n; ++k) {
        __m512 x = round_as(T{}, acc[k * NG + g]);
        if (first + t + k < seen_by_all[2 * g] || first + t + k > seen_by_all[2 * g + 1]) {
          const __m512i position = _mm512_set1_epi32(static_cast<int>(first + t + k));
          const __mmask16 seen = _mm512_cmple_epi32_mask(lo[g], position) & _mm512_cmple_epi32_mask(position, hi[g]);
          x = _mm512_mask_blend_ps(seen, none, x);
        }
        best[g] = _mm512_max_ps(best[g], x);
        _mm512_storeu_ps(scores + (t + k) * width + g * 16, x);
      }
    }
  }
  for (int g = 0; g < NG; ++g) top[g] = best[g];
}

// task_scores for a task of `groups` lane groups (1 to 4).
template <typename T>
auto scores_for(int64_t groups) {
  using Scores = void (*)(const T*, const int64_t*, int64_t, int64_t, int64_t, const __m512i*, const __m512i*,
                          const __m512i*, const int64_t*, const T*, float*, __m512*);
  constexpr Scores by_groups[4] = {task_scores<T, 1>, task_scores<T, 2>, task_scores<T, 3>, task_scores<T, 4>};
  return by_groups[groups - 1];
}

#if defined(__AVX512BF16__)
// The probabilities e * inv of the lane group at column g, rounded to bf16, as pairs of consecutive keys (uint32),
// in place: pair j lands on key j's row, which keys 2j and 2j + 1 (read first) are at or past.
inline void pack_pairs(float* scores, int64_t keys, int64_t width, int64_t g, __m512 inv) {
  // vpermw: bf16 lanes (a0 .. a15, b0 .. b15) of cvtne2ps(b, a) to the pairs (a0, b0), (a1, b1), ...
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  auto* weights = reinterpret_cast<uint32_t*>(scores);
  for (int64_t t = 0; t < keys; t += 2) {
    const __m512 p0 = _mm512_mul_ps(_mm512_loadu_ps(scores + t * width + g), inv);
    const __m512 p1 = t + 1 < keys ? _mm512_mul_ps(_mm512_loadu_ps(scores + (t + 1) * width + g), inv)
                                   : _mm512_setzero_ps();
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    _mm512_storeu_si512(weights + (t / 2) * width + g, _mm512_permutexvar_epi16(interleave, packed));
  }
}
#else
// Never called: bf16 tasks run only where AVX512-BF16 is built.
inline void pack_pairs(float*, int64_t, int64_t, int64_t, __m512) {}
#endif

// The lane group at column g's probabilities e * inv, over the e's in place: in float32 as they are; in bf16 rounded,
// as pairs of consecutive keys (pack_pairs).
template <typename T>
void normalize(float* scores, int64_t keys, int64_t width, int64_t g, __m512 inv) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t t = 0; t < keys; ++t) {
      _mm512_storeu_ps(scores + t * width + g, _mm512_mul_ps(_mm512_loadu_ps(scores + t * width + g), inv));
    }
  } else {
    pack_pairs(scores, keys, width, g, inv);
  }
}

// The softmax of every query row over the task's keys (positions first, first + 1, ...), down the key-major scores,
// 16 rows at a time, as torch's softmax of the row's `total` columns: exp(x - max), the sum as torch's (16 lane
// sums of the columns t = lane mod 16 in column order, masked columns adding exact zeros, folded 8-4-2-1 as
// fold_add folds; serially when total < 16; here each residue's sums are one vector), and the probabilities
// e * (1 / sum), which overwrite the scores: in float32 as they are; in bf16 rounded, as pairs of consecutive keys
// (weights[j][r], uint32, `width` a key pair: row r's probabilities of keys 2j and 2j + 1).
template <typename T>
void task_softmax(float* scores, int64_t keys, int64_t width, int64_t first, int64_t total, const __m512* top) {
  const __m512 none = _mm512_set1_ps(-INFINITY);
  for (int64_t g = 0; g < width; g += 16) {
    const __m512 shift = top[g / 16];
    __m512 sums[16];
    for (auto& x : sums) x = _mm512_setzero_ps();
    auto exp_at = [&](int64_t t) {
      float* at = scores + t * width + g;
      const __m512 x = _mm512_loadu_ps(at);
      const __mmask16 seen = _mm512_cmp_ps_mask(x, none, _CMP_NEQ_OQ);
      const __m512 e = _mm512_maskz_mov_ps(seen, exp_nonpositive(_mm512_sub_ps(x, shift)));
      _mm512_storeu_ps(at, e);
      return e;
    };
    __m512 sum;
    if (total < 16) {
      sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < keys; ++t) sum = _mm512_add_ps(sum, exp_at(t));
    } else {
      // Positions in runs of 16 aligned on 16, so that each residue's sum is a register of its own.
      for (int64_t c = first - first % 16; c < first + keys; c += 16) {
        if (c >= first && c + 16 <= first + keys) {
          for (int j = 0; j < 16; ++j) sums[j] = _mm512_add_ps(sums[j], exp_at(c + j - first));
          continue;
        }
        for (int j = 0; j < 16; ++j) {  // the first and last runs
          const int64_t t = c + j - first;
          if (t >= 0 && t < keys) sums[j] = _mm512_add_ps(sums[j], exp_at(t));
        }
      }
      for (int j = 0; j < 8; ++j) sums[j] = _mm512_add_ps(sums[j], sums[j + 8]);
      for (int j = 0; j < 4; ++j) sums[j] = _mm512_add_ps(sums[j], sums[j + 4]);
      for (int j = 0; j < 2; ++j) sums[j] = _mm512_add_ps(sums[j], sums[j + 2]);
      sum = _mm512_add_ps(sums[0], sums[1]);
    }
    normalize<T>(scores, keys, width, g, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
  }
}

#if defined(__AVX512BF16__)
// Keys 2j and 2j + 1's values interleaved column by column (vpunpck{l,h}wd within 128-bit lanes: the paired
// order, cpu_ops.h), zeros standing in for a key past the last.
void task_values(const uint16_t* V, const int64_t* offsets, int64_t keys, int64_t dim, __m512i* values) {
  const int64_t vectors = dim / 16;
  for (int64_t t = 0; t < keys; t += 2) {
    for (int64_t u = t + AHEAD; u < std::min(t + 2 + AHEAD, keys); ++u) prefetch_lines(V + offsets[u], dim * 2);
    const uint16_t* v0 = V + offsets[t];
    const uint16_t* v1 = t + 1 < keys ? V + offsets[t + 1] : nullptr;
    __m512i* out = values + (t / 2) * vectors;
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512i x0 = _mm512_loadu_si512(v0 + d);
      const __m512i x1 = v1 ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512();
      out[d / 16] = _mm512_unpacklo_epi16(x0, x1);
      out[d / 16 + 1] = _mm512_unpackhi_epi16(x0, x1);
    }
  }
}
#endif

// Query rows a block of the values' sums takes, and the columns: 16 accumulators in registers.
constexpr int64_t BLOCK_ROWS = 8;
constexpr int64_t BLOCK_COLUMNS = 32;

// float32: BLOCK_ROWS query rows' weighted sums (probabilities p [keys][width]) of the values' columns [c, c + 32)
// over keys [t0, t1), read in the pool at `offsets`; written to sums[row][32].
inline void value_block(const float* p, int64_t width, const float* V, const int64_t* offsets, int64_t c, int64_t t0,
                        int64_t t1, float* sums) {
  __m512 acc[BLOCK_ROWS][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t t = t0; t < t1; ++t) {
    if (t + AHEAD < t1) prefetch_lines(V + offsets[t + AHEAD] + c, BLOCK_COLUMNS * 4);
    const __m512 v0 = _mm512_loadu_ps(V + offsets[t] + c), v1 = _mm512_loadu_ps(V + offsets[t] + c + 16);
    for (int64_t r = 0; r < BLOCK_ROWS; ++r) {
      const __m512 w = _mm512_set1_ps(p[t * width + r]);
      acc[r][0] = _mm512_fmadd_ps(w, v0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w, v1, acc[r][1]);
    }
  }
  for (int64_t r = 0; r < BLOCK_ROWS; ++r) {
    _mm512_storeu_ps(sums + r * BLOCK_COLUMNS, acc[r][0]);
    _mm512_storeu_ps(sums + r * BLOCK_COLUMNS + 16, acc[r][1]);
  }
}

#if defined(__AVX512BF16__)
// bfloat16: BLOCK_ROWS query rows' weighted sums of the values' columns [c, c + 32) over key pairs [j0, j1), by pair
// products; written to sums[row][32] in the paired order. (Four rows of 64 columns ran as fast.)
inline void value_block(const uint32_t* weights, int64_t width, const __m512i* values, int64_t vectors, int64_t c,
                        int64_t j0, int64_t j1, float* sums) {
  __m512 acc[BLOCK_ROWS][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(values + j * vectors + c / 16);
    const __m512bh v1 = (__m512bh)_mm512_loadu_si512(values + j * vectors + c / 16 + 1);
    for (int64_t r = 0; r < BLOCK_ROWS; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[j * width + r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, v0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w, v1);
    }
  }
  for (int64_t r = 0; r < BLOCK_ROWS; ++r) {
    _mm512_storeu_ps(sums + r * BLOCK_COLUMNS, acc[r][0]);
    _mm512_storeu_ps(sums + r * BLOCK_COLUMNS + 16, acc[r][1]);
  }
}
#endif

// The values' side of a task before its blocks' sums: bf16 interleaves its keys' values once (task_values);
// float32 reads them in the pool. The pairs of the leading keys the thread's last task had too are kept: a KV head's
// tasks over one cached prefix (or one long row's query blocks) follow one another, and each interleaved the same
// shared keys again (the scratch lives for one call, one layer's pool).
template <typename T>
void prepare_values([[maybe_unused]] Scratch& scratch, [[maybe_unused]] const T* V,
                    [[maybe_unused]] const int64_t* offsets, [[maybe_unused]] int64_t keys,
                    [[maybe_unused]] int64_t dim) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    const auto& paired = scratch.paired;
    const int64_t limit = std::min<int64_t>(keys, static_cast<int64_t>(paired.size()));
    int64_t kept = 0;
    while (kept < limit && paired[kept] == offsets[kept]) ++kept;
    kept -= kept % 2;  // whole pairs
    scratch.values.resize((keys + 1) / 2 * (dim / 16));
    task_values(V, offsets + kept, keys - kept, dim, scratch.values.data() + kept / 2 * (dim / 16));
    scratch.paired.resize(keys);  // its first `kept` already hold these offsets
    std::copy(offsets + kept, offsets + keys, scratch.paired.begin() + kept);
  }
#endif
}

// BLOCK_ROWS rows' weighted sums from row r0 of the task's weights, over keys [t0, t1) and the values' columns
// [c, c + 32), to sums (value_block's; in bf16 in the paired order).
template <typename T>
void sum_block(const Scratch& scratch, [[maybe_unused]] const T* V, [[maybe_unused]] const int64_t* offsets,
               int64_t width, [[maybe_unused]] int64_t dim, int64_t r0, int64_t c, int64_t t0, int64_t t1,
               float* sums) {
  if constexpr (std::is_same_v<T, uint16_t>) {
#if defined(__AVX512BF16__)
    value_block(reinterpret_cast<const uint32_t*>(scratch.scores.data()) + r0, width, scratch.values.data(), dim / 16,
                c, t0 / 2, (t1 + 1) / 2, sums);
#endif
  } else {
    value_block(scratch.scores.data() + r0, width, V, offsets, c, t0, t1, sums);
  }
}

// Lane r of the queries' layout ([steps][groups] of 16 lanes): q (one head) scaled; in bf16 rounded to bf16 and
// paired (step i: values 2i, 2i + 1), in float32 value i.
template <typename T>
inline void set_lane(uint32_t* lanes, int64_t groups, int64_t r, const T* q, int64_t steps, float scale) {
  for (int64_t i = 0; i < steps; ++i) {
    uint32_t lane;
    if constexpr (std::is_same_v<T, uint16_t>) {
      const uint32_t even = float_to_bf16(bf16_to_float(q[2 * i]) * scale);
      lane = even | static_cast<uint32_t>(float_to_bf16(bf16_to_float(q[2 * i + 1]) * scale)) << 16;
    } else {
      const float scaled = q[i] * scale;
      std::memcpy(&lane, &scaled, sizeof(lane));
    }
    lanes[(i * groups + r / 16) * 16 + r % 16] = lane;
  }
}

// The batch's rows: their block tables, lengths (positions seen by each row's last query) and queries (cu: row b's
// from token cu[b]).
struct Rows {
  const int32_t* tables;
  int64_t max_blocks;
  const int64_t* lengths;
  const int64_t* cu;
  int64_t queries(int64_t b) const { return cu[b + 1] - cu[b]; }
  int64_t position(int64_t b, int64_t s) const { return lengths[b] - queries(b) + s; }  // of query s
  const int32_t* table(int64_t b) const { return tables + b * max_blocks; }
  int64_t end(const Segment& seg) const { return position(seg.b, seg.s1 - 1) + 1; }  // its last query sees [0, end)
};

// One task, of KV head `head`. Returns false (writing nothing) where a row's block table names a block outside the
// pool.
template <typename T>
bool run_task(const Task& task, int64_t head, const Rows& batch, const T* Q, int64_t q_token, int64_t q_head,
              const T* K, const T* V, const Pool& pool, int64_t group, int64_t dim, int64_t window, float scale,
              Scratch& scratch, T* out, int64_t out_token) {
  constexpr bool bf16 = std::is_same_v<T, uint16_t>;
  int64_t queries = 0;
  for (const Segment& seg : task.segments) queries += seg.s1 - seg.s0;
  const int64_t rows = queries * group, groups = (rows + 15) / 16, width = groups * 16, prefix = task.prefix;
  // The keys: one row's from its first query's first position seen (lo) to its last query's (hi); or the shared
  // ones, then each segment's own positions (from prefix to its last query's), `first` 0.
  const Segment& one = task.segments[0];
  int64_t first = 0, keys = 0, total = 0;
  auto& offsets = scratch.offsets;
  if (prefix == 0) {
    const int64_t hi0 = batch.position(one.b, one.s0), last = batch.position(one.b, one.s1 - 1);
    first = window > 0 ? std::max<int64_t>(0, hi0 - window + 1) : 0;
    keys = last - first + 1;
    total = batch.lengths[one.b];
    offsets.resize(keys);
    if (!pool_offsets(batch.table(one.b), first, keys, pool, head, offsets.data())) {
      return false;
    }
  } else {
    keys = prefix;
    for (const Segment& seg : task.segments) keys += batch.end(seg) - prefix;
    total = keys;
    offsets.resize(keys);
    if (!pool_offsets(batch.table(one.b), 0, prefix, pool, head, offsets.data())) {
      return false;
    }
    int64_t at = prefix;
    for (const Segment& seg : task.segments) {
      const int64_t own = batch.end(seg) - prefix;
      if (!pool_offsets(batch.table(seg.b), prefix, own, pool, head, offsets.data() + at)) {
        return false;
      }
      at += own;
    }
  }
  // Row r = i * group + g: the task's query i (segment by segment), query head head * group + g; it sees positions
  // [lo[r], hi[r]] (in a shared task, indices of its keys: its own row's, besides the shared ones [0, prefix)), and
  // its output is token[r]'s. Padding rows see every key with a zero query.
  // Lane r of group g in step i: bf16, the pair (2i, 2i + 1) of the scaled query rounded to bf16; float32, value i.
  const int64_t steps = bf16 ? dim / 2 : dim;
  scratch.queries.assign(steps * groups, _mm512_setzero_si512());
  auto* lanes = reinterpret_cast<uint32_t*>(scratch.queries.data());
  alignas(64) int32_t lo[MAX_ROWS], hi[MAX_ROWS];
  int64_t token[MAX_ROWS];
  int64_t r = 0, own_keys = prefix;  // a shared task's segment's own keys start at own_keys
  for (const Segment& seg : task.segments) {
    for (int64_t s = seg.s0; s < seg.s1; ++s) {
      const int64_t position = batch.position(seg.b, s);
      for (int64_t g = 0; g < group; ++g, ++r) {
        const int64_t from = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
        hi[r] = static_cast<int32_t>(prefix == 0 ? position : own_keys + position - prefix);
        lo[r] = static_cast<int32_t>(prefix == 0 ? from : own_keys);
        token[r] = batch.cu[seg.b] + s;
        set_lane(lanes, groups, r, Q + token[r] * q_token + (head * group + g) * q_head, steps, scale);
      }
    }
    own_keys += batch.end(seg) - prefix;
  }
  for (; r < width; ++r) {
    lo[r] = static_cast<int32_t>(first);
    hi[r] = static_cast<int32_t>(first + keys - 1);
  }
  __m512i lo16[4], hi16[4];
  int64_t seen_by_all[8];
  for (int64_t g = 0; g < groups; ++g) {
    lo16[g] = _mm512_load_si512(lo + 16 * g);
    hi16[g] = _mm512_load_si512(hi + 16 * g);
    // A shared task's rows all see the shared keys; one row's see what all of its queries see.
    seen_by_all[2 * g] = prefix > 0 ? 0 : *std::max_element(lo + 16 * g, lo + 16 * g + 16);
    seen_by_all[2 * g + 1] = prefix > 0 ? prefix - 1 : *std::min_element(hi + 16 * g, hi + 16 * g + 16);
  }
  __m512 top[4];
  scratch.scores.resize(keys * width);
  scratch.zeros.assign(dim, 0.f);
  scores_for<T>(groups)(K, offsets.data(), keys, first, dim, scratch.queries.data(), lo16, hi16, seen_by_all,
                        reinterpret_cast<const T*>(scratch.zeros.data()), scratch.scores.data(), top);
  task_softmax<T>(scratch.scores.data(), keys, width, first, total, top);
  prepare_values(scratch, V, offsets.data(), keys, dim);
  // Each block of rows sums the keys its rows see at all (a row's weight is 0 past its own keys). The last block may
  // take padding rows (their weights finite), whose sums are not written.
  alignas(64) float sums[BLOCK_ROWS * BLOCK_COLUMNS];
  for (int64_t r0 = 0; r0 < rows; r0 += BLOCK_ROWS) {
    const int64_t r1 = std::min(rows, r0 + BLOCK_ROWS);
    const int64_t t0 = prefix > 0 ? 0 : lo[r0] - first, t1 = *std::max_element(hi + r0, hi + r1) - first + 1;
    for (int64_t c = 0; c < dim; c += BLOCK_COLUMNS) {
      sum_block(scratch, V, offsets.data(), width, dim, r0, c, t0, t1, sums);
      for (int64_t i = r0; i < r1; ++i) {
        T* o = out + token[i] * out_token + (head * group + i % group) * dim + c;
        const float* row = sums + (i - r0) * BLOCK_COLUMNS;
        __m512 first = _mm512_load_ps(row), second = _mm512_load_ps(row + 16);
        if constexpr (bf16) unpair(first, second);
        store16(o, first, first_lanes(16));
        store16(o + 16, second, first_lanes(16));
      }
    }
  }
  return true;
}

// Decode rows that share the first blocks of their block tables (a prefix-cache hit's prompt): rows of a group are
// the lanes of one task per KV head over the shared keys, as a prefill's queries are, so each shared key is read
// and multiplied once for up to 64 query rows; each row's own keys after them are summed row by row.
struct SharedGroup {
  std::vector<int64_t> rows;  // the batch rows of this chunk of a group
  int64_t prefix;             // positions [0, prefix) lie in the same slots for all of them
};

// The decode op's per-row work (decode_attention.cpp, paged_row) for a chunk of rows sharing `prefix` positions,
// KV head `head`. Rounds as it does (query, scores and probabilities to bf16 in bf16; the sums in float32).
template <typename T>
bool shared_task(const SharedGroup& grp, int64_t head, const T* Q, int64_t q_row, int64_t q_head, const T* K,
                 const T* V, const int32_t* tables, int64_t max_blocks, const int64_t* lengths, const Pool& pool,
                 int64_t group, int64_t dim, float scale, Scratch& scratch, std::vector<float>& own,
                 std::vector<int64_t>& own_offsets, T* out) {
  constexpr bool bf16 = std::is_same_v<T, uint16_t>;
  const int64_t count = static_cast<int64_t>(grp.rows.size()), rows = count * group;
  const int64_t groups = (rows + 15) / 16, width = groups * 16, keys = grp.prefix;
  auto& offsets = scratch.offsets;
  offsets.resize(keys);
  if (!pool_offsets(tables + grp.rows[0] * max_blocks, 0, keys, pool, head, offsets.data())) {
    return false;
  }
  // Each row's own keys, [prefix, length).
  int64_t longest = 0;
  for (int64_t i = 0; i < count; ++i) longest = std::max(longest, lengths[grp.rows[i]] - keys);
  own_offsets.assign(count * longest, 0);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t b = grp.rows[i];
    if (!pool_offsets(tables + b * max_blocks, keys, lengths[b] - keys, pool, head,
                      own_offsets.data() + i * longest)) {
      return false;
    }
  }
  const int64_t steps = bf16 ? dim / 2 : dim;
  scratch.queries.assign(steps * groups, _mm512_setzero_si512());
  auto* lanes = reinterpret_cast<uint32_t*>(scratch.queries.data());
  std::vector<float>& query = scratch.zeros;  // row r's scaled (bf16: rounded) query as floats, then zeros
  query.assign(rows * dim + dim, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* q = Q + grp.rows[r / group] * q_row + (head * group + r % group) * q_head;
    set_lane(lanes, groups, r, q, steps, scale);
    for (int64_t d = 0; d < dim; ++d) query[r * dim + d] = round_as(T{}, to_float(q[d]) * scale);
  }
  const T* zeros = reinterpret_cast<const T*>(query.data() + rows * dim);
  alignas(64) int32_t lo[MAX_ROWS] = {}, hi[MAX_ROWS];
  std::fill(hi, hi + MAX_ROWS, static_cast<int32_t>(keys - 1));
  __m512i lo16[4], hi16[4];
  const int64_t seen_by_all[8] = {0, keys - 1, 0, keys - 1, 0, keys - 1, 0, keys - 1};
  for (int64_t g = 0; g < groups; ++g) {
    lo16[g] = _mm512_load_si512(lo + 16 * g);
    hi16[g] = _mm512_load_si512(hi + 16 * g);
  }
  __m512 top[4];
  scratch.scores.resize(keys * width);
  scores_for<T>(groups)(K, offsets.data(), keys, 0, dim, scratch.queries.data(), lo16, hi16, seen_by_all, zeros,
                        scratch.scores.data(), top);
  // The own keys' scores, row by row, and each row's largest score of all.
  own.assign(rows * longest, 0.f);
  alignas(64) float largest[MAX_ROWS];
  for (int64_t g = 0; g < groups; ++g) _mm512_store_ps(largest + 16 * g, top[g]);
  const int64_t key_bytes = dim * static_cast<int64_t>(sizeof(T));
  // The own keys lie in blocks of their own, scattered over the pool: each row asks for its next row's first ones
  // and for its own AHEAD keys ahead.
  auto ask = [&](const T* base, int64_t i, int64_t t0, int64_t t1) {
    const int64_t mine = i < count ? lengths[grp.rows[i]] - keys : 0;
    for (int64_t t = t0; t < std::min(t1, mine); ++t) prefetch_lines(base + own_offsets[i * longest + t], key_bytes);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group, mine = lengths[grp.rows[i]] - keys;
    if (r % group == 0) ask(K, i + 1, 0, AHEAD);
    if (r == 0) ask(K, 0, 0, AHEAD);
    const float* query_r = query.data() + r * dim;
    for (int64_t t0 = 0; t0 < mine; t0 += 16) {  // 16 keys at a time, their sums folded together (fold16)
      const int64_t n = std::min<int64_t>(16, mine - t0);
      if (r % group == 0) ask(K, i, t0 + AHEAD, t0 + 16 + AHEAD);
      __m512 acc[16];
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 qd = _mm512_loadu_ps(query_r + d);
        for (int64_t u = 0; u < 16; ++u) {
          const T* key = u < n ? K + own_offsets[i * longest + t0 + u] : zeros;
          acc[u] = _mm512_fmadd_ps(qd, load16(key + d), acc[u]);
        }
      }
      const __mmask16 m = first_lanes(n);
      const __m512 x = round_as(T{}, fold16(acc));
      store16(own.data() + r * longest + t0, x, m);
      largest[r] = std::max(largest[r], _mm512_mask_reduce_max_ps(m, x));
    }
  }
  // exp(x - max) over both parts; the sums; the probabilities e * (1 / sum).
  alignas(64) float inverse[MAX_ROWS];
  for (int64_t g = 0; g < width; g += 16) {
    const __m512 shift = _mm512_load_ps(largest + g);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < keys; ++t) {
      float* at = scratch.scores.data() + t * width + g;
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(at), shift));
      _mm512_storeu_ps(at, e);
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_store_ps(inverse + g, sum);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t mine = lengths[grp.rows[r / group]] - keys;
    float* e = own.data() + r * longest;
    for (int64_t t = 0; t < mine; t += 16) {
      const __mmask16 m = first_lanes(mine - t);
      const __m512 x = exp_nonpositive(_mm512_sub_ps(load16(e + t, m), _mm512_set1_ps(largest[r])));
      store16(e + t, x, m);
      inverse[r] += _mm512_mask_reduce_add_ps(m, x);
    }
  }
  for (int64_t g = 0; g < width; g += 16) {  // every lane's sum to its inverse, padding lanes' too
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_load_ps(inverse + g));
    _mm512_store_ps(inverse + g, inv);
    normalize<T>(scratch.scores.data(), keys, width, g, inv);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* e = own.data() + r * longest;
    for (int64_t t = 0; t < lengths[grp.rows[r / group]] - keys; ++t) e[t] = round_as(T{}, e[t] * inverse[r]);
  }
  prepare_values(scratch, V, offsets.data(), keys, dim);
  alignas(64) float sums[BLOCK_ROWS * BLOCK_COLUMNS];
  for (int64_t r0 = 0; r0 < rows; r0 += BLOCK_ROWS) {
    const int64_t r1 = std::min(rows, r0 + BLOCK_ROWS);
    for (int64_t c = 0; c < dim; c += BLOCK_COLUMNS) {
      sum_block(scratch, V, offsets.data(), width, dim, r0, c, 0, keys, sums);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t i = r / group, mine = lengths[grp.rows[i]] - keys;
        const float* row = sums + (r - r0) * BLOCK_COLUMNS;
        __m512 a0 = _mm512_load_ps(row), a1 = _mm512_load_ps(row + 16);
        if constexpr (bf16) unpair(a0, a1);
        if ((r + 1) % group == 0) ask(V + c, i + 1, 0, AHEAD);
        for (int64_t t = 0; t < mine; ++t) {
          if (r % group == 0) ask(V + c, i, t + AHEAD, t + AHEAD + 1);
          const T* v = V + own_offsets[i * longest + t] + c;
          const __m512 p = _mm512_set1_ps(own[r * longest + t]);
          a0 = _mm512_fmadd_ps(p, load16(v), a0);
          a1 = _mm512_fmadd_ps(p, load16(v + 16), a1);
        }
        T* o = out + grp.rows[i] * group * pool.kv_heads * dim + (head * group + r % group) * dim + c;
        store16(o, a0, first_lanes(16));
        store16(o + 16, a1, first_lanes(16));
      }
    }
  }
  return true;
}
#endif  // __AVX512F__

#if defined(__AVX512F__)
// Rows share tasks over a cached prefix (shared_tasks, shared_prefix_decode) where they share at least this many
// positions, whole blocks from their first: prefill rows two or more, decode rows four or more.
constexpr int64_t SHARED_MIN_PREFIX = 64;
constexpr int64_t SHARED_PREFILL_ROWS = 2;
constexpr int64_t SHARED_DECODE_ROWS = 4;

// Rows order[begin, end), whose block tables begin with the same block, and the positions [0, prefix) they all hold
// in the same slots: the blocks they have in common from the first on, and no more than any of them sees.
struct SharedRun {
  size_t begin, end;
  int64_t prefix;
};

// `order` (the rows that may share) sorted by their first block, and its runs of at least `min_rows` rows sharing at
// least SHARED_MIN_PREFIX positions. seen(b): the positions every query of row b sees, [0, seen(b)).
template <typename Seen>
std::vector<SharedRun> shared_runs(std::vector<int64_t>& order, const int32_t* tables, int64_t max_blocks,
                                   int64_t block_size, int64_t min_rows, const Seen& seen) {
  auto table = [&](int64_t b) { return tables + b * max_blocks; };
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return std::make_pair(table(a)[0], a) < std::make_pair(table(b)[0], b); });
  std::vector<SharedRun> runs;
  for (size_t i = 0; i < order.size();) {
    size_t j = i + 1;
    while (j < order.size() && table(order[j])[0] == table(order[i])[0]) ++j;
    if (static_cast<int64_t>(j - i) >= min_rows) {
      int64_t shortest = seen(order[i]), common = 0;
      for (size_t k = i; k < j; ++k) shortest = std::min(shortest, seen(order[k]));
      while (common * block_size < shortest) {
        bool same = true;
        for (size_t k = i + 1; k < j && same; ++k) same = table(order[k])[common] == table(order[i])[common];
        if (!same) break;
        ++common;
      }
      const int64_t prefix = std::min(common * block_size, shortest);
      if (prefix >= SHARED_MIN_PREFIX) runs.push_back({i, j, prefix});
    }
    i = j;
  }
  return runs;
}

// The tasks (head 0) of the rows of several queries that begin with the same blocks, a run of them at a time, their
// queries in chunks of `per_task`: one shared task a chunk where that is estimated cheaper (lane groups times keys)
// than the chunk's segments apart, else a task a segment. The rows whose tasks these are are marked in `taken`.
void shared_tasks(const Rows& batch, int64_t rows, int64_t block_size, int64_t per_task, int64_t group,
                  std::vector<Task>& tasks, std::vector<uint8_t>& taken) {
  // Row b's first query sees its positions [0, seen_by_all(b)): what every query of it sees.
  auto seen_by_all = [&](int64_t b) { return batch.position(b, 0) + 1; };
  std::vector<int64_t> order;
  for (int64_t b = 0; b < rows; ++b) {
    if (batch.queries(b) > 1 && seen_by_all(b) >= SHARED_MIN_PREFIX) order.push_back(b);
  }
  auto groups_of = [&](int64_t queries) { return (queries * group + 15) / 16; };
  for (const SharedRun& run :
       shared_runs(order, batch.tables, batch.max_blocks, block_size, SHARED_PREFILL_ROWS, seen_by_all)) {
    // Chunks of the run's queries, row after row; each chunk's cost both ways.
    const int64_t prefix = run.prefix;
    std::vector<Segment> chunk;
    int64_t filled = 0;
    auto close = [&]() {
      int64_t own = 0, apart = 0;
      for (const Segment& seg : chunk) {
        const int64_t keys = batch.end(seg);  // of the segment's task apart
        own += keys - prefix;
        apart += groups_of(seg.s1 - seg.s0) * keys;
      }
      if (groups_of(filled) * (prefix + own) < apart) {
        tasks.push_back({chunk, prefix});
      } else {
        for (const Segment& seg : chunk) tasks.push_back({{seg}, 0});
      }
      for (const Segment& seg : chunk) taken[seg.b] = 1;
      chunk.clear();
      filled = 0;
    };
    for (size_t k = run.begin; k < run.end; ++k) {
      const int64_t b = order[k], n = batch.queries(b);
      for (int64_t s0 = 0; s0 < n;) {
        const int64_t s1 = std::min(n, s0 + per_task - filled);
        chunk.push_back({b, s0, s1});
        filled += s1 - s0;
        s0 = s1;
        if (filled == per_task) close();
      }
    }
    if (filled > 0) close();
  }
}

// Every task of the step's rows of several queries, over the threads.
template <typename T>
void run_tasks(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const Pool& pool, const at::Tensor& block_tables, const int64_t* lengths, const int64_t* cu,
               double scale, int64_t window) {
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = pool.kv_heads, rows = block_tables.size(0);
  const int64_t group = heads / kv_heads, per_task = std::max<int64_t>(1, MAX_ROWS / group);
  const int64_t block_size = pool.block_size;
  const Rows batch{block_tables.data_ptr<int32_t>(), block_tables.size(1), lengths, cu};
  // Each KV head's tasks: rows sharing a cached prefix together where that pays (not under a window, whose rows do
  // not all see the shared keys), the others a row at a time.
  std::vector<Task> plan;
  std::vector<uint8_t> taken(rows, 0);
  if (window == 0) shared_tasks(batch, rows, block_size, per_task, group, plan, taken);
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t n = batch.queries(b);
    for (int64_t s0 = 0; n > 1 && !taken[b] && s0 < n; s0 += per_task) {
      plan.push_back({{{b, s0, std::min(n, s0 + per_task)}}, 0});
    }
  }
  const auto* Q = reinterpret_cast<const T*>(q.data_ptr());
  const auto* K = reinterpret_cast<const T*>(k_cache.data_ptr());
  const auto* V = reinterpret_cast<const T*>(v_cache.data_ptr());
  auto* O = reinterpret_cast<T*>(out.data_ptr());
  const int64_t per_head = static_cast<int64_t>(plan.size()), task_count = per_head * kv_heads;
  if (task_count == 0) return;
  bool bad_block = false;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const FlushDenormals flush;
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < task_count; ++i) {
      // Head by head: rows sharing a cached prefix read the same keys and values one task after another, while they
      // are in cache.
      if (!run_task<T>(plan[i % per_head], i / per_head, batch, Q, q.stride(0), q.stride(1), K, V, pool, group, dim,
                       window, static_cast<float>(scale), scratch, O, heads * dim)) {
#pragma omp atomic write
        bad_block = true;
      }
    }
  }
  TORCH_CHECK(!bad_block, "paged_prefill_attention: a block table names a block outside the pool");
}
#endif

void paged_prefill_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& cu_seqlens_q, [[maybe_unused]] double scale, int64_t window) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_prefill_attention: out and the caches must have q's dtype");
  TORCH_CHECK(built(dtype), "paged_prefill_attention: this build has no products for ", dtype,
              " (float32 takes AVX-512, bfloat16 AVX512-BF16 too)");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1,
              "paged_prefill_attention: q must be [T, H, D] with unit head_dim stride");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(),
              "paged_prefill_attention: out must be contiguous, of q's shape");
  [[maybe_unused]] const Pool pool = pool_of(k_cache, v_cache, "paged_prefill_attention");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "paged_prefill_attention: block_tables must be contiguous int32 [B, M]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  cu_seqlens_q.scalar_type() == at::kLong && cu_seqlens_q.is_contiguous(),
              "paged_prefill_attention: seq_lens and cu_seqlens_q must be contiguous int64");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2);
  const int64_t batch = block_tables.size(0);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0 && dim % 32 == 0 && heads / kv_heads <= MAX_ROWS,
              "paged_prefill_attention: heads or head size unsupported");
  TORCH_CHECK(seq_lens.numel() == batch && cu_seqlens_q.numel() == batch + 1,
              "paged_prefill_attention: block_tables, seq_lens and cu_seqlens_q disagree on the batch");
  TORCH_CHECK(window >= 0, "paged_prefill_attention: window must be >= 0");
  const int64_t* lengths = seq_lens.data_ptr<int64_t>();
  const int64_t* cu = cu_seqlens_q.data_ptr<int64_t>();
  const int64_t capacity = block_tables.size(1) * k_cache.size(1);
  TORCH_CHECK(cu[0] == 0 && cu[batch] == tokens, "paged_prefill_attention: cu_seqlens_q must span q's tokens");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = cu[b + 1] - cu[b];
    TORCH_CHECK(n >= 1 && n <= lengths[b] && lengths[b] <= capacity && lengths[b] < (int64_t{1} << 31),
                "paged_prefill_attention: every row needs a query, no more than its keys, within its block table");
  }
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) {
    return run_tasks<uint16_t>(out, q, k_cache, v_cache, pool, block_tables, lengths, cu, scale, window);
  }
#endif
#if defined(__AVX512F__)
  run_tasks<float>(out, q, k_cache, v_cache, pool, block_tables, lengths, cu, scale, window);
#endif
}

}  // namespace

namespace textgen_cpu {

bool shared_prefix_decode([[maybe_unused]] const at::Tensor& q, [[maybe_unused]] const at::Tensor& k_cache,
                          [[maybe_unused]] const at::Tensor& v_cache, [[maybe_unused]] const Pool& pool,
                          [[maybe_unused]] const at::Tensor& block_tables,
                          [[maybe_unused]] const at::Tensor& seq_lens, [[maybe_unused]] double scale,
                          [[maybe_unused]] const at::Tensor& out, [[maybe_unused]] std::vector<uint8_t>& done) {
#if defined(__AVX512F__)
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = pool.kv_heads;
  const int64_t group = heads / kv_heads, block_size = pool.block_size, max_blocks = block_tables.size(1);
  if (!built(q.scalar_type()) || dim % 32 != 0 || group > MAX_ROWS || batch < SHARED_DECODE_ROWS) return true;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* lengths = seq_lens.data_ptr<int64_t>();
  std::vector<int64_t> order;
  for (int64_t b = 0; b < batch; ++b) {
    if (lengths[b] >= SHARED_MIN_PREFIX) order.push_back(b);
  }
  const int64_t per_chunk = std::max<int64_t>(1, MAX_ROWS / group);
  std::vector<SharedGroup> chunks;
  auto seen = [&](int64_t b) { return lengths[b]; };
  for (const SharedRun& run : shared_runs(order, tables, max_blocks, block_size, SHARED_DECODE_ROWS, seen)) {
    // Only where the shared keys are most of the rows' keys: the rows' own ones go row by row here, each head
    // apart, which the per-row path reads faster (all of a slot's heads in one run).
    int64_t own_keys = 0;
    for (size_t k = run.begin; k < run.end; ++k) own_keys += lengths[order[k]] - run.prefix;
    if (own_keys > static_cast<int64_t>(run.end - run.begin) * run.prefix) continue;
    for (size_t k = run.begin; k < run.end; k += per_chunk) {
      SharedGroup chunk{{}, run.prefix};
      for (size_t u = k; u < std::min(run.end, k + per_chunk); ++u) chunk.rows.push_back(order[u]);
      chunks.push_back(std::move(chunk));
    }
  }
  if (chunks.empty()) return true;
  const int64_t tasks = static_cast<int64_t>(chunks.size()) * kv_heads;
  bool bad_block = false;
  const bool bf16 = q.scalar_type() == at::kBFloat16;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const FlushDenormals flush;
    Scratch scratch;
    std::vector<float> own;
    std::vector<int64_t> own_offsets;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      // Head-major, as the prefill's tasks: one head's shared keys stay in cache for its chunks.
      const SharedGroup& chunk = chunks[task % chunks.size()];
      const int64_t head = task / static_cast<int64_t>(chunks.size());
      bool ok = true;
      if (bf16) {
#if defined(__AVX512BF16__)
        ok = shared_task<uint16_t>(chunk, head, reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0),
                                   q.stride(1), reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                                   reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), tables, max_blocks, lengths,
                                   pool, group, dim, static_cast<float>(scale), scratch, own, own_offsets,
                                   reinterpret_cast<uint16_t*>(out.data_ptr()));
#endif
      } else {
        ok = shared_task<float>(chunk, head, q.data_ptr<float>(), q.stride(0), q.stride(1),
                                k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables, max_blocks, lengths,
                                pool, group, dim, static_cast<float>(scale), scratch, own, own_offsets,
                                out.data_ptr<float>());
      }
      if (!ok) {
#pragma omp atomic write
        bad_block = true;
      }
    }
  }
  if (bad_block) return false;
  for (const auto& chunk : chunks) {
    for (int64_t b : chunk.rows) done[b] = 1;
  }
#endif
  return true;
}

}  // namespace textgen_cpu

TORCH_LIBRARY_FRAGMENT(textgen, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor cu_seqlens_q, float scale, int window) -> ()");
  m.def("paged_prefill_attention_built(ScalarType dtype) -> bool", &built);
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
