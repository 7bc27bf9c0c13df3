// A decoder layer of a paged decode step in two calls: everything up to the attention's output projection, and
// everything from the residual add after it to the MLP's down projection. The row-parallel projections'
// all_reduce sits between and after them, in Python (models/tp_llama.py, DecoderLayer.decode).
//
// Each block calls the same ops, in the same order, on the same tensors as DecoderLayer.decode, so its outputs are
// that path's bits; it only leaves out the Python between the ops: the small GPTQ model's batch-1 step went from
// 4.5-4.9 to 3.8-3.9 ms on the 2-core Zen 3 (benchmark/README.md, "A decode step's layers in two C++ calls").
//
// textgen::decode_attention_block(hidden, pending, norm, eps, kinds, weights, params, shape, scale, window, cos,
//     sin, k_cache, v_cache, slots, block_tables, seq_lens) -> (hidden, out):
//   hidden [T, E] the residual stream, pending [T, E] the last layer's MLP output (None for the first layer):
//   normed = norm(hidden + pending); qkv = q/k/v projection of normed; RoPE on the query and key heads; the keys
//   and values to `slots` of the pools; paged decode attention of every row's one query; out = o projection.
//   Returns (hidden + pending, out). shape: [rotated features, query features, key features, head_dim].
// textgen::decode_mlp_block(hidden, attn_out, norm, eps, kinds, weights, params) -> (hidden, out):
//   hidden += attn_out; out = down(silu(gate) * up) of the gate/up projection of norm(hidden).
//
// Each block's two projections are given as two kinds, three tensors and two integers each (Python:
// `Kernel.direct`, layers/linear_choice.py and quant_kernels.py):
//   LINEAR: F.linear(x, weight, bias)                            tensors (weight, bias?, -)
//   GEMV:   textgen::gemv(x, packed, bias, n, k_chunk)           tensors (packed, float32 bias?, -), ints (n, k_chunk)
//   INT4:   textgen::int4_gemv(x, packed, scales_offsets, g) + bias   tensors (packed, bias?, scales_offsets), (g, -)
//   INT8:   textgen::int8_gemv(x, ints, scales) + bias           tensors (ints, bias?, scales)
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace {

enum Kind : int64_t { LINEAR = 0, GEMV = 1, INT4 = 2, INT8 = 3 };

using Weights = c10::List<std::optional<at::Tensor>>;

// The textgen ops' signatures, and the ops found once through the dispatcher (each registered by its own source).
using T = const at::Tensor&;
using NormSig = at::Tensor(T, T, double);
using AddNormSig = std::tuple<at::Tensor, at::Tensor>(T, T, T, double);
using RotarySig = void(at::Tensor&, T, T);
using WriteKvSig = void(at::Tensor&, at::Tensor&, T, T, T);
using AttentionSig = at::Tensor(T, T, T, T, T, double, int64_t);
using SiluMulSig = at::Tensor(T);
using GemvSig = at::Tensor(T, T, const std::optional<at::Tensor>&, int64_t, int64_t);
using Int4GemvSig = at::Tensor(T, T, T, int64_t);
using Int8GemvSig = at::Tensor(T, T, T);

template <typename Signature>
c10::TypedOperatorHandle<Signature> textgen_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Ops {
  c10::TypedOperatorHandle<NormSig> rms_norm = textgen_op<NormSig>("textgen::rms_norm");
  c10::TypedOperatorHandle<AddNormSig> add_rms_norm = textgen_op<AddNormSig>("textgen::add_rms_norm");
  c10::TypedOperatorHandle<RotarySig> rotary = textgen_op<RotarySig>("textgen::rotary_");
  c10::TypedOperatorHandle<WriteKvSig> write_kv = textgen_op<WriteKvSig>("textgen::write_kv");
  c10::TypedOperatorHandle<AttentionSig> attention = textgen_op<AttentionSig>("textgen::paged_decode_attention");
  c10::TypedOperatorHandle<SiluMulSig> silu_mul = textgen_op<SiluMulSig>("textgen::silu_mul");
  c10::TypedOperatorHandle<GemvSig> gemv = textgen_op<GemvSig>("textgen::gemv");
  c10::TypedOperatorHandle<Int4GemvSig> int4_gemv = textgen_op<Int4GemvSig>("textgen::int4_gemv");
  c10::TypedOperatorHandle<Int8GemvSig> int8_gemv = textgen_op<Int8GemvSig>("textgen::int8_gemv");
};

const Ops& ops() {
  static const Ops found;
  return found;
}

std::optional<at::Tensor> weight_at(const Weights& weights, int64_t i) {
  const std::optional<at::Tensor> w = weights.get(i);
  return w.has_value() && w->defined() ? w : std::nullopt;
}

// Projection `which` (0 or 1) of a block, as its Kernel's __call__ computes it on x [T, K].
at::Tensor project(const at::Tensor& x, int64_t which, at::IntArrayRef kinds, const Weights& weights,
                   at::IntArrayRef params) {
  const std::optional<at::Tensor> a = weight_at(weights, 3 * which), bias = weight_at(weights, 3 * which + 1),
                                  c = weight_at(weights, 3 * which + 2);
  const int64_t p0 = params[2 * which], p1 = params[2 * which + 1];
  TORCH_CHECK(a.has_value(), "decode block: projection ", which, " has no weight");
  at::Tensor out;
  switch (kinds[which]) {
    case LINEAR:
      return at::linear(x, *a, bias);
    case GEMV:
      return ops().gemv.call(x, *a, bias, p0, p1);
    case INT4:
      TORCH_CHECK(c.has_value(), "decode block: an int4 projection needs its scales and offsets");
      out = ops().int4_gemv.call(x.contiguous(), *a, *c, p0);
      break;
    case INT8:
      TORCH_CHECK(c.has_value(), "decode block: an int8 projection needs its scales");
      out = ops().int8_gemv.call(x.contiguous(), *a, *c);
      break;
    default:
      TORCH_CHECK(false, "decode block: unknown projection kind ", kinds[which]);
  }
  return bias.has_value() ? out + *bias : out;
}

void check_plan(at::IntArrayRef kinds, const Weights& weights, at::IntArrayRef params) {
  TORCH_CHECK(kinds.size() == 2 && weights.size() == 6 && params.size() == 4,
              "decode block: two projections of (kind, three tensors, two integers) each");
}

std::tuple<at::Tensor, at::Tensor> decode_attention_block(
    const at::Tensor& hidden, const std::optional<at::Tensor>& pending, const at::Tensor& norm, double eps,
    at::IntArrayRef kinds, const Weights& weights, at::IntArrayRef params, at::IntArrayRef shape, double scale,
    int64_t window, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  check_plan(kinds, weights, params);
  TORCH_CHECK(shape.size() == 4, "decode_attention_block: shape is [rotated, query, key features, head_dim]");
  const int64_t rotated = shape[0], q_features = shape[1], kv_features = shape[2], head_dim = shape[3];
  at::Tensor residual = hidden, normed;
  if (pending.has_value() && pending->defined()) {
    std::tie(residual, normed) = ops().add_rms_norm.call(hidden, *pending, norm, eps);
  } else {
    normed = ops().rms_norm.call(hidden, norm, eps);
  }
  const at::Tensor qkv = project(normed, 0, kinds, weights, params);
  const int64_t tokens = qkv.size(0);
  at::Tensor turned = qkv.slice(1, 0, rotated).view({tokens, -1, head_dim});
  ops().rotary.call(turned, cos, sin);
  const auto parts = qkv.split_with_sizes({q_features, kv_features, kv_features}, -1);
  const at::Tensor q = parts[0].view({tokens, -1, head_dim}), k = parts[1].view({tokens, -1, head_dim}),
                   v = parts[2].view({tokens, -1, head_dim});
  ops().write_kv.call(k_cache, v_cache, slots, k, v);
  const at::Tensor out = ops().attention.call(q, k_cache, v_cache, block_tables, seq_lens, scale, window);
  return {residual, project(out.reshape({hidden.size(0), -1}), 1, kinds, weights, params)};
}

std::tuple<at::Tensor, at::Tensor> decode_mlp_block(const at::Tensor& hidden, const at::Tensor& attn_out,
                                                    const at::Tensor& norm, double eps, at::IntArrayRef kinds,
                                                    const Weights& weights, at::IntArrayRef params) {
  check_plan(kinds, weights, params);
  auto [residual, normed] = ops().add_rms_norm.call(hidden, attn_out, norm, eps);
  const at::Tensor gate_up = project(normed, 0, kinds, weights, params);
  return {residual, project(ops().silu_mul.call(gate_up), 1, kinds, weights, params)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(textgen, m) {
  m.def(
      "decode_attention_block(Tensor hidden, Tensor? pending, Tensor norm, float eps, int[] kinds, Tensor?[] weights, "
      "int[] params, int[] shape, float scale, int window, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slots, Tensor block_tables, Tensor seq_lens) -> (Tensor, Tensor)");
  m.def(
      "decode_mlp_block(Tensor hidden, Tensor attn_out, Tensor norm, float eps, int[] kinds, Tensor?[] weights, "
      "int[] params) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("decode_attention_block", &decode_attention_block);
  m.impl("decode_mlp_block", &decode_mlp_block);
}
