// Where the paged KV pool's elements lie, for the ops that read or write it (decode_attention.cpp,
// prefill_attention.cpp, fused_ops.cpp). Every layer's keys and values are [N, S, Hkv, D] tensors (N blocks of S
// slots; models/kv_pool.py), in one of two memory orders:
// - TGI's, contiguous: a slot's KV heads side by side (what a GPU's kernels read);
// - head-major, the CPU pool's: each block holds one KV head's S slots side by side, then the next head's ([N, Hkv,
//   S, D] storage viewed as [N, S, Hkv, D]). The decode op reads a row's keys head by head 16 slots at a time, and
//   a head's 16 slots are then one run of memory instead of 16 runs a slot's heads apart: the cache is read at the
//   rate the memory serves address order (benchmark/README.md, "A head's slots side by side").
// A head's D values are contiguous in both.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace textgen_cpu {

struct Pool {
  int64_t num_blocks, block_size, kv_heads, dim;
  bool head_major;

  // Elements from a slot's head to the next head's, and from a slot to the next slot of the same block.
  int64_t head_stride() const { return head_major ? block_size * dim : dim; }
  int64_t slot_stride() const { return head_major ? dim : kv_heads * dim; }
  // The element offset of head `head` of the slot at `offset` in block `block`.
  int64_t at(int64_t block, int64_t offset, int64_t head) const {
    return block * block_size * kv_heads * dim + offset * slot_stride() + head * head_stride();
  }
};

// The pool that k_cache and v_cache form: [N, S, Hkv, D] of one dtype and the same strides, in one of the two orders
// above; `op` names the caller in the errors.
inline Pool pool_of(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* op) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              op, ": caches must be [N, S, Hkv, D] of one dtype and layout");
  const int64_t n = k_cache.size(0), s = k_cache.size(1), h = k_cache.size(2), d = k_cache.size(3);
  const bool contiguous = k_cache.is_contiguous();
  const bool head_major = !contiguous && k_cache.stride(3) == 1 && k_cache.stride(1) == d &&
                          k_cache.stride(2) == s * d && k_cache.stride(0) == h * s * d;
  TORCH_CHECK(contiguous || head_major, op,
              ": caches must be contiguous [N, S, Hkv, D] or head-major ([N, Hkv, S, D] viewed as [N, S, Hkv, D])");
  return {n, s, h, d, head_major};
}

// The pool offsets (in elements) of a row's positions [first, first + count) at KV head `head`: position p sits in
// slot p % S of block table[p / S]. False where the table names a block outside the pool (out then partly written).
// A block at a time: a division per position (S is known only at run time) took 4% of the prefill op on W2's rows.
inline bool pool_offsets(const int32_t* table, int64_t first, int64_t count, const Pool& pool, int64_t head,
                         int64_t* out) {
  for (int64_t t = 0; t < count;) {
    const int64_t pos = first + t, block = table[pos / pool.block_size], slot = pos % pool.block_size;
    if (block < 0 || block >= pool.num_blocks) return false;
    const int64_t n = std::min(pool.block_size - slot, count - t), at = pool.at(block, slot, head);
    for (int64_t i = 0; i < n; ++i) out[t + i] = at + i * pool.slot_stride();
    t += n;
  }
  return true;
}

}  // namespace textgen_cpu
