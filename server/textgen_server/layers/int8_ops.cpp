// 8-bit projections with one scale per output feature (eetq, 8-bit GPTQ/compressed-tensors quantized per channel:
// layers/quant_kernels.py, Int8Kernel): one row for batch-1 decode steps, many rows where the CPU multiplies bf16
// pairs (int8_rows, below), and W8A8's helpers. At one row the weight streams from
// memory once for two flops a byte; torch's _weight_int8pack_mm read it at 4.4-11.3 GB/s on a 2-core Zen 3 whose
// 2 threads read 14-18 GB/s, this op at 8.2-16.2 (benchmark/README.md, "Quantized models").
//
// textgen::int8_gemv(x [M, K] bf16, weight int8 [N, K], scales bf16 [N]) -> y bf16 [M, N], row by row (each row
//   streams the whole weight: only M = 1 is what it is for), y[n] = scale[n] * sum_k w[n, k] x[k], as torch's
//   kernel defines it: the sum in float32 (x read exactly as float32), times the scale, rounded once to bf16. The
//   sum's order is not torch's kernel's (8 lanes, k mod 8, each summed in order of k, then folded):
//   tests/test_int8_gemv.py checks the op against the float64 product within the rounding of its sums.
//
// textgen::int8_rows(x [M, K] bf16, weight int8 [N, K], scales bf16 [N]) -> y bf16 [M, N]: the same product for many
//   rows where the CPU multiplies bf16 pairs (AVX512-BF16; textgen::int8_rows_supported() says whether this build
//   does; K a multiple of 32, N of 16). Threads split the weight's blocks of 16 outputs; each block's int8 values are
//   turned once, for all the rows of a pass, into bf16 (exact: an int8 has at most 8 significant bits), and the rows
//   sum them against their own bf16 values with vdpbf16ps: each product exact in float32, the sums in float32 in
//   pairs of k (its own order: a row's bits are the same in any batch, but not int8_gemv's), times the scale, rounded
//   once to bf16. Where it beats torch's _weight_int8pack_mm (a few rows lose: the conversion) is measured at load
//   by quant_kernels.rows_band (figures: benchmark/README.md, "int8 at many rows").
// textgen::int8_quantize_rows(x [M, K] bf16 or float32) -> (q int8 [M, K], scale float32 [M, 1]): W8A8's
//   activations to integers as the compressed-tensors package quantizes them, torch's expression's bits in one pass
//   (below); empty tensors where a row holds an infinity or a NaN.
// textgen::int8_rescale(sums int32 [M, N], row_scale float32 [M, 1], col_scale float32 [N], dtype) -> [M, N]: W8A8's
//   integer sums back to floats, `(sums.float() * row_scale * col_scale).to(dtype)`'s bits in one pass (below).
// textgen::int8_dequantize(weight int8 [N, K], scales bf16 [N], dtype) -> [N, K]: the weight-only int8 weight for a
//   many-row GEMM, `(weight.float() * scales.float()[:, None]).to(dtype)`'s bits in one pass (below).
//
// int8_gemv's vector path: AVX2 + FMA (x86-64-v3, also what an AVX-512 build runs), four outputs at a time, each
// reading its own contiguous row of the weight, a quarter of the thread's outputs apart; elsewhere a scalar loop sums
// the same products in order of k. Threads split the outputs (at::parallel_for).
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

#if defined(__AVX512BF16__)
// int8_rows: the outputs of a block (one float32 vector), the rows of x one pass over the weight serves (their bf16
// values stay in L2 while the weight streams by), the rows summed at once over a block's pairs (their accumulators
// and the pair vector: 9 of AVX-512's 32 registers), and how far ahead a block's rows are asked for (256 bytes gave
// 0.92-0.97x the time of none at 4-64 rows; 512 and 1,024 no better).
constexpr int64_t PAIR_OUTPUTS = 16;
constexpr int64_t PAIR_PASS = 128;
constexpr int PAIR_ROWS = 8;
constexpr int64_t PAIR_AHEAD = 256;

// Eight rows of 32 bytes (k bytes apart from `base`) as eight columns of their 4-byte quads: cols[q] lane i holds row
// i's bytes 4q .. 4q + 3 (an 8 x 8 transpose of 32-bit values).
inline void quad_columns(const int8_t* base, int64_t k, __m256i (&cols)[8]) {
  __m256i r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + i * k));
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    cols[q] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x20);
    cols[q + 4] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x31);
  }
}

#if defined(__AVX512VBMI__)
// Every int8 value's bf16, as bytes for vpermi2b's 128-byte tables: low[|w|] (w's low byte: bf16(-w) differs from
// bf16(w) in the sign bit only, and |-128|, read as entry 0, has bf16(128)'s low byte, 0), high[w & 127] for w >= 0
// and high[128 + (w & 127)] for w < 0; and the byte orders that interleave a lane's low and high bytes into the bf16
// pairs of its bytes 0, 1 (`first`) and 2, 3 (`second`).
struct Bf16Bytes {
  alignas(64) uint8_t low[128];
  alignas(64) uint8_t high[256];
  alignas(64) uint8_t first[64];
  alignas(64) uint8_t second[64];
  Bf16Bytes() {
    for (int v = -128; v < 128; ++v) {
      const uint16_t bits = float_to_bf16(static_cast<float>(v));
      if (v >= 0) low[v] = static_cast<uint8_t>(bits & 0xFF);
      high[v >= 0 ? v : 256 + v] = static_cast<uint8_t>(bits >> 8);
    }
    for (int lane = 0; lane < 16; ++lane) {
      for (int j = 0; j < 2; ++j) {  // the pair's word j: its low byte from the low bytes, its high from the high (+64)
        first[4 * lane + 2 * j] = static_cast<uint8_t>(4 * lane + j);
        first[4 * lane + 2 * j + 1] = static_cast<uint8_t>(64 + 4 * lane + j);
        second[4 * lane + 2 * j] = static_cast<uint8_t>(4 * lane + 2 + j);
        second[4 * lane + 2 * j + 1] = static_cast<uint8_t>(64 + 4 * lane + 2 + j);
      }
    }
  }
};
#endif

// The block of 16 outputs from n0 (rows of w, k bytes apart), values k0 .. k0 + 31, as 16 bf16 pair vectors from
// `pairs`: lane o of vector p holds w[n0 + o, k0 + 2p] (low half) and w[n0 + o, k0 + 2p + 1], exact (|w| <= 128 has
// at most 8 significant bits: a float32's upper half). The rows' bytes are read in lines and transposed (gathering
// four bytes of 16 rows at a time took 1.4-1.7x as long at 4-16 rows); their next lines are asked for PAIR_AHEAD
// bytes ahead, 16 streams too many for the prefetchers to follow. With AVX512-VBMI each byte's bf16 is read from
// tables (Bf16Bytes), in half the operations of converting through float32 (benchmark/README.md, "int8 at many rows:
// each int8 value's bf16 read from tables"); the same bits either way.
inline void block_pairs(const int8_t* w, int64_t k, int64_t n0, int64_t k0, __m512i* pairs) {
  const int8_t* base = w + n0 * k + k0;
  if (k0 % 64 == 0) {
    for (int o = 0; o < 16; ++o) _mm_prefetch(reinterpret_cast<const char*>(base + o * k + PAIR_AHEAD), _MM_HINT_T0);
  }
  __m256i low[8], high[8];
  quad_columns(base, k, low);
  quad_columns(base + 8 * k, k, high);
#if defined(__AVX512VBMI__)
  static const Bf16Bytes bytes;
  const __m512i low0 = _mm512_load_si512(bytes.low), low1 = _mm512_load_si512(bytes.low + 64);
  const __m512i plus0 = _mm512_load_si512(bytes.high), plus1 = _mm512_load_si512(bytes.high + 64);
  const __m512i minus0 = _mm512_load_si512(bytes.high + 128), minus1 = _mm512_load_si512(bytes.high + 192);
  const __m512i first = _mm512_load_si512(bytes.first), second = _mm512_load_si512(bytes.second);
  for (int q = 0; q < 8; ++q) {
    const __m512i four = _mm512_inserti64x4(_mm512_castsi256_si512(low[q]), high[q], 1);
    const __m512i lo = _mm512_permutex2var_epi8(low0, _mm512_abs_epi8(four), low1);
    const __m512i hi = _mm512_mask_blend_epi8(_mm512_movepi8_mask(four), _mm512_permutex2var_epi8(plus0, four, plus1),
                                              _mm512_permutex2var_epi8(minus0, four, minus1));
    pairs[2 * q] = _mm512_permutex2var_epi8(lo, first, hi);
    pairs[2 * q + 1] = _mm512_permutex2var_epi8(lo, second, hi);
  }
#else
  for (int q = 0; q < 8; ++q) {
    const __m512i four = _mm512_inserti64x4(_mm512_castsi256_si512(low[q]), high[q], 1);
    __m512i bits[4];
    for (int b = 0; b < 4; ++b) {
      const __m512i value = _mm512_srai_epi32(_mm512_slli_epi32(four, 24 - 8 * b), 24);
      bits[b] = _mm512_castps_si512(_mm512_cvtepi32_ps(value));
    }
    pairs[2 * q] = _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(bits[0], 16), bits[1]);
    pairs[2 * q + 1] = _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(bits[2], 16), bits[3]);
  }
#endif
}

// R rows of x (bf16, k values each, read as k / 2 pairs) over a block's k / 2 pair vectors: acc[r] lane o, row r's
// sum for the block's output o, before the scale.
template <int R>
inline void rows_over_pairs(const uint32_t* const* x, const __m512i* pairs, int64_t half_k, __m512 (&acc)[R]) {
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < half_k; ++p) {
    const __m512bh wp = reinterpret_cast<__m512bh>(_mm512_load_si512(pairs + p));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_dpbf16_ps(acc[r], wp, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r][p]))));
    }
  }
}

// Rows [r0, r0 + R) of x against one block: y = bf16(sum * scale).
template <int R>
void block_rows(const uint32_t* x, int64_t k, int64_t r0, const __m512i* pairs, const float* scale, int64_t n,
                int64_t n0, uint16_t* y) {
  const uint32_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = x + (r0 + r) * (k / 2);
  __m512 acc[R];
  rows_over_pairs<R>(rows, pairs, k / 2, acc);
  const __m512 s = _mm512_loadu_ps(scale);
  for (int r = 0; r < R; ++r) store16(y + (r0 + r) * n + n0, _mm512_mul_ps(acc[r], s), first_lanes(16));
}
#endif

bool int8_rows_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_rows: x bf16 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_rows: a contiguous int8 [N, K] weight");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k && k % 32 == 0 && n % 16 == 0, "int8_rows: K a multiple of 32, N of 16");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == n,
              "int8_rows: contiguous bf16 scales [N]");
  TORCH_CHECK(int8_rows_supported(), "int8_rows: the library was built without AVX512-BF16");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
#if defined(__AVX512BF16__)
  if (m == 0 || n == 0) return y;
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  const int8_t* w = weight.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  std::vector<float> scale(n);
  for (int64_t j = 0; j < n; ++j) scale[j] = bf16_to_float(sp[j]);
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  for (int64_t p0 = 0; p0 < m; p0 += PAIR_PASS) {
    const int64_t rows = std::min(PAIR_PASS, m - p0);
    at::parallel_for(0, n / PAIR_OUTPUTS, 1, [&](int64_t begin, int64_t end) {
      std::vector<int32_t> scratch;  // the block's k / 2 pair vectors (64-byte loads)
      auto* pairs = reinterpret_cast<__m512i*>(on_cache_line(scratch, k / 2 * 16));
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * PAIR_OUTPUTS;
        for (int64_t k0 = 0; k0 < k; k0 += 32) block_pairs(w, k, n0, k0, pairs + k0 / 2);
        for (int64_t r0 = p0; r0 < p0 + rows; r0 += PAIR_ROWS) {
          with_count<PAIR_ROWS>(std::min<int64_t>(PAIR_ROWS, p0 + rows - r0), [&](auto count) {
            block_rows<decltype(count)::value>(xp, k, r0, pairs, scale.data() + n0, n, n0, yp);
          });
        }
      }
    });
  }
#endif
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
  m.def("int8_rows(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("int8_rows_supported() -> bool", &int8_rows_supported);
  m.def("int8_rescale(Tensor sums, Tensor row_scale, Tensor col_scale, ScalarType dtype) -> Tensor");
  m.def("int8_quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("int8_dequantize(Tensor weight, Tensor scales, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int8_rows", &int8_rows);
  m.impl("int8_rescale", &int8_rescale);
  m.impl("int8_quantize_rows", &int8_quantize_rows);
  m.impl("int8_dequantize", &int8_dequantize);
}
