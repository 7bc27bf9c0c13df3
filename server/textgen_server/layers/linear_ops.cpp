// A bfloat16 projection of one row, y = x @ W^T (+ b), for batch-1 decode steps on CPUs with AVX512-BF16
// (layers/linear_choice.py, path `gemv`). At one row a projection reads its whole weight for two flops a value,
// so its speed is how fast the weight streams from memory: oneDNN's kernel reaches about two thirds of the
// read bandwidth there on some CPUs (benchmark/README.md, issue 25), this one streams several 16-output blocks
// at once, each a contiguous run of memory, with software prefetch.
//
// textgen::gemv_bf16_pack(w [N, K] bf16) -> packed [ceil(N/16), ceil(K/2), 16, 2]: output n's value pair k at
//   [n / 16, k, n % 16, :], zero-padded; a 16-output block is one contiguous run.
// textgen::gemv_bf16(x [M, K] bf16, packed, bias [N] bf16 or None, n, k_chunk) -> y [M, N] bf16, row by row
//   (each row streams the whole weight: at 2+ rows oneDNN's kernels, which reuse each loaded weight, win): each output
//   sums its value pairs in order with vdpbf16ps (a pair's odd product added, then its even one, each rounded
//   to float32), in runs of k_chunk values that are then added in order, plus the bias in float32, rounded once
//   to bf16. That is how oneDNN's bf16 matmul sums on AVX512-BF16 CPUs where it splits K into runs of that
//   length, and so F.linear's bits; linear_choice.py checks the bits on each shape before this kernel may serve
//   (and which k_chunk gives them).
// textgen::gemv_bf16_supported() -> bool: whether the library was built with AVX512-BF16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t LANES = 16;  // outputs per block: one float32 vector
constexpr int BLOCKS = 4;      // blocks streamed together (independent accumulators and memory streams)
// Value pairs ahead of the current one that each stream prefetches: 1 KiB, a few cache lines per stream.
constexpr int64_t PREFETCH_PAIRS = 32;

bool supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "gemv_bf16_pack: a 2-D bfloat16 weight");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t blocks = (n + LANES - 1) / LANES, pairs = (k + 1) / 2;
  at::Tensor padded = at::zeros({blocks * LANES, pairs * 2}, w.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);
  return padded.view({blocks, LANES, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)
// y[blocks b0 .. b0+B) for one row x; w points at block b0 of the packed weight, y at its first output.
template <int B>
void tile(const uint16_t* x, const uint16_t* w, int64_t pairs, int64_t k, const float* bias, uint16_t* y,
          int64_t n_valid, int64_t k_chunk) {
  const int64_t block_stride = pairs * 2 * LANES;  // elements of one packed block
  const int64_t run = k_chunk ? k_chunk / 2 : pairs;  // value pairs summed before they join the total
  // The totals stay in memory, touched once a run: with them in registers too, the accumulators would spill.
  __m512 total[B];
  for (int64_t start = 0; start < pairs; start += run) {
    const int64_t stop = std::min(pairs, start + run);
    __m512 acc[B];
    for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps();
    for (int64_t p = start; p < stop; ++p) {
      uint32_t pair = 0;  // an odd K's last pair has a zero partner: 0 * 0 added first changes no sum
      std::memcpy(&pair, x + 2 * p, 2 * p + 1 < k ? 4 : 2);
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int b = 0; b < B; ++b) {
        const uint16_t* at = w + b * block_stride + p * 2 * LANES;
        _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_PAIRS * 2 * LANES), _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(at);
        acc[b] = _mm512_dpbf16_ps(acc[b], xs, wv);
      }
    }
    for (int b = 0; b < B; ++b) total[b] = start ? _mm512_add_ps(total[b], acc[b]) : acc[b];
  }
  for (int b = 0; b < B; ++b) {
    const int64_t valid = n_valid - b * LANES;
    if (valid <= 0) break;
    const __mmask16 mask = valid >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    const __m512 bias16 = bias ? _mm512_maskz_loadu_ps(mask, bias + b * LANES) : _mm512_setzero_ps();
    const __m512 sum = bias ? _mm512_add_ps(total[b], bias16) : total[b];
    _mm256_mask_storeu_epi16(y + b * LANES, mask, (__m256i)_mm512_cvtneps_pbh(sum));
  }
}

#endif

at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                int64_t k_chunk) {
  TORCH_CHECK(supported(), "gemv_bf16: the library was built without AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "gemv_bf16: bfloat16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == LANES && packed.size(3) == 2 && packed.is_contiguous(),
              "gemv_bf16: a weight packed by gemv_bf16_pack");
  const int64_t blocks = packed.size(0), pairs = packed.size(1), k = x.size(-1);
  TORCH_CHECK(k <= 2 * pairs && k > 2 * pairs - 2 && n <= blocks * LANES && n > (blocks - 1) * LANES,
              "gemv_bf16: x or n does not match the packed weight");
  TORCH_CHECK(k_chunk >= 0 && k_chunk % 2 == 0, "gemv_bf16: k_chunk must be even");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "gemv_bf16: bias of ", n, " values expected");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t block_stride = pairs * 2 * LANES, tiles = (blocks + BLOCKS - 1) / BLOCKS;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * BLOCKS, n0 = b0 * LANES;
      for (int64_t r = 0; r < m; ++r) {
        const uint16_t* xr = xp + r * k;
        uint16_t* yr = yp + r * n + n0;
        const float* br = bp ? bp + n0 : nullptr;
        if (b0 + BLOCKS <= blocks) {
          tile<BLOCKS>(xr, wp + b0 * block_stride, pairs, k, br, yr, n - n0, k_chunk);
        } else {
          for (int64_t b = b0; b < blocks; ++b)
            tile<1>(xr, wp + b * block_stride, pairs, k, br ? br + (b - b0) * LANES : nullptr, yr + (b - b0) * LANES,
                    n - b * LANES, k_chunk);
        }
      }
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(textgen, m) {
  m.def("gemv_bf16_pack(Tensor w) -> Tensor");
  m.def("gemv_bf16(Tensor x, Tensor packed, Tensor? bias, int n, int k_chunk) -> Tensor");
  m.def("gemv_bf16_supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("gemv_bf16_pack", &pack);
  m.impl("gemv_bf16", &gemv);
}
