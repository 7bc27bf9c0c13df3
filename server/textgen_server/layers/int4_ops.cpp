// A 4-bit projection a row at a time, y = x @ W^T, for decode steps (layers/quant_kernels.py, Int4Kernel): it
// reads torch's own packed weight and scales, so that no second copy of the weight is kept. At one row the weight
// streams from memory once for two flops a value; torch's _weight_int4pack_mm_for_cpu reaches well below the read
// bandwidth there on AVX2 CPUs (about 5 GB/s of packed weight on a 2-core Zen 3 that copies 19 GB/s).
//
// textgen::int4_gemv(x [M, K] bf16, packed uint8 [N, K/2], scales_offsets bf16 [K/G, N, 2], group_size G) -> y
//   bf16 [M, N]. On the integer paths of layouts 1 and 2 (below) rows share each read of the weight: four at a time
//   on layout 1, all of a pass's (up to ROWS_PER_PASS) on layout 2, where each block of the weight is gathered once
//   for them; elsewhere row by row, each row streaming the whole weight. quant_kernels.gemv_until measures up to
//   which row count that runs faster than torch's int4 kernel or a GEMM on the weight dequantized for the call (up
//   to 64 rows row by row on the 2-core Zen 3; every count on layout 2 on a Zen 4 with VNNI). With
//   w[n, k] = (q[n, k] - 8) * scale[g, n] + offset[g, n], g = k / G, as torch's kernel defines it. Computed as
//   y[n] = sum_g ( scale[g, n] * (sum_{k in g} q[n, k] x[k] - 8 X[g]) + offset[g, n] * X[g] ), X[g] = sum_{k in g}
//   x[k], the result rounded once to bf16. On the vector paths of layout 1 (AVX2's) and of layout 2 (AVX-512's,
//   where the CPU has AVX512-VNNI and AVX512-VBMI) x is first put on a grid of 127 steps each side of the largest |x|
//   of its 32 values (quantize_row: within 1/254 of that value, as llama.cpp's Q8_0 blocks put a Q4_0 product's
//   activations), so that the inner sums are exact integer sums: about 23 vector operations per 64 bytes of weight
//   on AVX2 (58 on its float path), 8 on AVX-512; elsewhere every sum is in float32 on x read exactly. The bits
//   are not torch's kernel's (it dequantizes each weight to float first): tests/test_int4_gemv.py checks the op
//   against the float32 product within those bounds.
// textgen::int4_dequantize(packed, scales_offsets, group_size, dtype) -> [N, K] in float32 or bfloat16 (a transposed
//   view): the weight as that formula gives it, for many-row products run as a GEMM (layers/quant_kernels.py).
// textgen::int4_gemv_layout() -> int: the packed layout (below) torch uses in this process, 0, 1 or 2.
//
// torch's CPU packed layout (_convert_weight_to_int4pack_for_cpu(q [N, K] int32, inner_k_tiles), aten/src/ATen/
// native/cpu/int4mm_kernel.cpp, weight_to_int4pack_kernel; checked here by packing known patterns): the N outputs
// are cut into blocks of B outputs (the last one nb = N mod B, a multiple of 16, when B does not divide N); block i
// starts at byte i * B * K / 2 and holds, for each k in order, a row of nb / 2 bytes. Within a row, by the CPU
// capability torch dispatched the pack to (its runtime choice: ATEN_CPU_CAPABILITY can lower it):
//   0 "pairs" (no AVX2, and every partial block): byte j = q[n0 + 2j] | q[n0 + 2j + 1] << 4; B = 32;
//   1 AVX2, a full block of B = 32: byte j (0..15) = q[n0 + j] | q[n0 + 16 + j] << 4;
//   2 AVX-512, a full block of B = 64: byte j (0..15) = q[n0 + j] | q[n0 + 32 + j] << 4,
//                                      byte 16 + j = q[n0 + 16 + j] | q[n0 + 48 + j] << 4.
// So in layouts 1 and 2 alike, byte j's low nibble is output n0 + j and its high one n0 + nb/2 + j (the row's low
// nibbles are its first nb/2 outputs in order, the high ones the next nb/2); in layout 0 the low and high nibbles
// interleave. The op finds which layout torch uses by packing a small probe once (the pack's own result, not a
// guess from this library's compile flags). A full block of layout 1 or 2 is read 8 bytes at a time, zero-extended
// to 8 int32 lanes whose low nibbles are 8 consecutive outputs and high nibbles the 8 outputs nb/2 further on;
// pair rows are first put in output order.
//
// Vector paths: AVX2 + FMA (x86-64-v3, also what an AVX-512 build runs but for layout 2's integer blocks, which
// take AVX512-VNNI and AVX512-VBMI where the CPU has them); elsewhere a scalar loop computes the same
// formula. Threads split the blocks (at::parallel_for), each streaming a contiguous run of the packed weight.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_ops.h"

namespace {

using namespace textgen_cpu;

// How far ahead of the row being read a block's stream prefetches (software prefetch gained ~5% over the
// hardware's alone on the 2-core Zen 3; 1,536 bytes rather than 512 read the 1b model's largest projections,
// 11264x2048 and 2048x5632, at 12-13 GB/s instead of 10-11: benchmark/README.md, "Quantized models").
constexpr int64_t PREFETCH_BYTES = 1536;

enum Layout : int { PAIRS = 0, SPLIT32 = 1, SPLIT64 = 2 };

// Which layout torch's pack writes in this process: a probe of 64 outputs whose q[n, 0] = n / 16 + 1 gives byte 0 =
// q[0] | q[1] << 4 = 0x11 (pairs), q[0] | q[16] << 4 = 0x21 (AVX2) or q[0] | q[32] << 4 = 0x31 (AVX-512).
int detect_layout() {
  at::Tensor q = at::zeros({64, 32}, at::kInt);
  int32_t* qp = q.data_ptr<int32_t>();
  for (int64_t n = 0; n < 64; ++n) qp[n * 32] = static_cast<int32_t>(n / 16 + 1);
  const at::Tensor packed = at::_convert_weight_to_int4pack_for_cpu(q, 2).contiguous();
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == 64 * 16,
              "int4_gemv: torch's int4 pack changed its output");
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const int layout = p[0] == 0x11 ? PAIRS : p[0] == 0x21 ? SPLIT32 : p[0] == 0x31 ? SPLIT64 : -1;
  TORCH_CHECK(layout >= 0, "int4_gemv: torch's int4 pack writes an unknown layout (byte ", int(p[0]), ")");
  return layout;
}

int64_t layout() {
  static const int value = detect_layout();
  return value;
}

int64_t block_outputs(int lay) { return lay == SPLIT64 ? 64 : 32; }

// Output j (0 .. nb) of a row of nb / 2 bytes as torch packed it.
inline int nibble(const uint8_t* row, int64_t nb, int64_t j, bool full, int lay) {
  if (!full || lay == PAIRS) return (row[j / 2] >> (4 * (j & 1))) & 15;
  const int64_t half = nb / 2;  // layouts 1 and 2 alike: byte j % half, low nibble for the first half
  return (row[j % half] >> (j < half ? 0 : 4)) & 15;
}

// A (scale, offset) bf16 pair read as one uint32: the scale in the low half, the offset in the high one.
struct ScaleOffset {
  float scale, offset;
  explicit ScaleOffset(uint32_t pair)
      : scale(bf16_to_float(static_cast<uint16_t>(pair & 0xFFFF))),
        offset(bf16_to_float(static_cast<uint16_t>(pair >> 16))) {}
};

// Scalar path: block [n0, n0 + nb) of the output, any layout.
void block_scalar(const float* x, const float* xsum, const uint8_t* w, const uint32_t* so, int64_t n_total,
                  int64_t n0, int64_t nb, int64_t k, int64_t g, bool full, int lay, float* y) {
  const int64_t groups = k / g;
  for (int64_t j = 0; j < nb; ++j) {
    float total = 0.f;
    for (int64_t gi = 0; gi < groups; ++gi) {
      float acc = 0.f;
      for (int64_t kk = gi * g; kk < (gi + 1) * g; ++kk)
        acc += float(nibble(w + kk * (nb / 2), nb, j, full, lay)) * x[kk];
      const ScaleOffset so_pair(so[gi * n_total + n0 + j]);
      total += so_pair.scale * (acc - 8.f * xsum[gi]) + so_pair.offset * xsum[gi];
    }
    y[j] = total;
  }
}

// A row x quantized for the integer path, 32 values at a time (llama.cpp's Q8_0 blocks): x[k] ~ step[b] * q[k],
// q = x / step rounded, in [-127, 127] (step = the block's largest |x| / 127, so within step / 2 of x: 1/254 of that
// largest |x|, where bf16 itself rounds x by up to 2^-9 of x). `xsum[g]`: group g's sum over its blocks of step[b]
// times the block's sum of q (the x the offsets and the centring multiply).
constexpr int64_t X_BLOCK = 32;
// Rows summed at once over a block's weights on the integer paths (block_ints: each read of the weight; block_vnni:
// each pass over a block's gathered quads): on layout 2 four rows' accumulators (16 registers) and the shared nibbles
// fill AVX-512's 32.
constexpr int64_t ROWS_AT_ONCE = 4;
// Rows of x a thread converts and quantizes, or whose outputs it rounds, at least (int4_gemv).
constexpr int64_t ROW_GRAIN = 16;
// Rows of x that one pass over the weight serves (int4_gemv), so that their values and sums stay near the core while
// the weight streams by: a prefill's 9,239 rows in one pass ran at 244 GOP/s where 64 rows ran at 500. On the Zen 4,
// 2,048 rows of the small model's and the `1b` model's shapes ran fastest in passes of 256 (of 64-512; benchmark/
// README.md, "int4 at many rows").
constexpr int64_t ROWS_PER_PASS = 256;
// A quantized row's values (k), steps (k / X_BLOCK) and group sums (k / g), in int4_gemv's buffers: all rows' values
// side by side in one of them, whose 32-byte blocks each lie in one cache line (with a vector a row, 64 rows took 1.3x
// the time in some processes and not in others).
struct RowInts {
  int8_t* q;
  float *step, *xsum;
};

#if defined(__AVX2__) && defined(__FMA__)
// x (float32 [k]) into `out`; false where a value is not finite (the float path then computes the row, carrying
// the NaN or infinity as float sums do) or a block's values are all tiny but not all zero. q is x times 1 / step,
// rounded to the nearest integer, ties to even.
bool quantize_row(const float* x, int64_t k, int64_t g, RowInts& out) {
  const int64_t blocks = k / X_BLOCK;
  std::fill_n(out.xsum, k / g, 0.f);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 infinity = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the two packs' lanes back in order
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * X_BLOCK;
    __m256 v[4], most = _mm256_setzero_ps(), not_finite = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 size = _mm256_and_ps(v[i], magnitude);
      most = _mm256_max_ps(most, size);  // (a NaN does not stay in a max: it is looked for apart)
      not_finite = _mm256_or_ps(not_finite, _mm256_cmp_ps(size, infinity, _CMP_NLT_UQ));
    }
    if (_mm256_movemask_ps(not_finite) != 0) return false;
    const float largest = reduce_max(most);
    // Below this the step is not a normal float32 and 1 / step may overflow.
    if (largest > 0.f && largest < 127.f * std::numeric_limits<float>::min()) return false;
    const float step = largest > 0.f ? largest / 127.f : 1.f;
    const __m256 inverse = _mm256_set1_ps(1.f / step);
    __m256i q[4], sums = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
      sums = _mm256_add_epi32(sums, q[i]);
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q + b * X_BLOCK),
                        _mm256_permutevar8x32_epi32(bytes, in_order));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sums);
    const int32_t qsum = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
    out.step[b] = step;
    out.xsum[b * X_BLOCK / g] += step * float(qsum);
  }
  return true;
}

// A row's nibbles in output order: V vectors of 16 bytes (16 outputs each), nb = 16 V.
template <int V>
inline void row_nibbles(const uint8_t* row, bool split, __m128i (&out)[V]) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  if constexpr (V == 1) {  // 8 bytes: always pairs (a 16-output block)
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row));
    out[0] = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
  } else if constexpr (V == 3) {  // 24 bytes: pairs (a 48-output tail of an AVX-512 pack)
    const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
    const __m128i b1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16));
    const __m128i lo0 = _mm_and_si128(b0, mask), hi0 = _mm_and_si128(_mm_srli_epi16(b0, 4), mask);
    out[0] = _mm_unpacklo_epi8(lo0, hi0);
    out[1] = _mm_unpackhi_epi8(lo0, hi0);
    out[2] = _mm_unpacklo_epi8(_mm_and_si128(b1, mask), _mm_and_si128(_mm_srli_epi16(b1, 4), mask));
  } else {
    static_assert(V == 2 || V == 4);
    for (int h = 0; h < V / 2; ++h) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * h));
      const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
      if (split) {  // low nibbles: outputs 16 h .. 16 h + 15; high: the same 8 V outputs further
        out[h] = lo;
        out[h + V / 2] = hi;
      } else {
        out[2 * h] = _mm_unpacklo_epi8(lo, hi);
        out[2 * h + 1] = _mm_unpackhi_epi8(lo, hi);
      }
    }
  }
}

// One group's sums into the outputs: total += scale * (acc - 8 X) + offset * X, for 8 A outputs whose (scale, offset)
// bf16 pairs are read as uint32 from `pairs` (the scale in the low half, the offset in the high one), X = xsum.
template <int A>
inline void add_group(const __m256 (&acc)[A], float xsum, const uint32_t* pairs, __m256 (&total)[A]) {
  const __m256i high16 = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256 xs = _mm256_set1_ps(xsum), xs8 = _mm256_set1_ps(8.f * xsum);
  for (int a = 0; a < A; ++a) {
    const __m256i sov = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 8 * a));
    const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(sov, 16));
    const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(sov, high16));
    total[a] = _mm256_fmadd_ps(s, _mm256_sub_ps(acc[a], xs8), total[a]);
    total[a] = _mm256_fmadd_ps(o, xs, total[a]);
  }
}

// A full block of layout 1 or 2, rows of R bytes: each 8 bytes zero-extended to 8 int32 lanes straight from memory,
// whose low nibbles are 8 consecutive outputs and high nibbles the 8 outputs R further on.
template <int R>
void block_split(const float* x, const float* xsum, const uint8_t* w, const uint32_t* so, int64_t n_total,
                 int64_t n0, int64_t k, int64_t g, float* y) {
  constexpr int C = R / 8, A = 2 * C;  // 8-byte chunks of a row; 8-lane float accumulators
  __m256 total[A];
  for (int a = 0; a < A; ++a) total[a] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(15);
  for (int64_t k0 = 0, gi = 0; k0 < k; k0 += g, ++gi) {
    // two sets of accumulators, even and odd k: twice the multiply-adds in flight of one chain's latency
    __m256 acc[A], odd[A];
    for (int a = 0; a < A; ++a) acc[a] = odd[a] = _mm256_setzero_ps();
    const uint8_t* row = w + k0 * R;
    for (int64_t kk = 0; kk < g; kk += 2, row += 2 * R) {
      _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_BYTES), _MM_HINT_T0);
      const __m256 x0 = _mm256_broadcast_ss(x + k0 + kk), x1 = _mm256_broadcast_ss(x + k0 + kk + 1);
      for (int c = 0; c < C; ++c) {
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c)));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + R + 8 * c)));
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low4)), x0, acc[c]);
        acc[C + c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), x0, acc[C + c]);
        odd[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low4)), x1, odd[c]);
        odd[C + c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), x1, odd[C + c]);
      }
    }
    for (int a = 0; a < A; ++a) acc[a] = _mm256_add_ps(acc[a], odd[a]);
    add_group<A>(acc, xsum[gi], so + gi * n_total + n0, total);
  }
  for (int a = 0; a < A; ++a) _mm256_storeu_ps(y + 8 * a, total[a]);
}

// A full block of layout 1 (32 outputs, rows of 16 bytes) on the integer path for R rows of x at once: a block of
// 32 values of k's sums of q[n, k] (0..15) times the row's q[k] are exact in integers, so the float work is once per
// block and group: total += scale * (sum_b step[b] * sum_{k in b} q[n, k] q[k] - 8 xsum) + offset * xsum. Two 32-byte
// loads hold rows k .. k + 3; interleaving their bytes pairs row k with k + 2 (low 128-bit lane) and k + 1 with k + 3
// (high lane) for 8 outputs, which maddubs multiplies by the matching pair of the row's int8 values and adds: two
// products of at most 15 * 127 each, so the 8 such sums of a block stay within int16 before they are widened. About
// 23 vector operations per 64 bytes of weight for one row (34 with x on a 16-bit grid, as two int8 parts; 58 for
// block_split<16>'s conversions and multiply-adds): benchmark/README.md, "Quantized models". Each step's nibbles are
// put in pair order once for the R rows, whose int16 sums of a block of k (4 R registers) spill to L1 where they
// outgrow the 16 registers: the weight streams from memory once for R rows, and a row's sums are the same
// operations as alone. y[r]: row r's outputs of this block.
template <int R>
void block_ints(const RowInts* const* x, const uint8_t* w, const uint32_t* so, int64_t n_total, int64_t n0, int64_t k,
                int64_t g, float* const* y) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // the 4 bytes of rows k .. k + 3 to the pairs (k, k + 2) in the low lane and (k + 1, k + 3) in the high one
  const __m256i pairs_of = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,  //
                                            1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3);
  const __m256i ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
  const __m256i high16 = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 total[R][4];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < 4; ++o) total[r][o] = _mm256_setzero_ps();
  for (int64_t k0 = 0, gi = 0; k0 < k; k0 += g, ++gi) {
    // octet a (outputs 8a .. 8a + 7) of row r: [r][2a] its outputs 0..3, [r][2a + 1] its outputs 4..7, in both lanes
    __m256 sums[R][8];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < 8; ++a) sums[r][a] = _mm256_setzero_ps();
    for (int64_t c0 = k0; c0 < k0 + g; c0 += X_BLOCK) {
      __m256i q16[R][4];
      for (int r = 0; r < R; ++r)
        for (int o = 0; o < 4; ++o) q16[r][o] = zero;
      const uint8_t* row = w + c0 * 16;
      for (int64_t kk = c0; kk < c0 + X_BLOCK; kk += 4, row += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_BYTES), _MM_HINT_T0);
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32));
        const __m256i a_lo = _mm256_and_si256(a, low4), b_lo = _mm256_and_si256(b, low4);
        const __m256i a_hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
        const __m256i b_hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
        // outputs 0..7, 8..15 (low nibbles) and 16..23, 24..31 (high nibbles)
        const __m256i q[4] = {_mm256_unpacklo_epi8(a_lo, b_lo), _mm256_unpackhi_epi8(a_lo, b_lo),
                              _mm256_unpacklo_epi8(a_hi, b_hi), _mm256_unpackhi_epi8(a_hi, b_hi)};
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, x[r]->q + kk, 4);
          const __m256i xq = _mm256_shuffle_epi8(_mm256_set1_epi32(four), pairs_of);
          for (int o = 0; o < 4; ++o) q16[r][o] = _mm256_add_epi16(q16[r][o], _mm256_maddubs_epi16(q[o], xq));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 step = _mm256_set1_ps(x[r]->step[c0 / X_BLOCK]);
        for (int o = 0; o < 4; ++o) {  // int16 (q16, 0) pairs -> int32, times the block's step
          const __m256i first = _mm256_madd_epi16(_mm256_unpacklo_epi16(q16[r][o], zero), ones);
          const __m256i second = _mm256_madd_epi16(_mm256_unpackhi_epi16(q16[r][o], zero), ones);
          sums[r][2 * o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), step, sums[r][2 * o]);
          sums[r][2 * o + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), step, sums[r][2 * o + 1]);
        }
      }
    }
    const uint32_t* pairs = so + gi * n_total + n0;
    for (int o = 0; o < 4; ++o) {
      const __m256i sov = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 8 * o));
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(sov, 16));
      const __m256 offset = _mm256_castsi256_ps(_mm256_and_si256(sov, high16));
      for (int r = 0; r < R; ++r) {
        // the two lanes of each: rows (k, k + 2) and (k + 1, k + 3)
        const __m256 u = sums[r][2 * o], v = sums[r][2 * o + 1];
        const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(u, v, 0x20), _mm256_permute2f128_ps(u, v, 0x31));
        const __m256 xsum = _mm256_set1_ps(x[r]->xsum[gi]), xsum8 = _mm256_set1_ps(8.f * x[r]->xsum[gi]);
        total[r][o] = _mm256_fmadd_ps(scale, _mm256_sub_ps(s, xsum8), total[r][o]);
        total[r][o] = _mm256_fmadd_ps(offset, xsum, total[r][o]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < 4; ++o) _mm256_storeu_ps(y[r] + n0 + 8 * o, total[r][o]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
// A full block of layout 2 (64 outputs, rows of 32 bytes) on the integer path, with AVX-512's byte permutes and VNNI's
// four-product sums: block_ints's arithmetic (exact integer sums over each block of 32 values of k, then one
// multiply-add a block by its step). Rows k .. k + 3 of the weight are two 64-byte loads; their low nibbles are
// outputs 0..31 and the high ones 32..63, each 32-byte row in output order, and one two-source byte permute gathers
// the four rows' values of 16 outputs into 16 lanes of 4 bytes (k, k + 1, k + 2, k + 3), which vpdpbusd multiplies by
// the same four values of an x row's int8 values and adds into the lane (at most 4 * 15 * 127 a step, 8 steps a
// block). 12 vector operations per 128 bytes gather the nibbles (gather_quads), then 4 per row (a conversion and a
// multiply-add per weight on block_split<32>'s float path).
// The permutes' byte indexes: lane o (of 16) of quad set h takes bytes (o, 32 + o, 64 + o, 96 + o) + 16 h of the two
// registers side by side.
struct QuadIndex {
  alignas(64) int8_t bytes[2][64];
  QuadIndex() {
    for (int h = 0; h < 2; ++h)
      for (int o = 0; o < 16; ++o)
        for (int r = 0; r < 4; ++r) bytes[h][4 * o + r] = static_cast<int8_t>(32 * r + 16 * h + o);
  }
};
const QuadIndex QUAD_INDEX;

// Rows k .. k + 3 of a full block of layout 2 (the 128 bytes at `row`) as four quads of 16 outputs each: outputs
// 0..15, 16..31, 32..47 and 48..63, each lane their four values of k.
inline void gather_quads(const uint8_t* row, __m512i (&quads)[4]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i first16 = _mm512_load_si512(QUAD_INDEX.bytes[0]), second16 = _mm512_load_si512(QUAD_INDEX.bytes[1]);
  const __m512i a = _mm512_loadu_si512(row), b = _mm512_loadu_si512(row + 64);
  const __m512i a_lo = _mm512_and_si512(a, low4), b_lo = _mm512_and_si512(b, low4);
  const __m512i a_hi = _mm512_and_si512(_mm512_srli_epi16(a, 4), low4);
  const __m512i b_hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
  quads[0] = _mm512_permutex2var_epi8(a_lo, first16, b_lo);
  quads[1] = _mm512_permutex2var_epi8(a_lo, second16, b_lo);
  quads[2] = _mm512_permutex2var_epi8(a_hi, first16, b_hi);
  quads[3] = _mm512_permutex2var_epi8(a_hi, second16, b_hi);
}

// One step (4 values of k, as quads) of R rows of x into their integer sums acc: q[r] + at, row r's 4 values. The
// callers take each row's pointer once a block: read through x[r] at every step (after stores of vectors, which may
// alias anything, the compiler loads it again each time), 64 rows took 1.16x the time.
template <int R>
inline void add_step(const __m512i (&quads)[4], const int8_t* const (&q)[R], int64_t at, __m512i (&acc)[R][4]) {
  for (int r = 0; r < R; ++r) {
    int32_t four;
    std::memcpy(&four, q[r] + at, 4);
    const __m512i xq = _mm512_set1_epi32(four);
    for (int a = 0; a < 4; ++a) acc[r][a] = _mm512_dpbusd_epi32(acc[r][a], quads[a], xq);
  }
}

// R rows' integer sums of the block of 32 values of k from c0, times its step, added into their float sums
// (sums: R rows of 64 outputs).
template <int R>
inline void add_block(const __m512i (&acc)[R][4], const RowInts* const* x, int64_t c0, float* sums) {
  for (int r = 0; r < R; ++r) {
    const __m512 step = _mm512_set1_ps(x[r]->step[c0 / X_BLOCK]);
    float* row = sums + 64 * r;
    for (int a = 0; a < 4; ++a) {
      const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][a]), step, _mm512_loadu_ps(row + 16 * a));
      _mm512_storeu_ps(row + 16 * a, sum);
    }
  }
}

// total += scale * (sums - 8 xsum) + offset * xsum over a block's 64 outputs, for one group of one row.
inline void add_group_sums(const uint32_t* pairs, const float* sums, float xsum, float* total) {
  const __m512i high16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 xs = _mm512_set1_ps(xsum), xs8 = _mm512_set1_ps(8.f * xsum);
  for (int a = 0; a < 4; ++a) {
    const __m512i sov = _mm512_loadu_si512(pairs + 16 * a);
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(sov, 16));
    const __m512 offset = _mm512_castsi512_ps(_mm512_and_si512(sov, high16));
    __m512 t = _mm512_loadu_ps(total + 16 * a);
    t = _mm512_fmadd_ps(scale, _mm512_sub_ps(_mm512_loadu_ps(sums + 16 * a), xs8), t);
    _mm512_storeu_ps(total + 16 * a, _mm512_fmadd_ps(offset, xs, t));
  }
}

// The prefetches of the first rows' pass over a block: into L2 only (prefetcht2) for one row of x, into L1 for more.
// On a Zen 4, a `1b` step's int4 projections in sequence took 0.88x the time at one row with its weights' and scales'
// lines asked into L2 (0.93x with the weights' alone); at 4 and 16 rows, L2 took 1.25x and 1.15x (benchmark/README.md,
// "int4 at one row: prefetches into L2").
template <int R>
inline void prefetch_for(const void* p) {
  if constexpr (R == 1) {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T2);
  } else {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
  }
}

// R rows of x over one block of 32 values of k (from c0) of the weight at `row`, its quads gathered step by step as
// the weight streams in: their sums (R rows of 64 outputs). KEEP: the quads are stored in `keep` for more rows. The
// steps stay a loop: unrolled (GCC's choice), 2 and 3 rows took 1.04-1.08x the time.
template <int R, bool KEEP>
void gather_rows_block(const uint8_t* row, const RowInts* const* x, int64_t c0, float* sums, __m512i (*keep)[4]) {
  __m512i acc[R][4] = {};
  const int8_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = x[r]->q + c0;
#pragma GCC unroll 1
  for (int st = 0; st < 8; ++st, row += 128) {
    prefetch_for<R>(row + PREFETCH_BYTES);
    prefetch_for<R>(row + PREFETCH_BYTES + 64);
    __m512i quads[4];
    gather_quads(row, quads);
    if constexpr (KEEP) {
      for (int a = 0; a < 4; ++a) keep[st][a] = quads[a];
    }
    add_step<R>(quads, q, 4 * st, acc);
  }
  add_block<R>(acc, x, c0, sums);
}

// R more rows of x over the quads gather_rows_block kept: their sums.
template <int R>
void rows_block(const __m512i (&quads)[8][4], const RowInts* const* x, int64_t c0, float* sums) {
  __m512i acc[R][4] = {};
  const int8_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = x[r]->q + c0;
  for (int st = 0; st < 8; ++st) add_step<R>(quads[st], q, 4 * st, acc);
  add_block<R>(acc, x, c0, sums);
}

// m rows of x against a full block, y[r]: row r's outputs. Each block of 32 values of k is gathered once for all m
// rows, which pass over it ROWS_AT_ONCE at a time (four rows' accumulators fill 16 of AVX-512's 32 registers): the
// first FIRST (min(m, ROWS_AT_ONCE)) as it is gathered, the others over its quads kept in L1 (2 KiB). Gathered again
// for every four rows, as before, 64 rows took 1.2x the time (benchmark/README.md, "int4 at many rows"). `sums` and
// `total`: m x 64 floats of scratch, 64-byte aligned.
template <int FIRST>
void block_vnni(int64_t m, const RowInts* const* x, const uint8_t* w, const uint32_t* so, int64_t n_total, int64_t n0,
                int64_t k, int64_t g, float* sums, float* total, float* const* y) {
  std::fill_n(total, m * 64, 0.f);
  for (int64_t k0 = 0, gi = 0; k0 < k; k0 += g, ++gi) {
    std::fill_n(sums, m * 64, 0.f);
    // The group's scales, read after its weights: 256 bytes N pairs after the last group's, where no prefetcher
    // looks; asked for now, they arrive while the group's weights are summed.
    const uint32_t* pairs = so + gi * n_total + n0;
    for (int line = 0; line < 4; ++line) prefetch_for<FIRST>(pairs + 16 * line);
    for (int64_t c0 = k0; c0 < k0 + g; c0 += X_BLOCK) {
      const uint8_t* row = w + c0 * 32;
      __m512i quads[8][4];
      if (m > FIRST) {
        gather_rows_block<FIRST, true>(row, x, c0, sums, quads);
      } else {
        gather_rows_block<FIRST, false>(row, x, c0, sums, nullptr);
      }
      for (int64_t r0 = FIRST; r0 < m; r0 += ROWS_AT_ONCE) {
        with_count<ROWS_AT_ONCE>(std::min(ROWS_AT_ONCE, m - r0), [&](auto rows) {
          rows_block<decltype(rows)::value>(quads, x + r0, c0, sums + 64 * r0);
        });
      }
    }
    for (int64_t r = 0; r < m; ++r) add_group_sums(pairs, sums + 64 * r, x[r]->xsum[gi], total + 64 * r);
  }
  for (int64_t r = 0; r < m; ++r) std::copy_n(total + 64 * r, 64, y[r] + n0);
}
#endif

// Block [n0, n0 + 16 V) of the output; `split`: the row is layout 1 or 2 (else pairs).
template <int V>
void block_avx2(const float* x, const float* xsum, const uint8_t* w, const uint32_t* so, int64_t n_total,
                int64_t n0, int64_t k, int64_t g, bool split, float* y) {
  constexpr int A = 2 * V;  // 8-lane float accumulators
  constexpr int64_t ROW = 8 * V;
  __m256 total[A];
  for (int a = 0; a < A; ++a) total[a] = _mm256_setzero_ps();
  for (int64_t k0 = 0, gi = 0; k0 < k; k0 += g, ++gi) {
    __m256 acc[A];
    for (int a = 0; a < A; ++a) acc[a] = _mm256_setzero_ps();
    const uint8_t* row = w + k0 * ROW;
    for (int64_t kk = 0; kk < g; ++kk, row += ROW) {
      __m128i nib[V];
      row_nibbles<V>(row, split, nib);
      const __m256 xk = _mm256_broadcast_ss(x + k0 + kk);
      for (int v = 0; v < V; ++v) {
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib[v]));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(nib[v], nib[v])));
        acc[2 * v] = _mm256_fmadd_ps(q0, xk, acc[2 * v]);
        acc[2 * v + 1] = _mm256_fmadd_ps(q1, xk, acc[2 * v + 1]);
      }
    }
    add_group<A>(acc, xsum[gi], so + gi * n_total + n0, total);
  }
  for (int a = 0; a < A; ++a) _mm256_storeu_ps(y + 8 * a, total[a]);
}
#endif

// Block b of the weight (outputs [b B, b B + B), B = block_outputs(lay)) for one row x (float32 [k]) into y float32
// [n]. `ints`: the row quantized for the integer path (full blocks of layouts 1 and 2), or null.
void one_block(const float* x, const float* xsum, [[maybe_unused]] const RowInts* ints, const uint8_t* w,
               const uint32_t* so, int64_t n, int64_t k, int64_t g, int lay, int64_t b, float* y) {
  const int64_t bn = block_outputs(lay), n0 = b * bn, nb = std::min(bn, n - n0);
  const bool full = nb == bn;
  const uint8_t* wb = w + n0 * k / 2;
#if defined(__AVX2__) && defined(__FMA__)
  const bool split = full && lay != PAIRS;
  switch (nb) {
    case 16:
      return block_avx2<1>(x, xsum, wb, so, n, n0, k, g, false, y + n0);
    case 32:
      if (split && ints != nullptr) {
        float* const out[1] = {y};
        return block_ints<1>(&ints, wb, so, n, n0, k, g, out);
      }
      if (split) return block_split<16>(x, xsum, wb, so, n, n0, k, g, y + n0);
      return block_avx2<2>(x, xsum, wb, so, n, n0, k, g, false, y + n0);
    case 48:
      return block_avx2<3>(x, xsum, wb, so, n, n0, k, g, false, y + n0);
    case 64:
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
      if (split && ints != nullptr) {
        alignas(64) float sums[64], total[64];
        return block_vnni<1>(1, &ints, wb, so, n, n0, k, g, sums, total, &y);
      }
#endif
      if (split) return block_split<32>(x, xsum, wb, so, n, n0, k, g, y + n0);
      return block_avx2<4>(x, xsum, wb, so, n, n0, k, g, false, y + n0);
    default:
      break;
  }
#endif
  block_scalar(x, xsum, wb, so, n, n0, nb, k, g, full, lay, y + n0);
}

// One row against the whole packed weight (one_block's arguments); threads split the blocks.
void row_gemv(const float* x, const float* xsum, const RowInts* ints, const uint8_t* w, const uint32_t* so,
              int64_t n, int64_t k, int64_t g, int lay, float* y) {
  const int64_t bn = block_outputs(lay), blocks = (n + bn - 1) / bn;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) one_block(x, xsum, ints, w, so, n, k, g, lay, b, y);
  });
}

#if defined(__AVX2__) && defined(__FMA__)
// Whether rows of layout `lay` that the integer path takes share each read of the weight: layout 1's blocks
// (block_ints), and layout 2's where the CPU has AVX512-VNNI and AVX512-VBMI (block_vnni).
bool shares_reads(int lay) {
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  return lay == SPLIT32 || lay == SPLIT64;
#else
  return lay == SPLIT32;
#endif
}

// m rows of layout `lay` (shares_reads), every one quantized (ints[r]), against the whole packed weight: each full
// block is read from memory once for all m rows (block_vnni on layout 2; on layout 1 four rows at a time pass
// over it while it stays in L2, K / 2 x 32 bytes); a short last block row by row. A pass over the whole weight for
// every four rows, as before, read it from L3 or memory 16 times at 64 rows (benchmark/README.md, "int4 at many
// rows"). x[r], xsum[r], y[r]: one_block's.
void rows_shared(int64_t m, const float* const* x, const float* const* xsum, const RowInts* const* ints,
                 const uint8_t* w, const uint32_t* so, int64_t n, int64_t k, int64_t g, int lay, float* const* y) {
  const int64_t bn = block_outputs(lay), blocks = (n + bn - 1) / bn;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
    std::vector<float> scratch;
    float* sums = on_cache_line(scratch, lay == SPLIT64 ? 2 * m * 64 : 0);  // block_vnni's sums and totals
#endif
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = bn * b;
      if (n0 + bn > n) {
        for (int64_t r = 0; r < m; ++r) one_block(x[r], xsum[r], ints[r], w, so, n, k, g, lay, b, y[r]);
        continue;
      }
      const uint8_t* wb = w + n0 * k / 2;
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)  // layout 2 shares reads only in such a build
      if (lay == SPLIT64) {
        with_count<ROWS_AT_ONCE>(std::min(ROWS_AT_ONCE, m), [&](auto first) {
          block_vnni<decltype(first)::value>(m, ints, wb, so, n, n0, k, g, sums, sums + m * 64, y);
        });
        continue;
      }
#endif
      for (int64_t r0 = 0; r0 < m; r0 += ROWS_AT_ONCE) {
        with_count<ROWS_AT_ONCE>(std::min(ROWS_AT_ONCE, m - r0), [&](auto rows) {
          block_ints<decltype(rows)::value>(ints + r0, wb, so, n, n0, k, g, y + r0);
        });
      }
    }
  });
}
#endif

// The packed weight [N, K/2] and its scales_offsets [K/G, N, 2] as both ops take them.
void check_weight(const char* op, const at::Tensor& packed, const at::Tensor& scales_offsets, int64_t group_size) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(), op,
              ": a contiguous uint8 [N, K/2] weight from _convert_weight_to_int4pack_for_cpu");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256, op,
              ": groups of 32, 64, 128 or 256");
  TORCH_CHECK(k % group_size == 0 && n % 16 == 0, op, ": K a multiple of the group, N of 16");
  TORCH_CHECK(scales_offsets.scalar_type() == at::kBFloat16 && scales_offsets.is_contiguous() &&
                  scales_offsets.dim() == 3 && scales_offsets.size(0) == k / group_size &&
                  scales_offsets.size(1) == n && scales_offsets.size(2) == 2,
              op, ": contiguous bf16 scales_offsets [K/G, N, 2]");
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_offsets,
                     int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int4_gemv: x bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  check_weight("int4_gemv", packed, scales_offsets, group_size);
  const int64_t n = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == k, "int4_gemv: x has ", k, " features, the weight ", packed.size(1) * 2);
  const int lay = static_cast<int>(layout());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* so = reinterpret_cast<const uint32_t*>(scales_offsets.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t groups = k / group_size;
  // Rows pass by ROWS_PER_PASS at a time. In a pass every row is first in float32, and quantized where the integer
  // path takes it: each block of the weight then serves all the pass's quantized rows at once. Rows are converted and
  // quantized, and their outputs rounded, over threads only ROW_GRAIN at a time: a row takes microseconds, a
  // parallel region about as long.
  const int64_t most = std::min(m, ROWS_PER_PASS);
  std::vector<float> xf(most * k), xsum(most * groups), yf(most * n);
  // The quantized rows' values (each block of 32 in one cache line), steps and group sums.
  std::vector<int8_t> ints_q;
  int8_t* q_base = on_cache_line(ints_q, most * k);
  std::vector<float> ints_step(most * (k / X_BLOCK)), ints_xsum(most * groups);
  std::vector<RowInts> ints(most);
  for (int64_t i = 0; i < most; ++i) {
    ints[i] = {q_base + i * k, ints_step.data() + i * (k / X_BLOCK), ints_xsum.data() + i * groups};
  }
  std::vector<uint8_t> integer(most);
  // Full blocks of the integer path read only `ints`: the group sums of x are for the float path's blocks.
  const bool short_block = n % block_outputs(lay) != 0;
  std::vector<const float*> xs, xsums;
  std::vector<const RowInts*> quantized;
  std::vector<float*> ys;
  for (int64_t p0 = 0; p0 < m; p0 += ROWS_PER_PASS) {
    const int64_t rows = std::min(ROWS_PER_PASS, m - p0);
    const uint16_t* xpass = xp + p0 * k;
    at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float* row = xf.data() + i * k;
        for (int64_t kk = 0; kk < k; ++kk) row[kk] = bf16_to_float(xpass[i * k + kk]);
#if defined(__AVX2__) && defined(__FMA__)
        integer[i] = shares_reads(lay) && quantize_row(row, k, group_size, ints[i]);
#endif
        if (!integer[i] || short_block) {
          for (int64_t gi = 0; gi < groups; ++gi) {
            float sum = 0.f;
            for (int64_t kk = gi * group_size; kk < (gi + 1) * group_size; ++kk) sum += row[kk];
            xsum[i * groups + gi] = sum;
          }
        }
      }
    });
    // The quantized rows share the weight's reads (more than one of them); the others, and a lone one, go row by row.
    xs.clear(), xsums.clear(), quantized.clear(), ys.clear();
    for (int64_t i = 0; i < rows; ++i) {
      const float* x_row = xf.data() + i * k;
      const float* xsum_row = xsum.data() + i * groups;
      if (integer[i]) {
        xs.push_back(x_row), xsums.push_back(xsum_row), quantized.push_back(&ints[i]), ys.push_back(yf.data() + i * n);
      } else {
        row_gemv(x_row, xsum_row, nullptr, w, so, n, k, group_size, lay, yf.data() + i * n);
      }
    }
    const int64_t together = static_cast<int64_t>(quantized.size());
    if (together == 1) row_gemv(xs[0], xsums[0], quantized[0], w, so, n, k, group_size, lay, ys[0]);
#if defined(__AVX2__) && defined(__FMA__)
    if (together > 1) {
      rows_shared(together, xs.data(), xsums.data(), quantized.data(), w, so, n, k, group_size, lay, ys.data());
    }
#endif
    uint16_t* ypass = yp + p0 * n;
    at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        for (int64_t j = 0; j < n; ++j) ypass[i * n + j] = float_to_bf16(yf[i * n + j]);
    });
  }
  return y;
}

// Blocks [b0, b1) of the weight, dequantized into `out` [K, N] (float32 or bf16; the transpose of the weight):
// w[n, k] = (q[n, k] - 8) * scale[g, n] + offset[g, n]. The product is exact in float32 (a 4-bit integer times a bf16
// scale), so each weight is rounded once, to float32 by the sum and to bf16 from there as torch's `.to()` rounds.
// A block's packed row for one k holds its nb outputs' nibbles, written out as that k's run of nb outputs: no
// transpose, and every loop a vector loop. 16 k at a time across the blocks, so that the rows written lie side by
// side: block by block, each k's write fell a whole output row after the last, 4 KiB apart for N = 2,048, and
// took 3x as long (benchmark/README.md, "int4 and int8 prefills").
template <typename T>
void dequantize_blocks(const uint8_t* w, const uint32_t* so, int64_t n, int64_t k, int64_t group_size, int lay,
                       int64_t b0, int64_t b1, T* out) {
  constexpr int64_t kChunk = 16;  // every group size check_weight allows is a multiple of it
  const int64_t bn = block_outputs(lay), first = b0 * bn, outputs = std::min(b1 * bn, n) - first;
  std::vector<float> scale(outputs), offset(outputs);  // the current group's, for the blocks' outputs
  for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
    if (k0 % group_size == 0) {
      const uint32_t* group = so + k0 / group_size * n + first;
      for (int64_t j = 0; j < outputs; ++j) {
        const ScaleOffset so_pair(group[j]);
        scale[j] = so_pair.scale;
        offset[j] = so_pair.offset;
      }
    }
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * bn, nb = std::min(bn, n - n0), half = nb / 2;
      const bool split = nb == bn && lay != PAIRS;  // low nibbles: the first half's outputs; high: the second's
      const float* sc = scale.data() + (n0 - first);
      const float* of = offset.data() + (n0 - first);
      for (int64_t kk = k0; kk < k0 + kChunk; ++kk) {
        const uint8_t* row = w + n0 * k / 2 + kk * half;  // a block's rows of nb / 2 bytes, one per k
        T* dst = out + kk * n + n0;
        if (split) {
          for (int64_t j = 0; j < half; ++j) store_as(dst + j, float(int(row[j] & 15) - 8) * sc[j] + of[j]);
          for (int64_t j = 0; j < half; ++j)
            store_as(dst + half + j, float(int(row[j] >> 4) - 8) * sc[half + j] + of[half + j]);
        } else {
          for (int64_t j = 0; j < nb; ++j)
            store_as(dst + j, float(nibble(row, nb, j, nb == bn, lay) - 8) * sc[j] + of[j]);
        }
      }
    }
  }
}

// The whole weight [N, K] in `dtype` (float32 or bfloat16), for products of many rows, which run faster as a GEMM
// on it than through torch's int4 kernel (quant_kernels.py): bf16 straight from the packed weight where the GEMM
// runs in bf16, the same bits as the float32 weight rounded to bf16 after. It is the transpose of a contiguous
// [K, N], which `F.linear` multiplies as it is (oneDNN reads either layout; as fast as [N, K] at 64-512 rows here).
at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scales_offsets, int64_t group_size,
                           at::ScalarType dtype) {
  check_weight("int4_dequantize", packed, scales_offsets, group_size);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "int4_dequantize: to float32 or bfloat16");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  const int lay = static_cast<int>(layout());
  at::Tensor out = at::empty({k, n}, packed.options().dtype(dtype));
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* so = reinterpret_cast<const uint32_t*>(scales_offsets.data_ptr<at::BFloat16>());
  const int64_t blocks = (n + block_outputs(lay) - 1) / block_outputs(lay);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    if (dtype == at::kFloat) {
      dequantize_blocks(w, so, n, k, group_size, lay, b0, b1, out.data_ptr<float>());
    } else {
      auto* bf16 = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
      dequantize_blocks(w, so, n, k, group_size, lay, b0, b1, bf16);
    }
  });
  return out.t();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(textgen, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scales_offsets, int group_size) -> Tensor");
  m.def("int4_dequantize(Tensor packed, Tensor scales_offsets, int group_size, ScalarType dtype) -> Tensor");
  m.def("int4_gemv_layout() -> int", &layout);
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_dequantize", &int4_dequantize);
}
