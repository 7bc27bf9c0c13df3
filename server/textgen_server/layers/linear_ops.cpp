// A projection y = x @ W^T (+ b) by textgen's own kernels on x86 CPUs (layers/linear_choice.py, path `gemv`): the
// rows of decode steps (up to 64) in float32 with AVX-512 or with AVX2 and FMA (there row by row) and in bfloat16
// where the CPU has AVX512-BF16; any number of rows in bfloat16 on a CPU with AVX2 and FMA but no AVX-512. At one
// row a projection reads its whole weight for two flops a value, so its speed is how fast the weight streams from
// memory; the GEMM libraries' kernels reach well below the read bandwidth there on some CPUs (benchmark/README.md,
// "gemv"). This one streams each thread's share of the weight as one contiguous run of memory, with software
// prefetch.
//
// textgen::gemv_pack(w [N, K]) -> packed: float32, and bf16 with AVX512-BF16, in blocks of LANES outputs (16 with
//   AVX-512, 8 with AVX2: one float32 vector), zero-padded: a step's values of block b are output n = b LANES + i's
//   value pair (bf16) or value (float32) at k, in i's order, and tiles of BLOCKS blocks (the last one shorter) lie
//   one after another, each step by step with its blocks' values side by side, so that a tile, which one thread
//   sums, is one run of memory (four blocks each a run of its own, four streams a thread, took 1.05-1.2x the time
//   on a Zen 4: benchmark/README.md). Its shape: bf16 [ceil(N/16), ceil(K/2), 32], float32 [ceil(N/LANES), K, LANES],
//   over memory in that order. bf16 in the AVX2 build: w itself, [N, K] (each output's sum reads its own row,
//   below).
// textgen::gemv(x [..., K], packed, bias [N] float32 or None, n, k_chunk) -> y [..., N] in x's dtype (with AVX-512
//   up to six rows at a time over each read of the weight, each row's sums as it would have alone; with AVX2 row
//   by row; the bias is float32 whatever x's dtype, converted once by the caller, not on every call). Each
//   output sums in order, in runs of k_chunk values (0: one run) that are then added in order, plus the bias,
//   in float32:
//   - float32: one fused multiply-add a value;
//   - bfloat16 with AVX512-BF16: vdpbf16ps a value pair (the pair's odd product added, then its even one, each
//     rounded to float32), the sum rounded once to bf16. That is how oneDNN's bf16 matmul sums on AVX512-BF16
//     CPUs where it splits K into runs of that length, and so F.linear's bits; linear_choice.py checks the bits
//     on each shape before this kernel may serve, and finds the k_chunk that gives them.
//   - bfloat16 in the AVX2 build (k_chunk 0, no bias): F.linear's bf16 product on such a CPU is torch's own dot
//     product with float32 arithmetic, one output of one row at a time, at every row count; this kernel sums in
//     its order (`dot_row`, torch_order.h), so again F.linear's bits, checked at load the same way. Torch's loop
//     converts x again for every output and is bound by its instructions, not by memory: this one converts x
//     once per row, reads one row's weight 1.3-1.45x faster, and 1.1-1.45x faster again by summing four outputs
//     far apart at once (four memory streams), and computes many rows 3-4x faster (blocks of outputs
//     whose weight rows stay in L2 while every row of x passes over them; benchmark/README.md, "bfloat16 `gemv`
//     on AVX2" and "bfloat16 on AVX2 at every row count").
// textgen::gemv_supported(dtype) -> bool: whether the library was built with the instructions `dtype` needs.
// textgen::gemv_sums_in_runs(dtype) -> bool: whether `dtype`'s sums take runs of k_chunk and a bias (False for the
//   AVX2 build's bfloat16, whose one order takes k_chunk 0 and no bias).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "torch_order.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TEXTGEN_GEMV 1
#include <immintrin.h>
#endif
#if defined(TEXTGEN_TORCH_ORDER)
#define TEXTGEN_GEMV_DOT 1  // bfloat16 in torch's AVX2 dot order
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;  // outputs per block: one float32 vector
#else
constexpr int64_t LANES = 8;
#endif
constexpr int BLOCKS = 4;      // blocks summed together (independent accumulators), one tile of the packing
// Steps ahead of the current one that a tile's stream prefetches: 8 KiB with AVX-512, 4 KiB with AVX2 (2 to 4 KiB
// read slower on the Zen 4, 16 to 32 KiB too: benchmark/README.md).
constexpr int64_t PREFETCH_STEPS = 32;

bool supported([[maybe_unused]] c10::ScalarType dtype) {
#if defined(TEXTGEN_GEMV)
  if (dtype == at::kFloat) return true;
#endif
#if defined(__AVX512BF16__) || defined(TEXTGEN_GEMV_DOT)
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

bool sums_in_runs(c10::ScalarType dtype) {
#if defined(TEXTGEN_GEMV_DOT)
  return dtype != at::kBFloat16;
#else
  return true;
#endif
}

// Values of x one step of the sum takes: a pair in bf16 (vdpbf16ps), one in float32.
template <typename T>
constexpr int64_t values_per_step() {
  return std::is_same_v<T, float> ? 1 : 2;
}

int64_t step_of(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? 1 : 2; }

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "gemv_pack: a 2-D float32 or bfloat16 weight");
  if (!sums_in_runs(w.scalar_type())) return w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), step = step_of(w);
  const int64_t blocks = (n + LANES - 1) / LANES, steps = (k + step - 1) / step;
  at::Tensor padded = at::zeros({blocks * LANES, steps * step}, w.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);
  const at::Tensor blocked =
      padded.view({blocks, LANES, steps, step}).permute({0, 2, 1, 3}).reshape({blocks, steps, LANES * step});
  // [tile][step][block of the tile][LANES * step]: the whole tiles, then the last one of blocks % BLOCKS blocks
  const int64_t whole = blocks / BLOCKS * BLOCKS;
  const at::Tensor tiles =
      blocked.narrow(0, 0, whole).view({whole / BLOCKS, BLOCKS, steps, LANES * step}).permute({0, 2, 1, 3});
  const at::Tensor rest = blocked.narrow(0, whole, blocks - whole).permute({1, 0, 2});
  return at::cat({tiles.reshape({-1}), rest.reshape({-1})}).view({blocks, steps, LANES * step});
}

#if defined(__AVX512F__)
using Acc = __m512;  // LANES float32 sums
inline Acc zero() { return _mm512_setzero_ps(); }
inline Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }

// Step p of B blocks: x's value (float32) or value pair (bf16) at p times each block's weights there (`at`, the
// blocks' values block_stride apart).
template <typename T, int B>
inline void step(const T* x, const T* at, int64_t block_stride, int64_t p, int64_t k, Acc (&acc)[B]) {
  if constexpr (std::is_same_v<T, float>) {
    const __m512 xs = _mm512_set1_ps(x[p]);
    for (int b = 0; b < B; ++b) acc[b] = _mm512_fmadd_ps(xs, _mm512_loadu_ps(at + b * block_stride), acc[b]);
  } else {
    uint32_t pair = 0;  // an odd K's last pair has a zero partner: 0 * 0 added first changes no sum
    if (2 * p + 1 < k) {  // sizes the compiler knows: a load, not a call to memcpy
      std::memcpy(&pair, x + 2 * p, 4);
    } else {
      std::memcpy(&pair, x + 2 * p, 2);
    }
    const __m512bh xs = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
    for (int b = 0; b < B; ++b)
      acc[b] = _mm512_dpbf16_ps(acc[b], xs, (__m512bh)_mm512_loadu_si512(at + b * block_stride));
  }
}

// Block b's total plus the bias into its valid outputs of y (`valid` of them, 1 .. LANES).
template <typename T>
inline void store(Acc total, const float* bias, T* y, int64_t valid) {
  const __mmask16 mask = valid >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const __m512 sum = bias ? _mm512_add_ps(total, _mm512_maskz_loadu_ps(mask, bias)) : total;
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(y, mask, sum);
  } else {
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(sum));
  }
}
#elif defined(TEXTGEN_GEMV)
using Acc = __m256;  // AVX2: float32 only
inline Acc zero() { return _mm256_setzero_ps(); }
inline Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }

template <typename T, int B>
inline void step(const T* x, const T* at, int64_t block_stride, int64_t p, [[maybe_unused]] int64_t k,
                 Acc (&acc)[B]) {
  static_assert(std::is_same_v<T, float>, "AVX2 gemv: float32 only");
  const __m256 xs = _mm256_broadcast_ss(x + p);
  for (int b = 0; b < B; ++b) acc[b] = _mm256_fmadd_ps(xs, _mm256_loadu_ps(at + b * block_stride), acc[b]);
}

template <typename T>
inline void store(Acc total, const float* bias, T* y, int64_t valid) {
  alignas(32) float sums[LANES];
  _mm256_store_ps(sums, total);
  for (int64_t i = 0; i < std::min(valid, LANES); ++i) y[i] = bias ? sums[i] + bias[i] : sums[i];
}
#endif

#if defined(TEXTGEN_GEMV)
// Rows that go together over each read of a tile's weight: with AVX-512, R x B <= 24 accumulators, a step's B weight
// vectors and one row's broadcast value (bf16: pair) in registers (29 of the 32); AVX2's 16 registers take one row.
#if defined(__AVX512F__)
constexpr int GROUP_ROWS = 6;
#else
constexpr int GROUP_ROWS = 1;
#endif

// y for R rows of x (k apart; y's n apart) and the B blocks of one tile (w at the tile in the packed weight, y at its
// first output, n_valid of the tile's outputs in y): each row's sums as `step` makes them for it alone, run by run;
// the R rows' steps one after another over the same weight vectors, which the compiler loads once for them.
template <typename T, int B, int R>
void tile(const T* x, int64_t k, const T* w, int64_t steps, const float* bias, T* y, int64_t n, int64_t n_valid,
          int64_t k_chunk) {
  constexpr int64_t per_step = values_per_step<T>();
  constexpr int64_t block_stride = per_step * LANES;  // a step's values of one block, its blocks side by side
  constexpr int64_t step_stride = B * block_stride;
  const int64_t run = k_chunk ? k_chunk / per_step : steps;  // steps summed before they join the total
  Acc total[R][B];
  for (int64_t start = 0; start < steps; start += run) {
    const int64_t stop = std::min(steps, start + run);
    Acc acc[R][B];
    for (auto& row : acc) {
      for (auto& a : row) a = zero();
    }
    for (int64_t p = start; p < stop; ++p) {
      const T* at = w + p * step_stride;
      for (int b = 0; b < B; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(at + b * block_stride + PREFETCH_STEPS * step_stride),
                     _MM_HINT_T0);
      for (int r = 0; r < R; ++r) step<T, B>(x + r * k, at, block_stride, p, k, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      for (int b = 0; b < B; ++b) total[r][b] = start ? add(total[r][b], acc[r][b]) : acc[r][b];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B && b * LANES < n_valid; ++b) {
      store<T>(total[r][b], bias ? bias + b * LANES : nullptr, y + r * n + b * LANES, n_valid - b * LANES);
    }
  }
}

// Every row of x [m, k] against the packed weight, the tiles of BLOCKS blocks over threads, up to GROUP_ROWS rows at
// once over each read of a tile (one row at a time streamed the weight once a row and lost to the libraries' kernels
// from two rows on; benchmark/README.md, "2-64 rows in `gemv`"): the same sums either way.
template <typename T>
void rows(const T* x, int64_t m, int64_t k, const T* w, int64_t blocks, int64_t steps, const float* bias, T* y,
          int64_t n, int64_t k_chunk) {
  const int64_t block_elems = steps * values_per_step<T>() * LANES, tiles = (blocks + BLOCKS - 1) / BLOCKS;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * BLOCKS, n0 = b0 * LANES;
      for (int64_t r0 = 0; r0 < m; r0 += GROUP_ROWS) {
        // The last tile takes the 1-3 blocks left.
        textgen_cpu::with_count<BLOCKS>(std::min<int64_t>(BLOCKS, blocks - b0), [&](auto b) {
          textgen_cpu::with_count<GROUP_ROWS>(std::min<int64_t>(GROUP_ROWS, m - r0), [&](auto r) {
            tile<T, decltype(b)::value, decltype(r)::value>(x + r0 * k, k, w + b0 * block_elems, steps,
                                                            bias ? bias + n0 : nullptr, y + r0 * n + n0, n, n - n0,
                                                            k_chunk);
          });
        });
      }
    }
  });
}
#endif

#if defined(TEXTGEN_GEMV_DOT)
// Bytes of weight rows one block of outputs takes: they stay in a core's L2 cache while every row of x, converted
// to float32 (twice a bf16 weight row's bytes) and held in L1, passes over them. A single row reuses nothing, so it
// takes a thread's whole range as one block: its four streams (below) then run the range's length.
constexpr int64_t DOT_BLOCK_BYTES = 128 * 1024;

// Outputs [i0, i1) of one row xr, four far apart at a time (textgen_cpu::four_streams).
void dot_block(const float* xr, const uint16_t* w, int64_t k, int64_t i0, int64_t i1, at::BFloat16* yr) {
  textgen_cpu::four_streams(
      i0, i1,
      [&](int64_t i, int64_t q) {
        const uint16_t* const rows[4] = {w + i * k, w + (i + q) * k, w + (i + 2 * q) * k, w + (i + 3 * q) * k};
        float out[4];
        textgen_cpu::dot_outputs<4>(xr, rows, k, out);
        for (int r = 0; r < 4; ++r) yr[i + r * q] = at::BFloat16(out[r]);
      },
      [&](int64_t i) { yr[i] = at::BFloat16(textgen_cpu::dot_row(xr, w + i * k, k)); });
}

// Every row of x [m, k] (m >= 1) against w [n, k], the outputs split over threads.
void dot_rows(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* w, at::BFloat16* y, int64_t n) {
  std::vector<float> xps(static_cast<size_t>(m * k));
  const auto* raw = reinterpret_cast<const uint16_t*>(x);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) textgen_cpu::dot_operand(raw + r * k, k, xps.data() + r * k);
  });
  const auto* wp = reinterpret_cast<const uint16_t*>(w);
  const int64_t block = m == 1 ? n : std::max<int64_t>(1, DOT_BLOCK_BYTES / (2 * std::max<int64_t>(k, 1)));
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = begin; i0 < end; i0 += block) {
      const int64_t i1 = std::min(end, i0 + block);
      // The first row reads the block from memory; the others find it in L2, where four outputs' 32 accumulators,
      // more than the registers hold, made 4 to 128 rows 10-40% slower (measured).
      dot_block(xps.data(), wp, k, i0, i1, y);
      for (int64_t r = 1; r < m; ++r) {
        const float* xr = xps.data() + r * k;
        for (int64_t i = i0; i < i1; ++i) y[r * n + i] = at::BFloat16(textgen_cpu::dot_row(xr, wp + i * k, k));
      }
    }
  });
}

at::Tensor dot_gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t n,
                    int64_t k_chunk) {
  const int64_t k = x.size(-1);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "gemv: a weight packed by gemv_pack");
  TORCH_CHECK(w.size(1) == k && w.size(0) == n, "gemv: x or n does not match the packed weight");
  TORCH_CHECK(k_chunk == 0, "gemv: bfloat16 on this build sums in torch's one order: k_chunk must be 0");
  TORCH_CHECK(!bias.has_value(), "gemv: bfloat16 on this build takes no bias");
  const at::Tensor flat = x.reshape({-1, k}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  if (flat.size(0) == 0) return y;  // dot_rows reads a first row
  dot_rows(flat.data_ptr<at::BFloat16>(), flat.size(0), k, w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), n);
  return y;
}
#endif

at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                int64_t k_chunk) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(packed.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16),
              "gemv: x and the packed weight of one dtype, float32 or bfloat16");
  TORCH_CHECK(supported(dtype), "gemv: the library was built without the instructions for ", dtype);
#if defined(TEXTGEN_GEMV_DOT)
  if (!sums_in_runs(dtype)) return dot_gemv(x, packed, bias, n, k_chunk);
#endif
  const int64_t step = step_of(x);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == LANES * step && packed.is_contiguous(),
              "gemv: a weight packed by gemv_pack");
  const int64_t blocks = packed.size(0), steps = packed.size(1), k = x.size(-1);
  TORCH_CHECK(k <= steps * step && k > (steps - 1) * step && n <= blocks * LANES && n > (blocks - 1) * LANES,
              "gemv: x or n does not match the packed weight");
  TORCH_CHECK(k_chunk >= 0 && k_chunk % step == 0, "gemv: k_chunk must be a multiple of ", step);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "gemv: a contiguous float32 bias of ", n, " values expected");
  }
  const at::Tensor flat = x.reshape({-1, k}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
#if defined(TEXTGEN_GEMV)
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t m = flat.size(0);
  if (dtype == at::kFloat) {
    rows<float>(flat.data_ptr<float>(), m, k, packed.data_ptr<float>(), blocks, steps, bp, y.data_ptr<float>(), n,
                k_chunk);
  } else {
#if defined(__AVX512BF16__)
    rows<at::BFloat16>(flat.data_ptr<at::BFloat16>(), m, k, packed.data_ptr<at::BFloat16>(), blocks, steps, bp,
                       y.data_ptr<at::BFloat16>(), n, k_chunk);
#endif
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(textgen, m) {
  m.def("gemv_pack(Tensor w) -> Tensor");
  m.def("gemv(Tensor x, Tensor packed, Tensor? bias, int n, int k_chunk) -> Tensor");
  m.def("gemv_supported(ScalarType dtype) -> bool", &supported);
  m.def("gemv_sums_in_runs(ScalarType dtype) -> bool", &sums_in_runs);
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("gemv_pack", &pack);
  m.impl("gemv", &gemv);
}
