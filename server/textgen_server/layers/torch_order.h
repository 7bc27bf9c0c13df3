// torch's own bfloat16 products on an x86 CPU with AVX2 and FMA but no AVX-512, where torch has no oneDNN bf16
// kernels and computes them itself (linear_ops.cpp: projections; attention_products.cpp: a prefill's attention).
// Shared by those ops, which give torch's bits by summing in its order.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_ops.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define TEXTGEN_TORCH_ORDER 1
#include <immintrin.h>

namespace textgen_cpu {

// Torch's one-row bf16 product on AVX2 (at::native's bf16 dot with float32 arithmetic), output by output:
// - whole steps of 64 values: value i of a step into accumulator i / 8, lane i % 8 (8 accumulators of 8 lanes),
//   one fused multiply-add each;
// - the accumulators added pairwise (a += a + 4, then a += a + 2, then 0 += 1), then the 8 lanes folded the same
//   way (`fold_add`, cpu_ops.h);
// - the values after the last whole step, 16 at a time, into one more accumulator (lane l takes value l, then
//   8 + l), folded and added; the last K % 16 one by one, a fused multiply-add each;
// - rounded once to bf16.
// A bf16 value becomes float32 in the upper half of a 32-bit lane: unpacking 16 loaded values against zero does
// that in two instructions, but puts values 0-3 and 8-11 in one register, 4-7 and 12-15 in the other. Each lane
// still sums one value index of the step, so only which register holds which chain changes; x, converted once
// per row into `xp`, is stored in that order, and the pairwise sums take each chain's partner where it lies.
constexpr int64_t DOT_STEP = 64;
constexpr int64_t DOT_PREFETCH = 1024;  // values ahead (2 KiB): the next row or two of a small K

// x's row as float32: each whole step's 16-value groups as [0-3, 8-11, 4-7, 12-15], the rest in order.
inline void dot_operand(const uint16_t* raw, int64_t k, float* xp) {
  const int64_t main = k & ~(DOT_STEP - 1);
  for (int64_t g = 0; g < main; g += 16)
    for (int64_t i = 0; i < 16; ++i) xp[g + (i & 3) + ((i >> 3) << 2) + (((i >> 2) & 1) << 3)] =
        bf16_to_float(raw[g + i]);
  for (int64_t i = main; i < k; ++i) xp[i] = bf16_to_float(raw[i]);
}

// R outputs' sums at once, output r over the weight row w[r]: each in dot_row's order (below), their 64-value
// steps interleaved. A one-row projection streams its whole weight from memory, and one sequential stream per core
// leaves the memory system idle between its misses: four rows far apart in memory keep four streams in flight and
// read the weight 1.1-1.5x faster on a Zen 3 (benchmark/README.md, "Four weight streams"). More than four spill
// the accumulators (8 of them per row in 16 registers) and lose it again.
template <int R>
inline void dot_outputs(const float* xp, const uint16_t* const (&w)[R], int64_t k, float (&out)[R]) {
  const int64_t main = k & ~(DOT_STEP - 1), vec = k & ~int64_t(15);
  const __m256i zero = _mm256_setzero_si256();
  __m256 p[R][8];
  for (auto& row : p)
    for (auto& acc : row) acc = _mm256_setzero_ps();
  for (int64_t s = 0; s < main; s += DOT_STEP) {
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + s + DOT_PREFETCH), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + s + DOT_PREFETCH + 32), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + s + 16 * j));
        // p[r][2j]: values 0-3 (lanes 0-3 of accumulator 2j) and 8-11 (of 2j + 1); p[r][2j + 1]: 4-7 and 12-15
        p[r][2 * j] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + s + 16 * j),
                                      _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)), p[r][2 * j]);
        p[r][2 * j + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + s + 16 * j + 8),
                                          _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)), p[r][2 * j + 1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    // Accumulators a += a + 4 (registers j and j + 4 hold the same lanes of accumulators 2j, 2j+1 and 2j+4,
    // 2j+5), a += a + 2, then 0 += 1: accumulator 1's lanes lie in the upper halves. Then the lanes, as torch
    // folds them.
    const __m256 r0 = _mm256_add_ps(_mm256_add_ps(p[r][0], p[r][4]), _mm256_add_ps(p[r][2], p[r][6]));  // 0-3
    const __m256 r1 = _mm256_add_ps(_mm256_add_ps(p[r][1], p[r][5]), _mm256_add_ps(p[r][3], p[r][7]));  // 4-7
    float sum =
        fold_add(_mm256_add_ps(_mm256_permute2f128_ps(r0, r1, 0x20), _mm256_permute2f128_ps(r0, r1, 0x31)));
    __m256 tail = _mm256_setzero_ps();
    for (int64_t s = main; s < vec; s += 16) {
      tail = _mm256_fmadd_ps(_mm256_loadu_ps(xp + s), load8(w[r] + s), tail);
      tail = _mm256_fmadd_ps(_mm256_loadu_ps(xp + s + 8), load8(w[r] + s + 8), tail);
    }
    sum += fold_add(tail);
    for (int64_t s = vec; s < k; ++s) sum = std::fma(xp[s], bf16_to_float(w[r][s]), sum);
    out[r] = sum;
  }
}

inline float dot_row(const float* xp, const uint16_t* w, int64_t k) {
  const uint16_t* const rows[1] = {w};
  float out[1];
  dot_outputs<1>(xp, rows, k, out);
  return out[0];
}

}  // namespace textgen_cpu
#endif
