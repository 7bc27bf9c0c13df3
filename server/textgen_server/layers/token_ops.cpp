// textgen::greedy_pick(scores) -> (ids, logprobs): the greedy choice of every row of a step's logits, in one pass
// over the row after the max instead of torch's max reduction plus a whole log_softmax matrix.
//
// scores [B, V], contiguous float32 or bfloat16 (read as float32, which is exact);
// ids int64 [B]: torch.max(scores, -1).indices, the first maximum, a NaN counting as one;
// logprobs float32 [B]: torch.log_softmax(scores.float(), -1)[row, id], bit for bit.
//
// For the bits, torch's CPU log_softmax (SoftMaxKernel.cpp, _vec_log_softmax_lastdim) is followed step by step:
// the row's max; exp(x - max) through torch's vector exp on W-lane vectors (W = 16 with AVX-512, 8 otherwise)
// summed in W lane sums, lane l holding columns l, l + W, ... in column order, the last partial vector adding to
// its first lanes only (vec::map_reduce_all); the lanes folded by torch's reduction (halves W/2 apart, then W/4,
// ..., 1 with AVX2 or AVX-512; one after another on an x86 CPU with neither), or one serial sum when V < W; the
// log by torch's vector log; and the logprob as (x - max) - log(sum). Denormals are not flushed, as torch's kernel
// does not flush them. test_token_ops.py compares the results with torch's.
//
// Which of those paths torch takes is decided at run time (its CPU capability, which ATEN_CPU_CAPABILITY can
// lower), this op's when it is compiled: textgen::greedy_pick_capability() names the op's path in torch's words
// ("AVX512", "AVX2", "DEFAULT"; "NONE" off x86, where torch's vectors are others), and the chooser uses the op
// only where the two agree.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

#include "cpu_ops.h"

namespace {

using namespace textgen_cpu;

#if defined(__AVX512F__)
extern "C" __m512 Sleef_logf16_u10(__m512) __attribute__((weak));
constexpr int W = 16;
constexpr bool TREE = true;
constexpr const char* CAPABILITY = "AVX512";

// torch's vector exp / log of W values, in place.
inline void exp_lanes(float* v) { _mm512_storeu_ps(v, torch_exp(_mm512_loadu_ps(v))); }
inline float log_lane(float x) {
  return Sleef_logf16_u10 ? _mm512_cvtss_f32(Sleef_logf16_u10(_mm512_set1_ps(x))) : std::log(x);
}
#elif defined(__AVX2__)
extern "C" __m256 Sleef_logf8_u10(__m256) __attribute__((weak));
constexpr int W = 8;
constexpr bool TREE = true;
constexpr const char* CAPABILITY = "AVX2";

inline void exp_lanes(float* v) { _mm256_storeu_ps(v, torch_exp(_mm256_loadu_ps(v))); }
inline float log_lane(float x) {
  return Sleef_logf8_u10 ? _mm256_cvtss_f32(Sleef_logf8_u10(_mm256_set1_ps(x))) : std::log(x);
}
#else
// torch's generic 32-byte vectors on x86: the libm's exp and log per lane, lanes summed one after another.
constexpr int W = 8;
constexpr bool TREE = false;
#if defined(__x86_64__) || defined(__i386__)
constexpr const char* CAPABILITY = "DEFAULT";
#else
constexpr const char* CAPABILITY = "NONE";
#endif

inline void exp_lanes(float* v) {
  for (int l = 0; l < W; ++l) v[l] = std::exp(v[l]);
}
inline float log_lane(float x) { return std::log(x); }
#endif

// The first maximum of row x [n] (a NaN counts as the maximum: the first NaN wins) and its value.
template <typename T>
std::pair<int64_t, float> first_max(const T* x, int64_t n) {
  float best = to_float(x[0]);
  int64_t at = 0;
  if (std::isnan(best)) return {0, best};
  for (int64_t i = 1; i < n; ++i) {
    const float v = to_float(x[i]);
    if (std::isnan(v)) return {i, v};
    if (v > best) {
      best = v;
      at = i;
    }
  }
  return {at, best};
}

#if defined(__AVX512F__)
// The same, 16 columns at a time: the max and whether any NaN first, then the first column holding it.
template <typename T>
std::pair<int64_t, float> first_max_avx512(const T* x, int64_t n) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = first_lanes(n - c);
    const __m512 v = load16(x + c, m);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    top = _mm512_mask_max_ps(top, m, top, v);
  }
  if (nan) return first_max(x, n);
  const float best = _mm512_reduce_max_ps(top);
  const __m512 target = _mm512_set1_ps(best);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(first_lanes(n - c), load16(x + c, first_lanes(n - c)), target,
                                                  _CMP_EQ_OQ);
    if (hit) return {c + __builtin_ctz(hit), best};
  }
  return {0, best};  // unreachable: the max is one of the values
}
#endif

// log(sum of exp(x - top)) over row x [n] in torch's order (see the header comment).
template <typename T>
float log_sum_exp_shifted(const T* x, int64_t n, float top) {
  alignas(64) float lanes[W], v[W];
#if defined(__AVX512F__)
  if (n >= W) {  // the same sums in registers
    const __m512 shift = _mm512_set1_ps(top);
    __m512 acc = torch_exp(_mm512_sub_ps(load16(x, first_lanes(W)), shift));
    const int64_t whole = n - n % W;
    for (int64_t c = W; c < whole; c += W) {
      acc = _mm512_add_ps(acc, torch_exp(_mm512_sub_ps(load16(x + c, first_lanes(W)), shift)));
    }
    if (whole < n) {
      const __mmask16 m = first_lanes(n - whole);
      acc = _mm512_mask_add_ps(acc, m, acc, torch_exp(_mm512_sub_ps(load16(x + whole, m), shift)));
    }
    return log_lane(fold_add(acc));
  }
#endif
  if (n < W) {
    for (int l = 0; l < W; ++l) v[l] = l < n ? to_float(x[l]) - top : 0.f;
    exp_lanes(v);
    float sum = v[0];
    for (int64_t l = 1; l < n; ++l) sum += v[l];
    return log_lane(sum);
  }
  for (int l = 0; l < W; ++l) lanes[l] = to_float(x[l]) - top;
  exp_lanes(lanes);
  const int64_t whole = n - n % W;
  for (int64_t c = W; c < whole; c += W) {
    for (int l = 0; l < W; ++l) v[l] = to_float(x[c + l]) - top;
    exp_lanes(v);
    for (int l = 0; l < W; ++l) lanes[l] += v[l];
  }
  if (whole < n) {
    const int64_t rest = n - whole;
    for (int l = 0; l < W; ++l) v[l] = l < rest ? to_float(x[whole + l]) - top : 0.f;
    exp_lanes(v);
    for (int64_t l = 0; l < rest; ++l) lanes[l] += v[l];
  }
  if (TREE) {
    for (int half = W / 2; half >= 1; half /= 2) {
      for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
    }
  } else {
    for (int l = 1; l < W; ++l) lanes[0] += lanes[l];
  }
  return log_lane(lanes[0]);
}

std::tuple<at::Tensor, at::Tensor> greedy_pick(const at::Tensor& scores) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kBFloat16,
              "greedy_pick: float32 or bfloat16 scores only");
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) > 0 && scores.is_contiguous(),
              "greedy_pick: scores must be contiguous [B, V] with V > 0");
  const int64_t rows = scores.size(0), width = scores.size(1);
  at::Tensor ids = at::empty({rows}, scores.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({rows}, scores.options().dtype(at::kFloat));
  auto* id = ids.data_ptr<int64_t>();
  auto* lp = logprobs.data_ptr<float>();
  auto pick = [&](auto raw) {
    using T = decltype(raw);
    const T* in = static_cast<const T*>(scores.data_ptr());
    // A row is a few microseconds of work: rows are split over threads only from 8 rows per thread.
    at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* row = in + r * width;
#if defined(__AVX512F__)
        const auto [at, top] = first_max_avx512(row, width);
#else
        const auto [at, top] = first_max(row, width);
#endif
        id[r] = at;
        lp[r] = (to_float(row[at]) - top) - log_sum_exp_shifted(row, width, top);
      }
    });
  };
  if (scores.scalar_type() == at::kFloat) {
    pick(float{});
  } else {
    pick(uint16_t{});
  }
  return {ids, logprobs};
}

std::string greedy_pick_capability() { return CAPABILITY; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(textgen, m) {
  m.def("greedy_pick(Tensor scores) -> (Tensor, Tensor)");
  m.def("greedy_pick_capability() -> str", &greedy_pick_capability);
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) { m.impl("greedy_pick", &greedy_pick); }
