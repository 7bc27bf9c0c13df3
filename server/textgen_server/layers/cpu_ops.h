// Helpers the shard's C++ CPU ops share (the attention, fused, token, linear, int4 and int8 ops): bfloat16 conversions
// that round as torch rounds, and torch's own vectorized exp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace textgen_cpu {

// Flush-to-zero and denormals-are-zero on this thread while in scope. A softmax's exp(x - max) or silu's exp(-x)
// of a very negative x underflows, and every float32 result or operand below 2^-126 costs a microcode assist
// (about a hundred cycles) otherwise: a prefill of a model whose scores span a wide range spent most of its
// softmax there (benchmark/README.md). What changes is only such a value itself, 0 instead of a denormal: an
// exp below 2^-126 added to 1 or to a sum of probabilities, or weighting a value, changes no float32 result.
// Elsewhere than on x86 it does nothing: the ops then run as torch's do.
#if defined(__x86_64__) || defined(__i386__)
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned int saved_;
};
#else
struct FlushDenormals {
  FlushDenormals() {}
};
#endif

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

// Outputs [i0, i1) of a one-row product in four quarters side by side: four(i, q) sums outputs i, i + q, i + 2q and
// i + 3q together for each i of the first quarter, one(i) each output left over. Summing four outputs that lie far
// apart keeps four weight streams from memory in flight where one output after another kept one: bf16 `gemv` and
// `int8_gemv` read their weights 1.1-1.45x faster so on a Zen 3 (benchmark/README.md, "Four weight streams").
template <typename Four, typename One>
inline void four_streams(int64_t i0, int64_t i1, const Four& four, const One& one) {
  const int64_t q = (i1 - i0) / 4;
  for (int64_t i = i0; i < i0 + q; ++i) four(i, q);
  for (int64_t i = i0 + 4 * q; i < i1; ++i) one(i);
}

#if defined(__AVX512F__)
inline __m512 load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// f(std::integral_constant<int, R>{}) with R = count, 1 <= count <= MAX: a run-time count of rows to the template
// argument of a kernel for that many (whose accumulators then stay in registers).
template <int MAX, typename F>
inline void with_count(int64_t count, F&& f) {
  if constexpr (MAX > 1) {
    if (count < MAX) return with_count<MAX - 1>(count, std::forward<F>(f));
  }
  f(std::integral_constant<int, MAX>{});
}

// `count` values of T in `storage` (resized), the first on a 64-byte cache line: for vector loads and stores of whole
// lines (a row split over two lines, int4_gemv's sums at 64 rows, took 1.2x the time).
template <typename T>
T* on_cache_line(std::vector<T>& storage, int64_t count) {
  static_assert(64 % sizeof(T) == 0, "whole values to a line");
  storage.resize(count + 64 / sizeof(T));
  return storage.data() + (-reinterpret_cast<uintptr_t>(storage.data()) & 63) / sizeof(T);
}

// The prefetch helpers, and any function or lambda that calls one, are always inlined: gcc's interprocedural
// analysis counts `__builtin_prefetch` as touching no memory, so a function whose only effects are prefetches is
// "const" to it, and a call to one that was not inlined first is deleted as dead code (at -O3 every prefetch of the
// paged decode op went so, through two lambdas; benchmark/README.md, "A head's slots side by side").
#define TEXTGEN_PREFETCH inline __attribute__((always_inline))

// Every cache line of `bytes` bytes from p, into all cache levels.
TEXTGEN_PREFETCH void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 3);
}

// The same with intent to write (prefetchw where the CPU has it): for lines the caller is about to store to.
TEXTGEN_PREFETCH void prefetch_lines_for_write(void* p, int64_t bytes) {
  char* c = static_cast<char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 1, 3);
}

// Share `part` of `parts` of the cache lines of `count` runs of `bytes` bytes at base + offsets[r] (elements of T),
// in order, asked into L2 (prefetcht2) only. A task that takes a tile's runs in several passes (head by head)
// calls it once a pass for the next tile, so those lines arrive spread over the work. In a bare loop over a tile
// read head by head, asking into L1 (prefetcht0) came at half the rate: a core holds only a few L1 misses in
// flight, and strided demand loads do not start the hardware's streams (benchmark/README.md, "W1's decode steps:
// reading the KV cache, and prefetches into L2").
template <typename T>
TEXTGEN_PREFETCH void prefetch_share(const T* base, const int64_t* offsets, int64_t count, int64_t bytes,
                                     int64_t part, int64_t parts) {
  const int64_t lines = (bytes + 63) / 64, total = count * lines;
  const int64_t first = part * total / parts, last = (part + 1) * total / parts;
  int64_t run = first / lines, line = first % lines;
  for (int64_t j = first; j < last; ++j) {
    __builtin_prefetch(reinterpret_cast<const char*>(base + offsets[run]) + line * 64, 0, 1);
    if (++line == lines) line = 0, ++run;
  }
}

inline float to_float(uint16_t x) { return bf16_to_float(x); }
inline float to_float(float x) { return x; }

// What the eager attention's bf16 matmul output does to a score or a probability; float32 keeps it.
inline float round_as(uint16_t, float f) { return round_bf16(f); }
inline float round_as(float, float f) { return f; }
inline void store_as(uint16_t* out, float f) { *out = float_to_bf16(f); }
inline void store_as(float* out, float f) { *out = f; }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// a[s]'s 16 lanes each summed as `fold_add` sums them (lanes 8 apart, then 4, 2, 1), so the same floats, but the
// 16 trees folded into one another: a shuffle-and-add per pair of vectors instead of a horizontal reduction per
// sum. Returns the 16 sums in slot order.
inline __m512 fold16(const __m512 (&a)[16]) {
  // Lanes i and i + 8: slot 2m's sums in the low half of b[m], slot 2m + 1's in the high half.
  __m512 b[8];
  for (int m = 0; m < 8; ++m) {
    b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  }
  // Lanes j and j + 4 of each half: c[n]'s 128-bit chunks are slots 4n .. 4n + 3.
  __m512 c[4];
  for (int n = 0; n < 4; ++n) {
    c[n] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * n], b[2 * n + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * n], b[2 * n + 1], 0xDD));
  }
  // Lanes k and k + 2 of each chunk, then k and k + 1.
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xEE));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_ps(c[2], c[3], 0x44), _mm512_shuffle_ps(c[2], c[3], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x88), _mm512_shuffle_ps(d0, d1, 0xDD));
  // e's lane 4k + j holds slot 4j + k.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}
#endif

#if defined(__AVX512F__)
// c[0] x^(N-1) + c[1] x^(N-2) + ... + c[N-1] by Horner's rule, a fused multiply-add a coefficient.
template <int N>
inline __m512 horner(__m512 x, const float (&c)[N]) {
  __m512 y = _mm512_set1_ps(c[0]);
  for (int i = 1; i < N; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(c[i]));
  return y;
}

// e^x for x <= 0 (Cephes' expf polynomial on x - n ln 2, scaled by 2^n): within about one float32 ulp of the
// libm's, as torch's own vectorized exp is. A scalar exp per score cost more than reading the keys.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // below, e^x is 0 in float32 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  const __m512 y = horner(r, {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f});
  return _mm512_scalef_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f))), n);
}

// round_bf16 on 16 lanes
inline __m512 round_bf16(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m512 round_as(uint16_t, __m512 f) { return round_bf16(f); }
inline __m512 round_as(float, __m512 f) { return f; }

// The sum of 16 lanes as torch folds them (VecReduceAllSIMD): lanes 8 apart, then 4, 2 and 1, written out so
// that no compiler's expansion of a horizontal add decides the order.
inline float fold_add(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
  return _mm512_cvtss_f32(v);
}

// The first n (< 16) lanes, or all 16.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// 16 values (the lanes of `m`, others 0) as float32, and back: a bfloat16 store rounds as torch does. All 16 lanes
// take the plain load or store, only a part the masked one: on the Zen 5 a masked load from the line a masked store
// had just written waited for that store to leave (rotary_ in place, 16 lanes at a time, 3.5-4x the time;
// benchmark/README.md, "Masked loads behind masked stores").
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m256i raw = m == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                  : _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p, __mmask16 m) {
  return m == 0xFFFF ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}
inline void store16(uint16_t* p, __m512 f, __mmask16 m) {
  const __m512i bits = _mm512_castps_si512(round_bf16(f));
  const __m256i packed = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
  if (m == 0xFFFF) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  } else {
    _mm256_mask_storeu_epi16(p, m, packed);
  }
}
inline void store16(float* p, __m512 f, __mmask16 m) {
  if (m == 0xFFFF) {
    _mm512_storeu_ps(p, f);
  } else {
    _mm512_mask_storeu_ps(p, m, f);
  }
}

// The paired order: where bf16 values of two keys interleaved column by column (vpunpck{l,h}wd, within 128-bit
// lanes) put the columns of each 32, as the pair products summing them keep them: columns 8k .. 8k + 3 in 128-bit
// lane k of the first 16, 8k + 4 .. 8k + 7 in lane k of the second (decode_attention.cpp's accumulate_pairs,
// prefill_attention.cpp's task_values). unpair puts 32 sums in that order (first: the first 16, second: the last
// 16) back in column order with two permutes; a loop over the columns' places compiled to gathers (the prefill op's
// output took 15% of a task's samples on W1's prompts).
inline void unpair(__m512& first, __m512& second) {
  const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 columns = _mm512_permutex2var_ps(first, low, second);
  second = _mm512_permutex2var_ps(first, high, second);
  first = columns;
}

// A row of `dim` (a multiple of 32) sums in the paired order to `out` in column order, rounded as store_as.
template <typename T>
inline void store_unpaired(T* out, const float* sums, int64_t dim) {
  for (int64_t c = 0; c < dim; c += 32) {
    __m512 first = _mm512_loadu_ps(sums + c), second = _mm512_loadu_ps(sums + c + 16);
    unpair(first, second);
    store16(out + c, first, first_lanes(16));
    store16(out + c + 16, second, first_lanes(16));
  }
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// SLEEF's expf, which torch_exp follows on either vector width: 1 / ln 2, ln 2 in two parts (Cody-Waite), and the
// coefficients of e^s's polynomial, highest power first.
constexpr float EXP_LOG2E = 1.44269502163f;
constexpr float EXP_LN2_HI = 0.693145751953125f, EXP_LN2_LO = 1.428606765330187e-06f;
constexpr float EXP_POLY[] = {1.98527617612853646e-4f, 1.39304355252534151e-3f, 8.33336077630519867e-3f,
                              4.16664853692054749e-2f, 1.66666671633720398e-1f, 0.5f};
#endif

#if defined(__AVX512F__)
// torch's vectorized exp on an AVX-512 CPU (SLEEF's 1-ulp expf, Sleef_expf16_u10 in libtorch_cpu), written out here
// to the same bits for every float32 (all 2^32 inputs compared with libtorch's, with and without FTZ/DAZ, NaN
// payloads included; test_fused_ops.py compares every bfloat16 through silu_mul). The call into libtorch took 6.5 of
// silu_mul's 9.6 ns a vector (benchmark/README.md, "torch's exp, inline").
// x = q ln2 + s, q = round(x / ln2), ln2 in two parts (Cody-Waite); e^s by a degree-7 polynomial, times 2^q. SLEEF
// multiplies by two powers of two (2^(q/2) each, so that q down to -149 reaches the subnormals); vscalefps rounds
// once where that does, so the same bits in one instruction. 0 below -104, infinity above 100.
inline __m512 torch_exp(__m512 x) {
  const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E))));
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-EXP_LN2_HI), x);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-EXP_LN2_LO), s);
  const __m512 u = horner(s, EXP_POLY);
  __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s), _mm512_set1_ps(1.f));
  e = _mm512_scalef_ps(e, qf);
  e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.f), _CMP_NLT_US), e);
  return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(_mm512_set1_ps(100.f), x, _CMP_LT_OQ), _mm512_set1_ps(INFINITY));
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// c[0] x^(N-1) + ... + c[N-1] on 8 lanes, as horner above.
template <int N>
inline __m256 horner(__m256 x, const float (&c)[N]) {
  __m256 y = _mm256_set1_ps(c[0]);
  for (int i = 1; i < N; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c[i]));
  return y;
}

// torch's vectorized exp on an AVX2 CPU (SLEEF's 1-ulp expf, Sleef_expf8_u10 in libtorch_cpu), written out as the
// AVX-512 one above is, with SLEEF's two power-of-two products (AVX2 has no vscalefps): the same bits for every
// float32 (all 2^32 inputs compared with libtorch's, with and without FTZ/DAZ, NaN payloads included).
inline __m256 torch_exp(__m256 x) {
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-EXP_LN2_HI), x);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-EXP_LN2_LO), s);
  const __m256 u = horner(s, EXP_POLY);
  __m256 e = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s), _mm256_set1_ps(1.f));
  const __m256i half = _mm256_srai_epi32(q, 1), bias = _mm256_set1_epi32(127);
  e = _mm256_mul_ps(e, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23)));
  e = _mm256_mul_ps(e, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_add_epi32(q, bias), half), 23)));
  e = _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-104.f), _CMP_LT_OQ), e);
  return _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.f), x, _CMP_LT_OQ));
}

// The AVX2 counterparts of the 16-lane helpers above, for CPUs without AVX-512 (8 float32 lanes).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// round_bf16 on 8 lanes
inline __m256 round_bf16(__m256 f) {
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m256 round_as(uint16_t, __m256 f) { return round_bf16(f); }
inline __m256 round_as(float, __m256 f) { return f; }

inline void store8(float* p, __m256 f) { _mm256_storeu_ps(p, f); }
inline void store8(uint16_t* p, __m256 f) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(f)), 16);
  // packus packs within each 128-bit half; the permute puts the two halves' four values side by side.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

#if defined(__AVX2__)
// 8 lanes folded by `op` as torch's AVX2 vectors fold them: lanes 4 apart, then 2 and 1. In AVX-512 builds too,
// whose ops also run 8-lane paths (int8_ops.cpp).
template <typename Op>
inline float fold8(__m256 v, Op op) {
  v = op(v, _mm256_permute2f128_ps(v, v, 0x01));
  v = op(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = op(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}
inline float fold_add(__m256 v) { return fold8(v, [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); }); }
inline float reduce_max(__m256 v) { return fold8(v, [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); }); }
#endif
}  // namespace textgen_cpu
