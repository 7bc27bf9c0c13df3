// The two bfloat16 products of a causal prefill's attention (layers/attention_kernels.py, `_causal_op`) as torch
// computes them on an x86 CPU with AVX2 and FMA but no AVX-512: there torch has no oneDNN bf16 kernels and
// multiplies bf16 matrices with its own loops, which ran a prefill's attention at about 1 GMAC/s
// (benchmark/README.md, "bfloat16 on AVX2 at every row count, and the prefill's attention"). These ops sum in
// torch's orders, so they give its bits, and compute only what a causal row sees. The rows are a prefill's queries
// with grouped heads folded in ([N, G * S, D]): row r is query s = r % seq, which sees keys
// (T - seq + s - window, T - seq + s] (window 0: every key up to it).
//
// textgen::causal_scores_bf16(q [N, R, D], k [N, T, D], seq, window) -> scores [N, R, T] bf16: q @ k^T, each seen
//   score by torch's bf16 dot product (`dot_row`, torch_order.h), as torch's matmul sums a product whose second
//   operand is transposed; scores a row does not see are 0 (textgen::causal_softmax_bf16 reads only the others).
// textgen::causal_values_bf16(probs [N, R, T], v [N, T, D], seq, window) -> [N, R, D] bf16: probs @ v, as torch's
//   matmul sums a product of two untransposed bf16 matrices: per output, four float32 partial sums (key t into
//   t % 4, the keys after the last whole four into the first), added in order ((0 + 1) + 2) + 3, rounded once.
//   Each product of two bf16 values is exact in float32, so a fused multiply-add adds it as torch's add does; a
//   key the row does not see has probability 0 and adds an exact zero, so it is skipped. v is converted to float32
//   once, 16 columns at a time, and each row's probabilities once; the four sums stay in registers: about 2x
//   faster than converting v for each row with its sums in memory (40 queries over 1,541 cached keys, 12 heads;
//   benchmark/README.md, "prefix_reuse.py").
// textgen::torch_order_products() -> bool: whether this build has them (AVX2 without AVX-512). Whether torch on
//   this CPU sums that way is checked where they are used (attention_kernels.py, `torch_order_products`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "torch_order.h"

namespace {

bool built() {
#if defined(TEXTGEN_TORCH_ORDER)
  return true;
#else
  return false;
#endif
}

#if defined(TEXTGEN_TORCH_ORDER)
// f(i, head, lo, hi) for each row i of the heads' rows, over threads: row i belongs to head i / rows and sees keys
// [lo, hi].
template <typename F>
void each_row(int64_t heads, int64_t rows, int64_t seq, int64_t total, int64_t window, const F& f) {
  at::parallel_for(0, heads * rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t hi = total - seq + i % rows % seq;
      f(i, i / rows, window > 0 ? std::max<int64_t>(0, hi - window + 1) : 0, hi);
    }
  });
}
#endif

void check(const at::Tensor& a, const at::Tensor& b, int64_t seq, int64_t window, const char* op) {
  TORCH_CHECK(built(), op, ": the library was built without AVX2 and FMA, or with AVX-512");
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && a.dim() == 3 && b.dim() == 3 &&
                  a.size(0) == b.size(0),
              op, ": bf16 operands [N, R, *] and [N, T, *]");
  TORCH_CHECK(seq > 0 && a.size(1) % seq == 0 && window >= 0, op, ": rows must be whole groups of seq queries");
  TORCH_CHECK(b.size(1) >= seq, op, ": fewer keys than queries");
}

at::Tensor causal_scores(const at::Tensor& q, const at::Tensor& k, int64_t seq, int64_t window) {
  check(q, k, seq, window, "causal_scores_bf16");
  TORCH_CHECK(q.size(2) == k.size(2), "causal_scores_bf16: queries and keys of one head size");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous();
  const int64_t n = q.size(0), rows = q.size(1), total = k.size(1), dim = q.size(2);
  at::Tensor scores = at::empty({n, rows, total}, q.options());
#if defined(TEXTGEN_TORCH_ORDER)
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr<at::BFloat16>());
  auto* out = scores.data_ptr<at::BFloat16>();
  each_row(n, rows, seq, total, window, [&](int64_t i, int64_t head, int64_t lo, int64_t hi) {
    std::vector<float> xp(static_cast<size_t>(dim));
    textgen_cpu::dot_operand(qp + i * dim, dim, xp.data());
    at::BFloat16* row = out + i * total;
    std::fill(row, row + lo, at::BFloat16(0.f));
    for (int64_t t = lo; t <= hi; ++t)
      row[t] = at::BFloat16(textgen_cpu::dot_row(xp.data(), kp + (head * total + t) * dim, dim));
    std::fill(row + hi + 1, row + total, at::BFloat16(0.f));
  });
#endif
  return scores;
}

at::Tensor causal_values(const at::Tensor& probs, const at::Tensor& v, int64_t seq, int64_t window) {
  check(probs, v, seq, window, "causal_values_bf16");
  TORCH_CHECK(probs.size(2) == v.size(1), "causal_values_bf16: one probability a key");
  const at::Tensor pc = probs.contiguous(), vc = v.contiguous();
  const int64_t n = probs.size(0), rows = probs.size(1), total = v.size(1), dim = v.size(2);
  at::Tensor out = at::empty({n, rows, dim}, v.options());
#if defined(TEXTGEN_TORCH_ORDER)
  const auto* pp = reinterpret_cast<const uint16_t*>(pc.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // v in float32, converted once for every row of its head, 16 columns at a time: [N, D / 16, T, 16]. A row's key
  // then costs a broadcast and two fused multiply-adds reading 64 contiguous bytes, not a conversion of v's values
  // again for each row.
  const int64_t chunks = dim / 16, tail = dim % 16;
  std::vector<float> vf(static_cast<size_t>(n * chunks * total * 16));
  at::parallel_for(0, n * total, 64, [&](int64_t begin, int64_t end) {
    for (int64_t ht = begin; ht < end; ++ht) {
      const int64_t head = ht / total, t = ht % total;
      for (int64_t ci = 0; ci < chunks; ++ci)
        for (int64_t j = 0; j < 16; ++j)
          vf[((head * chunks + ci) * total + t) * 16 + j] = textgen_cpu::bf16_to_float(vp[ht * dim + ci * 16 + j]);
    }
  });
  const int64_t whole = total - total % 4;  // keys summed in fours; the rest join partial sum 0
  each_row(n, rows, seq, total, window, [&](int64_t i, int64_t head, int64_t lo, int64_t hi) {
    std::vector<float> probs(static_cast<size_t>(hi + 1));
    for (int64_t t = lo; t <= hi; ++t) probs[t] = textgen_cpu::bf16_to_float(pp[i * total + t]);
    const float* p = probs.data();
    // Key t's product joins partial sum t % 4 (0 past `whole`): in a run of whole fours the four sums are named
    // registers; the keys before the first four, after the last, and past `whole` go one by one.
    const int64_t first = std::min({(lo + 3) & ~int64_t(3), whole, hi + 1});
    const int64_t last = std::max(first, std::min(hi + 1, whole) & ~int64_t(3));
    for (int64_t ci = 0; ci < chunks; ++ci) {
      const float* values = vf.data() + (head * chunks + ci) * total * 16;  // 16 columns, key after key
      __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
      // One key into its sum. A switch, not a reference picked at run time: taking a sum's address kept all
      // eight in memory, and the fours' loop then ran at a third of its speed.
      auto one = [&](int64_t t, int part) {
        const __m256 pt = _mm256_broadcast_ss(p + t);
        const __m256 lo8 = _mm256_loadu_ps(values + t * 16), hi8 = _mm256_loadu_ps(values + t * 16 + 8);
        switch (part) {
          case 0: a0 = _mm256_fmadd_ps(pt, lo8, a0); b0 = _mm256_fmadd_ps(pt, hi8, b0); break;
          case 1: a1 = _mm256_fmadd_ps(pt, lo8, a1); b1 = _mm256_fmadd_ps(pt, hi8, b1); break;
          case 2: a2 = _mm256_fmadd_ps(pt, lo8, a2); b2 = _mm256_fmadd_ps(pt, hi8, b2); break;
          default: a3 = _mm256_fmadd_ps(pt, lo8, a3); b3 = _mm256_fmadd_ps(pt, hi8, b3); break;
        }
      };
      for (int64_t t = lo; t < first; ++t) one(t, static_cast<int>(t % 4));
      for (int64_t t = first; t < last; t += 4) {
        const float* vt = values + t * 16;
        const __m256 p0 = _mm256_broadcast_ss(p + t), p1 = _mm256_broadcast_ss(p + t + 1);
        const __m256 p2 = _mm256_broadcast_ss(p + t + 2), p3 = _mm256_broadcast_ss(p + t + 3);
        a0 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vt), a0);
        b0 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vt + 8), b0);
        a1 = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vt + 16), a1);
        b1 = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vt + 24), b1);
        a2 = _mm256_fmadd_ps(p2, _mm256_loadu_ps(vt + 32), a2);
        b2 = _mm256_fmadd_ps(p2, _mm256_loadu_ps(vt + 40), b2);
        a3 = _mm256_fmadd_ps(p3, _mm256_loadu_ps(vt + 48), a3);
        b3 = _mm256_fmadd_ps(p3, _mm256_loadu_ps(vt + 56), b3);
      }
      for (int64_t t = std::max(last, lo); t <= hi; ++t) one(t, t < whole ? static_cast<int>(t % 4) : 0);
      uint16_t* y = op + i * dim + ci * 16;
      textgen_cpu::store8(y, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), a2), a3));
      textgen_cpu::store8(y + 8, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(b0, b1), b2), b3));
    }
    // A head size not a multiple of 16: its last columns one at a time, in the same order.
    const uint16_t* values = vp + head * total * dim;
    for (int64_t c = dim - tail; c < dim; ++c) {
      float part[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t t = lo; t <= hi; ++t) {
        float& sum = part[t < whole ? t % 4 : 0];
        sum = std::fma(p[t], textgen_cpu::bf16_to_float(values[t * dim + c]), sum);
      }
      op[i * dim + c] = textgen_cpu::float_to_bf16(((part[0] + part[1]) + part[2]) + part[3]);
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(textgen, m) {
  m.def("causal_scores_bf16(Tensor q, Tensor k, int seq, int window) -> Tensor");
  m.def("causal_values_bf16(Tensor probs, Tensor v, int seq, int window) -> Tensor");
  m.def("torch_order_products() -> bool", &built);
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("causal_scores_bf16", &causal_scores);
  m.impl("causal_values_bf16", &causal_values);
}
