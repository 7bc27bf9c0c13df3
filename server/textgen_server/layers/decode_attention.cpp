// Decode attention on a CPU (one query token per row) over a KV cache, reading only the keys each row attends to.
//
// Two ops, built together (one library, one set of helpers) by decode_attention.py:
//
// textgen::decode_attention(q, k, v, first, offset, window) -> out: bfloat16, over the padded cache.
// Shapes: q [B, Hkv, G, D] (queries already scaled, G query heads per KV head), k / v [B, Hkv, C, D] (whole
// cache buffers), first [B] int64. Row b attends to columns [offset + first[b], offset + window) and to nothing
// else: left padding, columns left of the live window and the unwritten spare columns are never read, which is
// where the matmul path spends most of its bytes.
//
// textgen::paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window) -> out:
// bfloat16 or float32, over the paged KV pool of paged_attention.py. Shapes: q [B, H, D] (unscaled; any row and
// head strides), k_cache / v_cache [N, S, Hkv, D] (S slots per block; contiguous or head-major, kv_pool.h),
// block_tables int32 [B, M], seq_lens int64 [B]. Row b's key at position p sits in slot block_tables[b, p / S] * S +
// p % S; the row attends to positions [max(0, seq_lens[b] - window), seq_lens[b]) (window 0: from 0). Returns
// [B, H, D].
// Without a window, rows whose block tables begin with the same blocks (at least 4 rows, 64 positions: a prefix-cache
// hit's prompt) are computed a group at a time by prefill_attention.cpp (`shared_prefix_decode`): the group's queries
// are the lanes of one task per KV head over the shared keys, so each shared key is read and multiplied once for up
// to 64 query rows instead of once per row; each row's own keys after them are summed row by row. Same roundings.
//
// bfloat16 rounding follows the eager matmul attention both replace: the scaled query is rounded to bfloat16
// (`q * scale` in bf16), scores accumulate in float32 and are rounded to bfloat16 (the bf16 matmul's output),
// the softmax runs in float32, its probabilities are rounded to bfloat16, and the weighted sum of values
// accumulates in float32 before the final rounding. float32 rounds nowhere in between, as SDPA. With AVX512-BF16
// the paged op's bfloat16 products are of bf16 pairs as stored (vdpbf16ps, `use_pairs`): the same roundings,
// float32 sums in another order.
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

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace textgen_cpu {
// prefill_attention.cpp: the decode rows of `q` [B, H, D] that share a prefix of their block tables with others, a
// group of them at a time, into `out`; marks those it computed in `done`. False where a block table names a block
// outside the pool.
bool shared_prefix_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const Pool& pool,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                          const at::Tensor& out, std::vector<uint8_t>& done);
}  // namespace textgen_cpu

namespace {

// A core's own stream of misses bounds the op: asking for the 128-byte row AHEAD rows on, besides the hardware
// prefetcher, made a W1-like step faster (benchmark/attention.py; figures in benchmark/README.md).
// Prefetches past the end of a buffer are harmless: they never fault.
#define AHEAD 32
// Slots the paged op's weighted sum takes at a time.
#define CHUNK 16
#define PREFETCH(p)                 \
  do {                              \
    __builtin_prefetch((p), 0, 3);      \
    __builtin_prefetch((p) + 32, 0, 3); \
  } while (0)

using namespace textgen_cpu;

// One KV head's lines (`dim` values from element `head` of each of n slots) asked into L1, slots that lie side by
// side (the head-major pool's, kv_pool.h) as one run. The paged op asks for the next KV head's keys or values of a
// tile while it sums the current head's: otherwise each head's runs reach L1 only when that head's loads ask for
// them, and the sums wait on them head after head (benchmark/README.md, "The next head's lines").
template <typename T>
TEXTGEN_PREFETCH void prefetch_head(const T* base, const int64_t* slots, int64_t n, int64_t head, int64_t dim) {
  for (int64_t u = 0; u < n;) {
    int64_t v = u + 1;
    while (v < n && slots[v] == slots[v - 1] + dim) ++v;
    prefetch_lines(base + slots[u] + head, (v - u) * dim * static_cast<int64_t>(sizeof(T)));
    u = v;
  }
}

// s[0, n) <- exp(s - max(s)), one value at a time; returns their sum.
inline float exps(float* s, int64_t n) {
  float top = -INFINITY, total = 0.f;
  for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - top);
    total += s[t];
  }
  return total;
}

// s[0, n) <- softmax(s), in float32; the probabilities rounded as T's eager attention rounds them.
template <typename T>
inline void softmax(float* s, int64_t n) {
  float total = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 top16 = _mm512_set1_ps(-INFINITY), total16 = _mm512_setzero_ps();
  for (; t + 16 <= n; t += 16) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(s + t));
  float top = _mm512_reduce_max_ps(top16);
  for (int64_t u = t; u < n; ++u) top = std::max(top, s[u]);
  const __m512 shift = _mm512_set1_ps(top);
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
    _mm512_storeu_ps(s + t, e);
    total16 = _mm512_add_ps(total16, e);
  }
  for (int64_t u = t; u < n; ++u) {  // the tail through the same polynomial, one lane
    const __m512 e = exp_nonpositive(_mm512_set1_ps(s[u] - top));
    s[u] = _mm512_cvtss_f32(e);
    total += s[u];
  }
  total += fold_add(total16);
  const __m512 inv16 = _mm512_set1_ps(1.f / total);
  for (t = 0; t + 16 <= n; t += 16) _mm512_storeu_ps(s + t, round_as(T{}, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv16)));
#elif defined(__AVX2__)
  // torch's vector exp, 8 scores at a time
  __m256 top8 = _mm256_set1_ps(-INFINITY), total8 = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + t));
  float top = reduce_max(top8);
  for (int64_t u = t; u < n; ++u) top = std::max(top, s[u]);
  const __m256 shift = _mm256_set1_ps(top);
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = torch_exp(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, e);
    total8 = _mm256_add_ps(total8, e);
  }
  for (int64_t u = t; u < n; ++u) {
    s[u] = std::exp(s[u] - top);
    total += s[u];
  }
  total += fold_add(total8);
  const __m256 inv8 = _mm256_set1_ps(1.f / total);
  for (t = 0; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, round_as(T{}, _mm256_mul_ps(_mm256_loadu_ps(s + t), inv8)));
#else
  total = exps(s, n);
#endif
  const float inv = 1.f / total;
  for (; t < n; ++t) s[t] = round_as(T{}, s[t] * inv);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// acc[d] += sum_t p[t] * row(t)[d], dim a multiple of 8: 64 columns at a time held in eight registers.
template <typename T, typename Row>
inline void accumulate8(const float* p, int64_t n, Row row, int64_t dim, float* acc) {
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) {
    __m256 a[8];
    for (int k = 0; k < 8; ++k) a[k] = _mm256_loadu_ps(acc + d + 8 * k);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 w = _mm256_set1_ps(p[t]);
      const T* r = row(t) + d;
      for (int k = 0; k < 8; ++k) a[k] = _mm256_fmadd_ps(w, load8(r + 8 * k), a[k]);
    }
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(acc + d + 8 * k, a[k]);
  }
  for (; d < dim; d += 8) {
    __m256 a = _mm256_loadu_ps(acc + d);
    for (int64_t t = 0; t < n; ++t) a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), load8(row(t) + d), a);
    _mm256_storeu_ps(acc + d, a);
  }
}
#endif

// sum_d q[d] * key[d]
template <typename T>
inline float dot(const float* q, const T* key, int64_t dim) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(key + d), acc);
    return fold_add(acc);
  }
#elif defined(__AVX2__)
  if (dim % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(key + d), acc);
    return fold_add(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t d = 0; d < dim; ++d) acc += q[d] * to_float(key[d]);
  return acc;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// dot(q, keys[j], dim) for four keys at once, each the very sums `dot` makes (one accumulator, d in order, the same
// fold): four independent chains keep both FMA units busy where one chain waits on each FMA's latency.
template <typename T>
inline void dot4(const float* q, const T* const* keys, int64_t dim, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qd, load8(keys[0] + d), a0);
    a1 = _mm256_fmadd_ps(qd, load8(keys[1] + d), a1);
    a2 = _mm256_fmadd_ps(qd, load8(keys[2] + d), a2);
    a3 = _mm256_fmadd_ps(qd, load8(keys[3] + d), a3);
  }
  out[0] = fold_add(a0);
  out[1] = fold_add(a1);
  out[2] = fold_add(a2);
  out[3] = fold_add(a3);
}
#endif

// out[d] += sum_t p[t] * values[t][d]   (values rows `dim` apart)
inline void weighted_sum(const float* p, const uint16_t* values, int64_t rows, int64_t dim, float* out) {
#if defined(__AVX512F__)
  if (dim == 64) {  // the common head size: four accumulators held in registers over all rows
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t t = 0; t < rows; ++t) {
      const __m512 w = _mm512_set1_ps(p[t]);
      const uint16_t* row = values + t * dim;
      PREFETCH(row + AHEAD * dim);
      a0 = _mm512_fmadd_ps(w, load16(row), a0);
      a1 = _mm512_fmadd_ps(w, load16(row + 16), a1);
      a2 = _mm512_fmadd_ps(w, load16(row + 32), a2);
      a3 = _mm512_fmadd_ps(w, load16(row + 48), a3);
    }
    _mm512_storeu_ps(out, a0);
    _mm512_storeu_ps(out + 16, a1);
    _mm512_storeu_ps(out + 32, a2);
    _mm512_storeu_ps(out + 48, a3);
    return;
  }
#endif
  std::fill(out, out + dim, 0.f);
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (dim % 8 == 0) {
    accumulate8<uint16_t>(p, rows, [&](int64_t t) { return values + t * dim; }, dim, out);
    return;
  }
#endif
  for (int64_t t = 0; t < rows; ++t) {
    const float w = p[t];
    const uint16_t* row = values + t * dim;
    for (int64_t d = 0; d < dim; ++d) out[d] += w * bf16_to_float(row[d]);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& first,
                            int64_t offset, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "decode_attention: q, k and v must be bfloat16");
  TORCH_CHECK(first.scalar_type() == at::kLong, "decode_attention: first must be int64");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes(), "decode_attention: bad shapes");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && first.is_contiguous(),
              "decode_attention: operands must be contiguous");
  const int64_t batch = k.size(0), kv_heads = k.size(1), capacity = k.size(2), dim = k.size(3);
  const int64_t group = q.size(2);
  TORCH_CHECK(q.size(0) == batch && q.size(1) == kv_heads && q.size(3) == dim && first.numel() == batch,
              "decode_attention: q, k and first disagree on the batch, heads or head size");
  const int64_t end = offset + window;
  TORCH_CHECK(offset >= 0 && window > 0 && end <= capacity, "decode_attention: window outside the buffers");
  const int64_t* firsts = first.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(firsts[b] >= 0 && firsts[b] < window, "decode_attention: every row must see a key");
  }
  at::Tensor out = at::empty_like(q);
  const auto* Q = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* K = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* V = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* O = reinterpret_cast<uint16_t*>(out.data_ptr());

  // One task per (row, KV head): its keys and values are two contiguous runs, each read once for all the
  // query heads of the group. Rows differ in length (the batch keeps the longest prompts first), so the tasks
  // are handed out dynamically: equal contiguous shares gave one thread twice the work of the other.
  const int64_t tasks = batch * kv_heads;
  const int threads = at::get_num_threads();  // torch.set_num_threads, as torch's own kernels use
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals flush;
    std::vector<float> queries(group * dim), scores(group * window), acc(dim);
#pragma omp for schedule(dynamic, 8)
    for (int64_t bh = 0; bh < tasks; ++bh) {
      const int64_t start = offset + firsts[bh / kv_heads], rows = end - start;
      const uint16_t* keys = K + (bh * capacity + start) * dim;
      const uint16_t* values = V + (bh * capacity + start) * dim;
      const uint16_t* qs = Q + bh * group * dim;
      for (int64_t i = 0; i < group * dim; ++i) queries[i] = bf16_to_float(qs[i]);
      for (int64_t t = 0; t < rows; ++t) {
        PREFETCH(keys + (t + AHEAD) * dim);
        for (int64_t g = 0; g < group; ++g) {
          scores[g * window + t] = round_bf16(dot(queries.data() + g * dim, keys + t * dim, dim));
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * window;
        softmax<uint16_t>(s, rows);
        weighted_sum(s, values, rows, dim, acc.data());
        uint16_t* o = O + (bh * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = float_to_bf16(acc[d]);
      }
    }
  }
  return out;
}


// acc[d] += sum_t p[t] * base[offsets[t] + d]: one query head's weighted sum over a chunk of slots, its
// accumulators held in registers for the chunk.
template <typename T>
inline void accumulate(const float* p, const T* base, const int64_t* offsets, int64_t n, int64_t dim, float* acc) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    for (int64_t d = 0; d + 64 <= dim; d += 64) {  // four accumulators at a time (all of the common head size)
      __m512 a0 = _mm512_loadu_ps(acc + d), a1 = _mm512_loadu_ps(acc + d + 16);
      __m512 a2 = _mm512_loadu_ps(acc + d + 32), a3 = _mm512_loadu_ps(acc + d + 48);
      for (int64_t t = 0; t < n; ++t) {
        const __m512 w = _mm512_set1_ps(p[t]);
        const T* row = base + offsets[t] + d;
        a0 = _mm512_fmadd_ps(w, load16(row), a0);
        a1 = _mm512_fmadd_ps(w, load16(row + 16), a1);
        a2 = _mm512_fmadd_ps(w, load16(row + 32), a2);
        a3 = _mm512_fmadd_ps(w, load16(row + 48), a3);
      }
      _mm512_storeu_ps(acc + d, a0);
      _mm512_storeu_ps(acc + d + 16, a1);
      _mm512_storeu_ps(acc + d + 32, a2);
      _mm512_storeu_ps(acc + d + 48, a3);
    }
    for (int64_t d = dim - dim % 64; d < dim; d += 16) {
      __m512 a = _mm512_loadu_ps(acc + d);
      for (int64_t t = 0; t < n; ++t) a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), load16(base + offsets[t] + d), a);
      _mm512_storeu_ps(acc + d, a);
    }
    return;
  }
#elif defined(__AVX2__)
  if (dim % 8 == 0) {
    accumulate8<T>(p, n, [&](int64_t t) { return base + offsets[t]; }, dim, acc);
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const T* row = base + offsets[t];
    for (int64_t d = 0; d < dim; ++d) acc[d] += p[t] * to_float(row[d]);
  }
}

#if defined(__AVX512F__)
// The dots of one query (`dim` floats, a multiple of 16) with the keys of 16 slots (`keys[s] + head`), each summed
// as `dot` sums it (16 lanes of fmadds over the columns, then `fold_add`, by fold16). Returns them in slot order.
template <typename T>
inline __m512 dot16(const float* q, const T* const* keys, int64_t head, int64_t dim) {
  __m512 a[16];
  for (int s = 0; s < 16; ++s) a[s] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int s = 0; s < 16; ++s) a[s] = _mm512_fmadd_ps(qd, load16(keys[s] + head + d), a[s]);
  }
  return fold16(a);
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 with AVX512-BF16 and a head size that is a multiple of 32 (`use_pairs`): vdpbf16ps multiplies bf16
// pairs as they are stored, where the float32 path widens and shifts every key and value first (benchmark/
// README.md, "attention.py --paged"). The sums are float32 sums in another order: a pair's products are exact in
// float32 (the query and the probabilities are rounded to bf16 first, as in the eager attention), each added
// with one rounding.

// 32 values of q (bf16 values held in float32) as bf16 pairs.
inline __m512bh pairs_of(const float* q) { return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q)); }

// One slot's dot by pair products: 16 lane sums folded as `fold_add` folds them.
inline float dot_pairs(const float* q, const uint16_t* key, int64_t dim) {
  __m512 a = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 32) a = _mm512_dpbf16_ps(a, pairs_of(q + d), (__m512bh)_mm512_loadu_si512(key + d));
  return fold_add(a);
}

// The dots of one query (`dim` floats, a multiple of 32) with the keys of 16 slots (`keys[s] + head`), each summed
// as dot_pairs sums it (the query's pairs made once a step for the 16 slots; fold16 folds as fold_add does). Returns
// them in slot order.
inline __m512 dot16_pairs(const float* q, const uint16_t* const* keys, int64_t head, int64_t dim) {
  __m512 a[16];
  for (int s = 0; s < 16; ++s) a[s] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 32) {
    const __m512bh qp = pairs_of(q + d);
    for (int s = 0; s < 16; ++s) {
      a[s] = _mm512_dpbf16_ps(a[s], qp, (__m512bh)_mm512_loadu_si512(keys[s] + head + d));
    }
  }
  return fold16(a);
}

// The bf16 bits of a float32 that holds a bf16 value.
inline uint32_t bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits >> 16;
}

// acc += sum_t p[t] * base[offsets[t] + d] by pair products: slots t and t + 1 interleaved column by column
// (vpunpck{l,h}wd, within 128-bit lanes), times the pair (p[t], p[t + 1]). acc is kept in that interleaved
// order (the paired order, cpu_ops.h); an odd last slot pairs with itself at weight 0. n <= CHUNK.
inline void accumulate_pairs(const float* p, const uint16_t* base, const int64_t* offsets, int64_t n, int64_t dim,
                             float* acc) {
  int weights[CHUNK / 2];  // the pairs (p[t], p[t + 1]) as bf16 bits, once for every column
  for (int64_t t = 0; t < n; t += 2) {
    weights[t / 2] = static_cast<int>(bf16_bits(p[t]) | (t + 1 < n ? bf16_bits(p[t + 1]) << 16 : 0u));
  }
  for (int64_t d = 0; d < dim; d += 32) {
    __m512 lo = _mm512_loadu_ps(acc + d), hi = _mm512_loadu_ps(acc + d + 16);
    for (int64_t t = 0; t < n; t += 2) {
      const __m512i x0 = _mm512_loadu_si512(base + offsets[t] + d);
      const __m512i x1 = t + 1 < n ? _mm512_loadu_si512(base + offsets[t + 1] + d) : x0;
      const __m512bh w = (__m512bh)_mm512_set1_epi32(weights[t / 2]);
      lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_unpacklo_epi16(x0, x1), w);
      hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_unpackhi_epi16(x0, x1), w);
    }
    _mm512_storeu_ps(acc + d, lo);
    _mm512_storeu_ps(acc + d + 16, hi);
  }
}
#endif

// Whether the op takes bf16 pair products (the AVX512-BF16 code above) for T and this head size.
template <typename T>
constexpr bool use_pairs([[maybe_unused]] int64_t dim) {
#if defined(__AVX512BF16__)
  return std::is_same_v<T, uint16_t> && dim % 32 == 0;
#else
  return false;
#endif
}


// dot, by pair products where `pairs`.
template <typename T>
inline float dot_as([[maybe_unused]] bool pairs, const float* q, const T* key, int64_t dim) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (pairs) return dot_pairs(q, key, dim);
  }
#endif
  return dot(q, key, dim);
}

// accumulate, by pair products (acc in the paired order) where `pairs`.
template <typename T>
inline void accumulate_as([[maybe_unused]] bool pairs, const float* p, const T* base, const int64_t* offsets, int64_t n,
                          int64_t dim, float* acc) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (pairs) return accumulate_pairs(p, base, offsets, n, dim, acc);
  }
#endif
  accumulate(p, base, offsets, n, dim, acc);
}

// One task: row `b`, KV heads [h0, h1). `slots` and `scores` are the thread's scratch; returns false (reading
// nothing) when the row's block table names a block outside the pool.
template <typename T>
bool paged_row(const T* Q, int64_t q_head_stride, const T* K, const T* V, const int32_t* table, const Pool& pool,
               int64_t group, int64_t length, int64_t window, float scale, int64_t h0, int64_t h1,
               std::vector<int64_t>& slots, std::vector<float>& queries, std::vector<float>& scores,
               std::vector<float>& acc, T* out) {
  const int64_t start = window > 0 ? std::max<int64_t>(0, length - window) : 0, rows = length - start;
  const int64_t heads = (h1 - h0) * group, dim = pool.dim, hs = pool.head_stride();
  // The task's heads of a slot: one run of `span` bytes in TGI's order; in the head-major pool runs of `head_bytes`
  // `hs` elements apart, each head's slots of a block side by side (kv_pool.h).
  const int64_t head_bytes = dim * static_cast<int64_t>(sizeof(T)), span = (h1 - h0) * head_bytes;
  slots.resize(rows);  // each key's offset in the pool at the task's first KV head, in elements
  if (!pool_offsets(table, start, rows, pool, h0, slots.data())) return false;
  // The lines of the slot at `offset` (all the task's heads), asked into L1.
  auto ask_slot = [&](const T* base, int64_t offset) __attribute__((always_inline)) {
    if (!pool.head_major) return prefetch_lines(base + offset, span);
    for (int64_t h = 0; h < h1 - h0; ++h) prefetch_lines(base + offset + h * hs, head_bytes);
  };
  // On query head i's turn, its share of the next tile's `n` slots: spread over the heads into L2 in TGI's order
  // (prefetch_share); in the head-major pool the KV head's own runs, into L1, once a KV head.
  auto ask_next = [&](const T* base, const int64_t* next_slots, int64_t n, int64_t i) __attribute__((always_inline)) {
    if (!pool.head_major) return prefetch_share(base, next_slots, n, span, i, heads);
    if (i % group == 0) prefetch_head(base, next_slots, n, i / group * hs, dim);
  };
  // Before query head i + 1 of a new KV head, that head's lines of the current `n` slots, into L1.
  auto ask_head = [&](const T* base, const int64_t* tile, int64_t n, int64_t i) __attribute__((always_inline)) {
    if (i + 1 < heads && (i + 1) % group == 0) prefetch_head(base, tile, n, (i + 1) / group * hs, dim);
  };
  queries.resize(heads * dim);
  for (int64_t i = 0; i < heads; ++i) {
    const T* q = Q + (h0 * group + i) * q_head_stride;
    for (int64_t d = 0; d < dim; ++d) queries[i * dim + d] = round_as(T{}, to_float(q[d]) * scale);
  }
  // Prefetch as many bytes ahead as the padded op's AHEAD rows of 128 bytes, at least a few slots (the AVX2 tiles
  // and the last slots; AVX-512 tiles and the values' chunks ask for the next tile's lines head by head instead).
  const int64_t ahead = std::max<int64_t>(4, AHEAD * 128 / span);
  scores.resize(heads * rows);
  int64_t t = 0;
  const bool pairs = use_pairs<T>(dim);
#if defined(__AVX512F__)
  // 16 slots at a time (dot16, the same sums as `dot`; dot16_pairs, those of dot_pairs), each head's over the 16
  // slots: one fold for 16 dots instead of a horizontal reduction each, which bounded the pair products over long
  // contexts (benchmark/README.md, "Decode attention's pair products 16 slots at a time").
  if (dim % 16 == 0) {  // pair products take heads of a multiple of 32
    auto dots = [&](int64_t i, const T* const* keys) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (pairs) return dot16_pairs(queries.data() + i * dim, keys, (i / group) * hs, dim);
      }
#endif
      return dot16(queries.data() + i * dim, keys, (i / group) * hs, dim);
    };
    const T* keys[16];  // the tile's slots at the task's first KV head; a head's are `hs` elements on
    for (; t + 16 <= rows; t += 16) {
      const int64_t next = std::min<int64_t>(16, rows - t - 16);  // slots of the next tile
      for (int s = 0; s < 16; ++s) keys[s] = K + slots[t + s];
      for (int64_t i = 0; i < heads; ++i) {
        if (next > 0) ask_next(K, slots.data() + t + 16, next, i);
        ask_head(K, slots.data() + t, 16, i);
        _mm512_storeu_ps(scores.data() + i * rows + t, round_as(T{}, dots(i, keys)));
      }
    }
  }
#elif defined(__AVX2__)
  // 4 slots at a time (dot4, the same sums as `dot`), each head's over the 4 slots.
  if (!pairs && dim % 8 == 0) {
    const T* keys[4];
    float four[4];
    for (; t + 4 <= rows; t += 4) {
      for (int64_t u = t + ahead; u < std::min(t + 4 + ahead, rows); ++u) ask_slot(K, slots[u]);
      for (int64_t i = 0; i < heads; ++i) {
        for (int s = 0; s < 4; ++s) keys[s] = K + slots[t + s] + (i / group) * hs;
        dot4(queries.data() + i * dim, keys, dim, four);
        for (int s = 0; s < 4; ++s) scores[i * rows + t + s] = round_as(T{}, four[s]);
      }
    }
  }
#endif
  for (; t < rows; ++t) {
    if (t + ahead < rows) ask_slot(K, slots[t + ahead]);
    const T* key = K + slots[t];
    for (int64_t i = 0; i < heads; ++i) {
      scores[i * rows + t] = round_as(T{}, dot_as(pairs, queries.data() + i * dim, key + (i / group) * hs, dim));
    }
  }
  for (int64_t i = 0; i < heads; ++i) softmax<T>(scores.data() + i * rows, rows);
  // Values a chunk of slots at a time, head by head: each head's accumulators stay in registers for the chunk.
  acc.assign(heads * dim, 0.f);
  for (int64_t c = 0; c < rows; c += CHUNK) {
    const int64_t n = std::min<int64_t>(CHUNK, rows - c), next = std::min<int64_t>(CHUNK, rows - c - n);
    for (int64_t i = 0; i < heads; ++i) {
      if (next > 0) ask_next(V, slots.data() + c + n, next, i);
      ask_head(V, slots.data() + c, n, i);
      accumulate_as(pairs, scores.data() + i * rows + c, V + (i / group) * hs, slots.data() + c, n, dim,
                    acc.data() + i * dim);
    }
  }
  for (int64_t i = 0; i < heads; ++i) {
#if defined(__AVX512BF16__)
    if (pairs) {
      store_unpaired(out + (h0 * group + i) * dim, acc.data() + i * dim, dim);
      continue;
    }
#endif
    for (int64_t d = 0; d < dim; ++d) store_as(out + (h0 * group + i) * dim + d, acc[i * dim + d]);
  }
  return true;
}

template <typename T>
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const Pool& pool,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                  at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = pool.kv_heads, group = heads / kv_heads, max_blocks = block_tables.size(1);
  const auto* Q = reinterpret_cast<const T*>(q.data_ptr());
  const auto* K = reinterpret_cast<const T*>(k_cache.data_ptr());
  const auto* V = reinterpret_cast<const T*>(v_cache.data_ptr());
  auto* O = reinterpret_cast<T*>(out.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* lengths = seq_lens.data_ptr<int64_t>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  // Rows sharing a cached prefix first, a group of them at a time (prefill_attention.cpp); the others below.
  std::vector<uint8_t> done(batch, 0);
  TORCH_CHECK(window > 0 || shared_prefix_decode(q, k_cache, v_cache, pool, block_tables, seq_lens, scale, out, done),
              "paged_decode_attention: a block table names a block outside the pool");
  std::vector<int64_t> rest;
  for (int64_t b = 0; b < batch; ++b) {
    if (!done[b]) rest.push_back(b);
  }
  const int64_t remaining = static_cast<int64_t>(rest.size());

  // One task per (row, share of its KV heads). At a large batch a share is all of a row's heads, so each slot's
  // keys are read as one contiguous run; a small batch splits the heads so every thread gets work. Rows differ
  // in length, so tasks are handed out dynamically.
  const int threads = at::get_num_threads();  // torch.set_num_threads, as torch's own kernels use
  const int64_t per_row = (4 * threads + remaining - 1) / std::max<int64_t>(1, remaining);
  const int64_t shares = std::min<int64_t>(kv_heads, std::max<int64_t>(1, per_row));
  const int64_t tasks = remaining * shares;
  bool bad_block = false;
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals flush;
    std::vector<int64_t> slots;
    std::vector<float> queries, scores, acc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = rest[task / shares], share = task % shares;
      const int64_t h0 = share * kv_heads / shares, h1 = (share + 1) * kv_heads / shares;
      if (!paged_row(Q + b * q_row, q_head, K, V, tables + b * max_blocks, pool, group, lengths[b], window,
                     static_cast<float>(scale), h0, h1, slots, queries, scores, acc, O + b * heads * dim)) {
#pragma omp atomic write
        bad_block = true;
      }
    }
  }
  TORCH_CHECK(!bad_block, "paged_decode_attention: a block table names a block outside the pool");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "paged_decode_attention: q must be bfloat16 or float32");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "paged_decode_attention: the caches must have q's dtype");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode_attention: q must be [B, H, D] with unit head_dim stride");
  const Pool pool = pool_of(k_cache, v_cache, "paged_decode_attention");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "paged_decode_attention: block_tables must be contiguous int32 [B, M]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
              "paged_decode_attention: seq_lens must be contiguous int64");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "paged_decode_attention: heads or head size disagree");
  TORCH_CHECK(block_tables.size(0) == batch && seq_lens.numel() == batch,
              "paged_decode_attention: q, block_tables and seq_lens disagree on the batch");
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be >= 0");
  const int64_t* lengths = seq_lens.data_ptr<int64_t>();
  const int64_t capacity = block_tables.size(1) * k_cache.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lengths[b] > 0 && lengths[b] <= capacity,
                "paged_decode_attention: every row must see a key and fit its block table");
  }
  at::Tensor out = at::empty({batch, heads, dim}, q.options());
  if (dtype == at::kBFloat16) {
    paged_decode<uint16_t>(q, k_cache, v_cache, pool, block_tables, seq_lens, scale, window, out);
  } else {
    paged_decode<float>(q, k_cache, v_cache, pool, block_tables, seq_lens, scale, window, out);
  }
  return out;
}

// textgen::causal_softmax_bf16(scores, offset, window) -> probs: the masked float32 softmax of a prefill's
// bf16 scores [..., S, T], as torch.softmax(scores.float().masked_fill(~mask, -inf), -1).to(bfloat16) computes
// it, in one pass per row instead of four over a float32 tensor. Query s sees keys t <= offset + s, and
// t > offset + s - window when window > 0 (bottom-right causal: offset = T - S).
//
// torch's AVX-512 softmax (SoftMaxKernel.cpp, _vec_softmax_lastdim) is followed step by step: the max; exp(x -
// max) by torch's own vector exp (`torch_exp`, cpu_ops.h); the sum in torch's vec::reduce_all order: 16 lane
// sums of columns t = lane mod 16 in column order (masked columns add exact zeros, so they are skipped), then
// the 8-4-2-1 tree, or one serial sum when T < 16; and the probabilities as e * (1 / sum). So the result is
// torch's bit for bit where torch's own build takes that path (test_decode_attention.py measures it), except
// probabilities below 2^-126, which are 0 here (FlushDenormals, cpu_ops.h). An AVX2 build takes the same steps
// on 8 lanes with torch's AVX2 exp and fold, as torch's AVX2 softmax does (test_cpu_targets.py runs that build).

// causal_softmax_row one column at a time (the libm's exp, the sum in column order), where neither vector path
// is built: torch's values to within their rounding, not its bits.
inline void causal_softmax_scalar(const uint16_t* in, uint16_t* out, float* e, int64_t total, int64_t lo, int64_t hi) {
  for (int64_t t = lo; t <= hi; ++t) e[t] = bf16_to_float(in[t]);
  const float inv = 1.f / exps(e + lo, hi - lo + 1);
  for (int64_t t = 0; t < total; ++t) out[t] = t < lo || t > hi ? 0 : float_to_bf16(e[t] * inv);
}

// One row: scores `in` [T] (bf16), visible columns [lo, hi], probabilities to `out` [T] (bf16); `e` scratch [T].
inline void causal_softmax_row(const uint16_t* in, uint16_t* out, float* e, int64_t total, int64_t lo, int64_t hi) {
#if defined(__AVX512F__)
  float sum = 0.f;
  const int64_t first = lo - lo % 16;  // whole 16-column chunks, aligned on absolute columns as torch's lanes
  __m512 top16 = _mm512_set1_ps(-INFINITY);
  for (int64_t c = first; c <= hi; c += 16) {
    const int64_t a = std::max(lo, c), b = std::min(hi + 1, c + 16);
    const __mmask16 m = static_cast<__mmask16>(((1u << (b - a)) - 1u) << (a - c));
    const __m256i raw = _mm256_maskz_loadu_epi16(m, in + c);
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    top16 = _mm512_mask_max_ps(top16, m, top16, x);
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top16));
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t c = first; c <= hi; c += 16) {
    const int64_t a = std::max(lo, c), b = std::min(hi + 1, c + 16);
    const __mmask16 m = static_cast<__mmask16>(((1u << (b - a)) - 1u) << (a - c));
    const __m256i raw = _mm256_maskz_loadu_epi16(m, in + c);
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    const __m512 ex = _mm512_maskz_mov_ps(m, torch_exp(_mm512_sub_ps(x, shift)));
    _mm512_storeu_ps(e + c, ex);
    lanes = _mm512_add_ps(lanes, ex);
  }
  if (total < 16) {  // torch sums a row shorter than a vector serially
    for (int64_t t = lo; t <= hi; ++t) sum += e[t];
  } else {
    sum = fold_add(lanes);
  }
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  std::memset(out, 0, first * sizeof(uint16_t));
  int64_t c = first;
  for (; c <= hi; c += 16) {
    const int64_t a = std::max(lo, c), b = std::min(hi + 1, c + 16);
    const __mmask16 m = static_cast<__mmask16>(((1u << (b - a)) - 1u) << (a - c));
    const __m512 p = round_bf16(_mm512_maskz_mul_ps(m, _mm512_loadu_ps(e + c), inv));
    const __m256i packed = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16));
    const int64_t n = std::min<int64_t>(16, total - c);
    _mm256_mask_storeu_epi16(out + c, static_cast<__mmask16>((1u << n) - 1u), packed);
  }
  if (c < total) std::memset(out + c, 0, (total - c) * sizeof(uint16_t));
#elif defined(__AVX2__)
  // torch's AVX2 path: the same steps, 8 lanes
  const int64_t first = lo - lo % 8, end = hi + 1 + (8 - (hi + 1) % 8) % 8;  // whole 8-column chunks
  // The scores in float32, -inf where masked: whole visible chunks eight at a time (the conversion is exact, so
  // any way of making it gives the same floats), the chunks at the edges value by value.
  const int64_t inner = std::min((lo + 7) & ~int64_t(7), end), inner_end = std::max(inner, (hi + 1) & ~int64_t(7));
  auto edge = [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) e[t] = t < lo || t > hi ? -INFINITY : bf16_to_float(in[t]);
  };
  edge(first, inner);
  for (int64_t c = inner; c < inner_end; c += 8) _mm256_storeu_ps(e + c, load8(in + c));
  edge(inner_end, end);
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  for (int64_t c = first; c < end; c += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(e + c));
  const __m256 shift = _mm256_set1_ps(reduce_max(top8));
  float sum = 0.f;
  __m256 lanes = _mm256_setzero_ps();
  for (int64_t c = first; c < end; c += 8) {
    const __m256 ex = torch_exp(_mm256_sub_ps(_mm256_loadu_ps(e + c), shift));  // masked: exp(-inf) = 0
    _mm256_storeu_ps(e + c, ex);
    lanes = _mm256_add_ps(lanes, ex);
  }
  if (total < 8) {
    for (int64_t t = lo; t <= hi; ++t) sum += e[t];
  } else {
    sum = fold_add(lanes);
  }
  const float inv = 1.f / sum;
  std::memset(out, 0, first * sizeof(uint16_t));
  int64_t c = first;
  for (; c + 8 <= total && c < end; c += 8) store8(out + c, _mm256_mul_ps(_mm256_loadu_ps(e + c), _mm256_set1_ps(inv)));
  for (; c < total; ++c) out[c] = c > hi ? 0 : float_to_bf16(e[c] * inv);
#else
  causal_softmax_scalar(in, out, e, total, lo, hi);
#endif
}

at::Tensor causal_softmax_bf16(const at::Tensor& scores, int64_t offset, int64_t window) {
  TORCH_CHECK(scores.scalar_type() == at::kBFloat16 && scores.dim() >= 2 && scores.is_contiguous(),
              "causal_softmax_bf16: scores must be contiguous bfloat16 [..., S, T]");
  const int64_t seq = scores.size(-2), total = scores.size(-1), rows = scores.numel() / std::max<int64_t>(1, total);
  TORCH_CHECK(offset >= 0 && offset + seq <= total && window >= 0,
              "causal_softmax_bf16: needs 0 <= offset, offset + S <= T and window >= 0");
  at::Tensor out = at::empty_like(scores);
  if (scores.numel() == 0) return out;
  const auto* in = reinterpret_cast<const uint16_t*>(scores.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals flush;
    std::vector<float> e(total + 16);
#pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t hi = offset + r % seq, lo = window > 0 ? std::max<int64_t>(0, hi - window + 1) : 0;
      causal_softmax_row(in + r * total, o + r * total, e.data(), total, lo, hi);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(textgen, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor first, int offset, int window) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int window) -> Tensor");
  m.def("causal_softmax_bf16(Tensor scores, int offset, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("causal_softmax_bf16", &causal_softmax_bf16);
}
