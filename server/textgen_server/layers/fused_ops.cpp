// The small ops of a decoder layer, each in one call instead of several torch ops (a batch-1 decode step spent
// as long dispatching them as the weights took to read: benchmark/README.md, issue 25). float32 and bfloat16,
// contiguous rows; rows are independent and split over threads only when there are many of them.
//
// Every op rounds where the eager torch code it replaces rounds (that code stays as the fallback: RMSNorm in
// norm.py, apply_rotary in rotary.py, the MLP in models/tp_llama.py, write_kv in paged_attention.py), so outputs
// are torch's bits, except where noted (test_fused_ops.py checks them):
//
// textgen::rms_norm(x, weight, eps) -> out and textgen::add_rms_norm(x, residual, weight, eps) -> (sum, out):
//   sum = x + residual (rounded to the dtype, as `hidden + attn`), out = weight * dtype(sum * rsqrt(mean(sum^2)
//   + eps)) with the normalisation in float32 (Llama's RMSNorm). The mean's float32 sum is taken in another
//   order than torch's, so `out` may differ from torch's by one unit in the last place, rarely.
// textgen::rotary_(x, cos, sin): x [T, H, D] rotated in place, x * cos + rotate_half(x) * sin, cos / sin [T, D].
// textgen::silu_mul(gate_up) -> out: [T, 2I] -> [T, I], silu(gate) * up (transformers' MLP after its fused
//   gate/up projection), silu as torch computes it: x / (1 + exp(-x)) with torch's vector exp (cpu_ops.h). Subnormals
//   are flushed to 0 (FlushDenormals): an exp that underflows changes no result (1 + it is 1 either way), but a
//   subnormal gate, silu or product is 0 here where torch keeps it (below 2^-126: no model's activation).
// textgen::write_kv(k_cache, v_cache, slots, k, v): k, v [T, Hkv, D] (rows any stride) stored at `slots` of the
//   pools [N, S, Hkv, D] (slot s = block * S + offset; TGI's order or head-major, kv_pool.h).
// textgen::gather_kv(k_cache, v_cache, slots) -> (k, v): the pools' rows at `slots` (int64 [T]) head by head, each
//   [Hkv, T, D] contiguous: a prefill row's keys and values in the layout transformers' eager attention multiplies,
//   in one pass where torch gathers the rows and then copies them again to transpose them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "cpu_ops.h"
#include "kv_pool.h"

namespace {

using namespace textgen_cpu;

// Rows per thread below which an op runs on the calling thread: a decode step's few rows take microseconds,
// less than waking the pool.
constexpr int64_t GRAIN = 16;

// How many tokens ahead rotary_ and write_kv ask for the lines they will read and write. Their rows are most often
// column ranges of the fused qkv projection's output (rows 3 * H * D apart), and write_kv's slots scatter over the
// pool: neither is a stream the hardware prefetcher follows, so each token waited for its lines (benchmark/README.md,
// "The prefill's strided rows, asked for ahead").
constexpr int64_t TOKENS_AHEAD = 2;

// Calls f with a value of the element type the ops read `t`'s data as: float for float32, uint16_t (the raw
// bits) for bfloat16.
template <typename F>
void by_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(uint16_t{});
  }
}

inline void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat,
              what, ": float32 or bfloat16 only");
  TORCH_CHECK(t.is_contiguous(), what, ": contiguous tensors only");
}

// out = weight * round(x * rsqrt(mean(x^2) + eps)); x already rounded to T. The squares are summed in 16 lanes
// (lane l: columns l, l + 16, ...), then the lanes one after another.
template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t dim, float eps) {
  float lanes[16] = {0.f};
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 v = load16(x + d, first_lanes(dim - d));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  _mm512_storeu_ps(lanes, acc);
#else
  for (int64_t d = 0; d < dim; ++d) lanes[d % 16] += to_float(x[d]) * to_float(x[d]);
#endif
  float total = 0.f;
  for (int l = 0; l < 16; ++l) total += lanes[l];
  const float scale = 1.f / std::sqrt(total / static_cast<float>(dim) + eps);
#if defined(__AVX512F__)
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t d = 0; d < dim; d += 16) {
    const __mmask16 m = first_lanes(dim - d);
    const __m512 normed = round_as(T{}, _mm512_mul_ps(load16(x + d, m), scale16));
    store16(out + d, _mm512_mul_ps(load16(weight + d, m), normed), m);
  }
#else
  for (int64_t d = 0; d < dim; ++d) store_as(out + d, to_float(weight[d]) * round_as(T{}, to_float(x[d]) * scale));
#endif
}

// sum = round(a + b)
template <typename T>
void add_row(const T* a, const T* b, T* sum, int64_t dim) {
#if defined(__AVX512F__)
  for (int64_t d = 0; d < dim; d += 16) {
    const __mmask16 m = first_lanes(dim - d);
    store16(sum + d, _mm512_add_ps(load16(a + d, m), load16(b + d, m)), m);
  }
#else
  for (int64_t d = 0; d < dim; ++d) store_as(sum + d, to_float(a[d]) + to_float(b[d]));
#endif
}

template <typename T>
void norm_rows(const T* x, const T* residual, T* sum, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* row = x + r * dim;
      if (residual != nullptr) {
        add_row(row, residual + r * dim, sum + r * dim, dim);
        row = sum + r * dim;
      }
      norm_row(row, weight, out + r * dim, dim, eps);
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.dim() == 1 &&
                  x.dim() >= 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be a contiguous [D] of x's dtype");
}

void norm(const at::Tensor& x, const at::Tensor* residual, at::Tensor* sum, const at::Tensor& weight,
          at::Tensor& out, double eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
  by_dtype(x, [&](auto raw) {
    using T = decltype(raw);
    norm_rows<T>(static_cast<const T*>(x.data_ptr()), residual ? static_cast<const T*>(residual->data_ptr()) : nullptr,
                 sum ? static_cast<T*>(sum->data_ptr()) : nullptr, static_cast<const T*>(weight.data_ptr()),
                 static_cast<T*>(out.data_ptr()), rows, dim, static_cast<float>(eps));
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  norm(x, nullptr, nullptr, weight, out, eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "add_rms_norm: residual must be contiguous, of x's shape and dtype");
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  norm(x, &residual, &sum, weight, out, eps);
  return {sum, out};
}

// One head: x' = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half]); each product and the
// sum rounded to T as torch's eager ops round them. The attribute keeps GCC from fusing a product and the sum
// into one FMA, which rounds once where torch rounds twice (float32).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_head(T* x, const T* cos, const T* sin, int64_t half) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = first_lanes(half - i);
    const __m512 a = load16(x + i, m), b = load16(x + i + half, m);
    const __m512 minus_b = _mm512_sub_ps(_mm512_setzero_ps(), b);
    const __m512 lo = _mm512_add_ps(round_as(T{}, _mm512_mul_ps(a, load16(cos + i, m))),
                                    round_as(T{}, _mm512_mul_ps(minus_b, load16(sin + i, m))));
    const __m512 hi = _mm512_add_ps(round_as(T{}, _mm512_mul_ps(b, load16(cos + i + half, m))),
                                    round_as(T{}, _mm512_mul_ps(a, load16(sin + i + half, m))));
    store16(x + i, lo, m);
    store16(x + i + half, hi, m);
  }
#else
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_float(x[i]), b = to_float(x[i + half]);
    const float lo = round_as(T{}, a * to_float(cos[i])) + round_as(T{}, -b * to_float(sin[i]));
    const float hi = round_as(T{}, b * to_float(cos[i + half])) + round_as(T{}, a * to_float(sin[i + half]));
    store_as(x + i, lo);
    store_as(x + i + half, hi);
  }
#endif
}

template <typename T>
void rotate(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  T* base = static_cast<T*>(x.data_ptr());
  const T* c = static_cast<const T*>(cos.data_ptr());
  const T* s = static_cast<const T*>(sin.data_ptr());
  at::parallel_for(0, tokens, GRAIN, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      if (t + TOKENS_AHEAD < hi) {
        for (int64_t h = 0; h < heads; ++h) {
          prefetch_lines_for_write(base + (t + TOKENS_AHEAD) * token_stride + h * head_stride,
                                   dim * static_cast<int64_t>(sizeof(T)));
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        rotate_head(base + t * token_stride + h * head_stride, c + t * dim, s + t * dim, dim / 2);
      }
    }
  });
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rotary_: float32 or bfloat16 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_: x must be [T, H, D], D even, each head contiguous");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == x.size(0) && t->size(1) == x.size(2),
                "rotary_: cos and sin must be contiguous [T, D] of x's dtype");
  }
  by_dtype(x, [&](auto raw) { rotate<decltype(raw)>(x, cos, sin); });
}

// silu(g) = g / (1 + exp(-g)) in float32, as torch's silu kernel: through torch's vector exp where torch takes its
// vector path (AVX-512: 32 bfloat16 or 16 float32 values at a time; AVX2: 16 or 8), the libm exp for the rest
// (torch's scalar path).
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const int64_t step = std::is_same_v<T, uint16_t> ? 32 : 16;
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + step <= n; i += step) {
    for (int64_t j = i; j < i + step; j += 16) {
      const __m512 g = load16(gate + j, first_lanes(16));
      const __m512 e = torch_exp(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 act = round_as(T{}, _mm512_div_ps(g, _mm512_add_ps(one, e)));
      store16(out + j, _mm512_mul_ps(act, load16(up + j, first_lanes(16))), first_lanes(16));
    }
  }
#elif defined(__AVX2__)
  const int64_t step = std::is_same_v<T, uint16_t> ? 16 : 8;
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + step <= n; i += step) {
    for (int64_t j = i; j < i + step; j += 8) {
      const __m256 g = load8(gate + j);
      const __m256 e = torch_exp(_mm256_sub_ps(_mm256_setzero_ps(), g));
      const __m256 act = round_as(T{}, _mm256_div_ps(g, _mm256_add_ps(one, e)));
      store8(out + j, _mm256_mul_ps(act, load8(up + j)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float x = to_float(gate[i]);
    store_as(out + i, round_as(T{}, x / (1.f + std::exp(-x))) * to_float(up[i]));
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: the last dimension must be even");
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / std::max<int64_t>(2 * width, 1);
  auto shape = gate_up.sizes().vec();
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  by_dtype(gate_up, [&](auto raw) {
    using T = decltype(raw);
    const auto* in = static_cast<const T*>(gate_up.data_ptr());
    auto* o = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, rows, GRAIN, [&](int64_t lo, int64_t hi) {
      const FlushDenormals flush;  // exp(-x) of a large gate value underflows
      for (int64_t r = lo; r < hi; ++r) {
        const T* row = in + r * 2 * width;
        silu_mul_row(row, row + width, o + r * width, width);
      }
    });
  });
  return out;
}

// The caches' pool (kv_pool.h) and the slots as write_kv and gather_kv take them, every slot inside the pool.
Pool check_pool(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots) {
  const Pool pool = pool_of(k_cache, v_cache, op);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), op,
              ": slots must be contiguous int64 [T]");
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t capacity = pool.num_blocks * pool.block_size;
  for (int64_t t = 0; t < slots.size(0); ++t) TORCH_CHECK(s[t] >= 0 && s[t] < capacity, op, ": slot out of range");
  return pool;
}

// The element offset of slot `slot`'s head `head` in the pool.
inline int64_t slot_at(const Pool& pool, int64_t slot, int64_t head) {
  return pool.at(slot / pool.block_size, slot % pool.block_size, head);
}

void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  const Pool pool = check_pool("write_kv", k_cache, v_cache, slots);
  const int64_t tokens = slots.size(0), row = k_cache.size(2) * k_cache.size(3);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == k_cache.scalar_type() && t->dim() == 3 && t->size(0) == tokens &&
                    t->size(1) * t->size(2) == row && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "write_kv: k and v must be [T, Hkv, D] of the caches' dtype, each token's heads contiguous");
  }
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t element = k_cache.element_size(), bytes = row * element, head_bytes = pool.dim * element;
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * element, v_stride = v.stride(0) * element;
  at::parallel_for(0, tokens, GRAIN * 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      if (t + TOKENS_AHEAD < hi) {  // that token's k and v rows, and the slot they go to
        const int64_t next = t + TOKENS_AHEAD;
        prefetch_lines(kp + next * k_stride, bytes);
        prefetch_lines(vp + next * v_stride, bytes);
        for (int64_t h = 0; h < pool.kv_heads; ++h) {  // a head's run, wherever the pool's layout puts it
          const int64_t at = slot_at(pool, s[next], h) * element;
          prefetch_lines_for_write(kc + at, head_bytes);
          prefetch_lines_for_write(vc + at, head_bytes);
        }
      }
      if (!pool.head_major) {  // a slot's heads side by side: one copy
        std::memcpy(kc + s[t] * bytes, kp + t * k_stride, bytes);
        std::memcpy(vc + s[t] * bytes, vp + t * v_stride, bytes);
        continue;
      }
      for (int64_t h = 0; h < pool.kv_heads; ++h) {
        const int64_t at = slot_at(pool, s[t], h) * element;
        std::memcpy(kc + at, kp + t * k_stride + h * head_bytes, head_bytes);
        std::memcpy(vc + at, vp + t * v_stride + h * head_bytes, head_bytes);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> gather_kv(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             const at::Tensor& slots) {
  const Pool pool = check_pool("gather_kv", k_cache, v_cache, slots);
  const int64_t tokens = slots.size(0), heads = pool.kv_heads, dim = pool.dim;
  at::Tensor k = at::empty({heads, tokens, dim}, k_cache.options());
  at::Tensor v = at::empty({heads, tokens, dim}, v_cache.options());
  const int64_t element = k_cache.element_size(), bytes = dim * element;
  const int64_t* s = slots.data_ptr<int64_t>();
  const auto* kc = static_cast<const char*>(k_cache.data_ptr());
  const auto* vc = static_cast<const char*>(v_cache.data_ptr());
  auto* kp = static_cast<char*>(k.data_ptr());
  auto* vp = static_cast<char*>(v.data_ptr());
  at::parallel_for(0, tokens, GRAIN * 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t at = slot_at(pool, s[t], h) * element;
        std::memcpy(kp + (h * tokens + t) * bytes, kc + at, bytes);
        std::memcpy(vp + (h * tokens + t) * bytes, vc + at, bytes);
      }
    }
  });
  return {k, v};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(textgen, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()");
  m.def("gather_kv(Tensor k_cache, Tensor v_cache, Tensor slots) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_mul", &silu_mul);
  m.impl("write_kv", &write_kv);
  m.impl("gather_kv", &gather_kv);
}
