// One row of an 8-bit projection with one scale per output feature (eetq, 8-bit GPTQ/compressed-tensors quantized
// per channel: layers/quant_kernels.py, Int8Kernel), for batch-1 decode steps. At one row the weight streams from
// memory once for two flops a byte; torch's _weight_int8pack_mm read it at 4.4-11.3 GB/s on a 2-core Zen 3 whose
// 2 threads read 14-18 GB/s, this op at 8.2-16.2 (benchmark/README.md, "Quantized models").
//
// textgen::int8_gemv(x [M, K] bf16, weight int8 [N, K], scales bf16 [N]) -> y bf16 [M, N], row by row (each row
//   streams the whole weight: only M = 1 is what it is for), y[n] = scale[n] * sum_k w[n, k] x[k], as torch's
//   kernel defines it: the sum in float32 (x read exactly as float32), times the scale, rounded once to bf16. The
//   sum's order is not torch's kernel's (8 lanes, k mod 8, each summed in order of k, then folded):
//   tests/test_int8_gemv.py checks the op against the float64 product within the rounding of its sums.
//
// textgen::int8_quantize_rows(x [M, K] bf16 or float32) -> (q int8 [M, K], scale float32 [M, 1]): W8A8's
//   activations to integers as the compressed-tensors package quantizes them, torch's expression's bits in one pass
//   (below); empty tensors where a row holds an infinity or a NaN.
// textgen::int8_rescale(sums int32 [M, N], row_scale float32 [M, 1], col_scale float32 [N], dtype) -> [M, N]: W8A8's
//   integer sums back to floats, `(sums.float() * row_scale * col_scale).to(dtype)`'s bits in one pass (below).
// textgen::int8_dequantize(weight int8 [N, K], scales bf16 [N], dtype) -> [N, K]: the weight-only int8 weight for a
//   many-row GEMM, `(weight.float() * scales.float()[:, None]).to(dtype)`'s bits in one pass (below).
//
// Vector path: AVX2 + FMA (x86-64-v3, also what an AVX-512 build runs), four outputs at a time, each reading its
// own contiguous row of the weight, a quarter of the thread's outputs apart; elsewhere a scalar loop sums the same
// products in order of k. Threads split the outputs (at::parallel_for).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_ops.h"

namespace {

using namespace textgen_cpu;

// Outputs [n0, n1) of one row: y[n] = sum_k w[n, k] x[k] (without the scale).
void sums_scalar(const float* x, const int8_t* w, int64_t k, int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * k;
    float acc = 0.f;
    for (int64_t kk = 0; kk < k; ++kk) acc += float(row[kk]) * x[kk];
    y[n] = acc;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 weights of a row, sign-extended and converted to float32.
inline __m256 weights8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// Four outputs, rows[r] each k bytes, k a multiple of 8. `ahead`: the bytes `ahead` past each row's, at the same
// column, are fetched as these are read (0: none).
inline void sums4(const float* x, const int8_t* const (&rows)[4], int64_t k, int64_t ahead, float (&y)[4]) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t kk = 0; kk < k; kk += 8) {
    if (ahead && kk % 64 == 0) {
      for (int r = 0; r < 4; ++r) _mm_prefetch(reinterpret_cast<const char*>(rows[r] + ahead + kk), _MM_HINT_T0);
    }
    const __m256 xv = _mm256_loadu_ps(x + kk);
    for (int r = 0; r < 4; ++r) acc[r] = _mm256_fmadd_ps(weights8(rows[r] + kk), xv, acc[r]);
  }
  for (int r = 0; r < 4; ++r) y[r] = fold_add(acc[r]);
}

// One output, k a multiple of 8: the same lanes and fold as sums4.
inline float sums1(const float* x, const int8_t* w, int64_t k) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; kk += 8) acc = _mm256_fmadd_ps(weights8(w + kk), _mm256_loadu_ps(x + kk), acc);
  return fold_add(acc);
}
#endif

void row_sums(const float* x, const int8_t* w, int64_t n, int64_t k, float* y) {
  // Blocks of 64 outputs: each thread takes a contiguous run of whole rows.
  constexpr int64_t BLOCK = 64;
  at::parallel_for(0, (n + BLOCK - 1) / BLOCK, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * BLOCK, n1 = std::min(n, end * BLOCK);
#if defined(__AVX2__) && defined(__FMA__)
    if (k % 8 == 0) {
      // Four rows far apart at a time (four_streams; four neighbouring rows, as this summed before, read 1.1-1.3x
      // slower). Each stream prefetches its next row at the same column.
      four_streams(
          n0, n1,
          [&](int64_t j, int64_t q) {
            const int8_t* const rows[4] = {w + j * k, w + (j + q) * k, w + (j + 2 * q) * k, w + (j + 3 * q) * k};
            float out[4];
            sums4(x, rows, k, j + 1 < n0 + q ? k : 0, out);
            for (int r = 0; r < 4; ++r) y[j + r * q] = out[r];
          },
          [&](int64_t j) { y[j] = sums1(x, w + j * k, k); });
      return;
    }
#endif
    sums_scalar(x, w, k, n0, n1, y);
  });
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_gemv: x bf16 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_gemv: a contiguous int8 [N, K] weight");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "int8_gemv: x has ", k, " features, the weight ", weight.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == n,
              "int8_gemv: contiguous bf16 scales [N]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* w = weight.data_ptr<int8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  std::vector<float> xf(k), yf(n);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t kk = 0; kk < k; ++kk) xf[kk] = bf16_to_float(xp[r * k + kk]);
    row_sums(xf.data(), w, n, k, yf.data());
    for (int64_t j = 0; j < n; ++j) yp[r * n + j] = float_to_bf16(yf[j] * bf16_to_float(s[j]));
  }
  return y;
}

// W8A8's activations (quant_kernels.Int8DynamicKernel._quantize, as the compressed-tensors package quantizes them):
// each row's scale = max |x| / 127.5 (float32 epsilon where that is 0), and q = x / scale rounded half to even,
// clamped to [-128, 127]: torch's expression's bits in one pass over x where it takes six. Returns (q int8 [M, K],
// scale float32 [M, 1]), or two empty tensors where a row holds an infinity or a NaN (whose conversion to int8 torch
// leaves to the CPU): the caller then runs torch's expression.
std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int8_quantize_rows: bf16 or float32 x [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  const at::Tensor xc = x.contiguous();
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({m, 1}, x.options().dtype(at::kFloat));
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto* xb = bf16 ? reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()) : nullptr;
  const float* xf = bf16 ? nullptr : xc.data_ptr<float>();
  float* sp = scales.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  std::atomic<bool> finite{true};
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> converted(bf16 ? k : 0);  // a bf16 row in float32; a float32 row is read in place
    for (int64_t r = begin; r < end && finite.load(std::memory_order_relaxed); ++r) {
      if (bf16) {
        for (int64_t j = 0; j < k; ++j) converted[j] = bf16_to_float(xb[r * k + j]);
      }
      const float* row = bf16 ? converted.data() : xf + r * k;
      float most = 0.f;
      bool nan = false;  // a NaN is never the max below: looked for apart
      for (int64_t j = 0; j < k; ++j) {
        most = std::max(most, std::fabs(row[j]));
        nan |= row[j] != row[j];
      }
      if (nan || !std::isfinite(most)) {
        finite = false;
        break;
      }
      float scale = most / 127.5f;
      if (scale == 0.f) scale = std::numeric_limits<float>::epsilon();
      sp[r] = scale;
      int8_t* out = qp + r * k;
      int64_t j = 0;
#if defined(__AVX2__)
      const __m256 divisor = _mm256_set1_ps(scale), low = _mm256_set1_ps(-128.f), high = _mm256_set1_ps(127.f);
      for (; j + 8 <= k; j += 8) {
        const __m256 rounded = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + j), divisor),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i ints = _mm256_cvtps_epi32(_mm256_min_ps(high, _mm256_max_ps(low, rounded)));
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), _mm_packs_epi16(words, words));
      }
#endif
      for (; j < k; ++j)
        out[j] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, std::nearbyint(row[j] / scale))));
    }
  });
  if (!finite) return {at::empty({0}, q.options()), at::empty({0}, scales.options())};
  return {q, scales};
}

// float32 -> bf16 as torch converts, NaN included (a row of x with a NaN has a NaN scale).
inline uint16_t to_bf16(float f) { return f != f ? uint16_t(0x7FC0) : float_to_bf16(f); }

// W8A8's integer sums back to floats (quant_kernels.Int8DynamicKernel): y[m, n] = float(sums[m, n]) * row_scale[m] *
// col_scale[n], each product rounded to float32 in that order, then to `dtype` (bfloat16 or float32): the bits of
// `(sums.float() * row_scale * col_scale).to(dtype)`, in one pass over the sums where torch's takes four.
at::Tensor int8_rescale(const at::Tensor& sums, const at::Tensor& row_scale, const at::Tensor& col_scale,
                        at::ScalarType dtype) {
  TORCH_CHECK(sums.dim() == 2 && sums.scalar_type() == at::kInt, "int8_rescale: int32 sums [M, N]");
  const int64_t m = sums.size(0), n = sums.size(1);
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.numel() == m,
              "int8_rescale: float32 row scales [M, 1]");
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_scale.numel() == n, "int8_rescale: float32 scales [N]");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "int8_rescale: a bfloat16 or float32 result");
  const at::Tensor sc = sums.contiguous(), rc = row_scale.contiguous(), cc = col_scale.contiguous();
  at::Tensor y = at::empty({m, n}, sums.options().dtype(dtype));
  const int32_t* sp = sc.data_ptr<int32_t>();
  const float* rp = rc.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  float* yf = dtype == at::kFloat ? y.data_ptr<float>() : nullptr;
  auto* yb = dtype == at::kFloat ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* row = sp + r * n;
      const float scale = rp[r];
      if (yf != nullptr) {
        for (int64_t j = 0; j < n; ++j) yf[r * n + j] = float(row[j]) * scale * cp[j];
      } else {
        for (int64_t j = 0; j < n; ++j) yb[r * n + j] = to_bf16(float(row[j]) * scale * cp[j]);
      }
    }
  });
  return y;
}

// The whole weight in `dtype` (float32 or bfloat16) for products of many rows run as a GEMM (quant_kernels.py,
// Int8Kernel): w[n, k] = float(q[n, k]) * scale[n], exact in float32 (an 8-bit integer times a bf16 scale), then
// rounded to `dtype` as torch's `.to()` rounds: `(weight.float() * scales.float()[:, None]).to(dtype)`'s bits in one
// pass over the weight where that expression takes three and an intermediate float32 copy.
at::Tensor int8_dequantize(const at::Tensor& weight, const at::Tensor& scales, at::ScalarType dtype) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_dequantize: a contiguous int8 [N, K] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == n,
              "int8_dequantize: contiguous bf16 scales [N]");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "int8_dequantize: to float32 or bfloat16");
  at::Tensor out = at::empty({n, k}, weight.options().dtype(dtype));
  const int8_t* wp = weight.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  float* of = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  auto* ob = dtype == at::kFloat ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int8_t* row = wp + r * k;
      const float scale = bf16_to_float(sp[r]);
      if (of != nullptr) {
        for (int64_t j = 0; j < k; ++j) of[r * k + j] = float(row[j]) * scale;
      } else {
        for (int64_t j = 0; j < k; ++j) ob[r * k + j] = to_bf16(float(row[j]) * scale);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(textgen, m) {
  m.def("int8_gemv(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("int8_rescale(Tensor sums, Tensor row_scale, Tensor col_scale, ScalarType dtype) -> Tensor");
  m.def("int8_quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("int8_dequantize(Tensor weight, Tensor scales, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int8_rescale", &int8_rescale);
  m.impl("int8_quantize_rows", &int8_quantize_rows);
  m.impl("int8_dequantize", &int8_dequantize);
}
