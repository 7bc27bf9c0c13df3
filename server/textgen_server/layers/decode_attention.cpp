// bfloat16 decode attention over each row's live key range, for the padded KV cache on a CPU.
//
// Op textgen::decode_attention(q, k, v, first, offset, window) -> out, built and documented by
// decode_attention.py. Shapes: q [B, Hkv, G, D] (queries already scaled, G query heads per KV head),
// k / v [B, Hkv, C, D] (whole cache buffers), first [B] int64. Row b attends to columns
// [offset + first[b], offset + window) and to nothing else: left padding, columns left of the live window and
// the unwritten spare columns are never read, which is where the matmul path spends most of its bytes.
//
// Rounding follows the eager matmul attention it replaces: scores accumulate in float32 and are rounded to
// bfloat16 (the bf16 matmul's output), the softmax runs in float32, its probabilities are rounded to bfloat16,
// and the weighted sum of values accumulates in float32 before the final rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// A core's own stream of misses bounds the op: asking for the 128-byte row AHEAD rows on, besides the hardware
// prefetcher, made a W1-like step faster (benchmark/attention.py; figures in benchmark/README.md).
// Prefetches past the end of a buffer are harmless: they never fault.
#define AHEAD 32
#define PREFETCH(p)                 \
  do {                              \
    __builtin_prefetch((p), 0, 3);      \
    __builtin_prefetch((p) + 32, 0, 3); \
  } while (0)

inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion (the values here are never NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#if defined(__AVX512F__)
inline __m512 load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// sum_d q[d] * key[d]
inline float dot(const float* q, const uint16_t* key, int64_t dim) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(key + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t d = 0; d < dim; ++d) acc += q[d] * bf16_to_float(key[d]);
  return acc;
}

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
        const float top = *std::max_element(s, s + rows);
        float total = 0.f;
        for (int64_t t = 0; t < rows; ++t) {
          s[t] = std::exp(s[t] - top);
          total += s[t];
        }
        for (int64_t t = 0; t < rows; ++t) s[t] = round_bf16(s[t] / total);
        weighted_sum(s, values, rows, dim, acc.data());
        uint16_t* o = O + (bh * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = float_to_bf16(acc[d]);
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(textgen, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor first, int offset, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) { m.impl("decode_attention", &decode_attention); }
