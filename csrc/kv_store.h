// KV-store launchers of nano_kvcache. No framework types: device pointers, sizes, strides in
// bytes and the CUDA stream arrive as integers, so the extension works with any torch version and
// inside CUDA graph capture. Every launcher throws std::runtime_error on a CUDA error.
//
// Cache layout (per layer and per K or V): [num_blocks, num_kv_heads, block_size, head_dim],
// contiguous. A slot s is block s / block_size, row s % block_size.
#pragma once

#include <cstdint>

namespace nano_kvcache {

// Writes key/value rows of num_tokens tokens into k_cache/v_cache at slot_mapping[t].
// key/value: [num_tokens, num_heads, row_bytes], rows contiguous, token and head strides in bytes.
// Slots < 0 (padding) and >= num_slots are skipped. slot_bytes is 4 (int32) or 8 (int64).
void store_kvcache(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache,
                   uintptr_t slot_mapping, int slot_bytes, int64_t num_tokens, int64_t num_slots,
                   int64_t num_heads, int64_t row_bytes, int64_t key_stride_token,
                   int64_t key_stride_head, int64_t value_stride_token,
                   int64_t value_stride_head, int64_t block_size, int device, uintptr_t stream);

// As store_kvcache, into FP8 (e4m3) caches: each value x of key/value (dtype 0: fp16, 1: bf16,
// 2: fp32; head_dim elements a row, strides in bytes) is stored as x * inv_scale rounded to
// nearest and saturated to +-448 (k_inv_scale for keys, v_inv_scale for values).
void store_kvcache_fp8(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache,
                       uintptr_t slot_mapping, int slot_bytes, int64_t num_tokens,
                       int64_t num_slots, int64_t num_heads, int64_t head_dim,
                       int64_t key_stride_token, int64_t key_stride_head,
                       int64_t value_stride_token, int64_t value_stride_head, int64_t block_size,
                       int dtype, float k_inv_scale, float v_inv_scale, int device,
                       uintptr_t stream);

// For each of num_tokens new tokens: its sequence b (query_start_loc[b] <= t <
// query_start_loc[b + 1]), its position start_pos[b] + t - query_start_loc[b] and its slot
// block_tables[b][pos / block_size] * block_size + pos % block_size. Tokens past
// query_start_loc[num_seqs], and positions beyond the table or on a negative entry, get slot -1.
// block_tables: int32 [num_seqs, max_blocks] (row stride in elements); query_start_loc: int32
// [num_seqs + 1]; start_pos: int32 [num_seqs]; slot_mapping, positions: int64 [num_tokens].
void compute_slot_mapping(uintptr_t block_tables, int64_t table_stride, int64_t max_blocks,
                          uintptr_t query_start_loc, uintptr_t start_pos, int64_t num_seqs,
                          int64_t block_size, uintptr_t slot_mapping, uintptr_t positions,
                          int64_t num_tokens, int device, uintptr_t stream);

// Copies whole blocks src -> dst in each of num_planes planes (layers x {K, V}) of a cache of
// num_blocks blocks of block_bytes each, planes contiguous one after another.
// block_mapping: int64 [num_pairs, 2]; pairs with an index outside [0, num_blocks) are skipped.
void copy_blocks(uintptr_t cache, int64_t num_planes, int64_t num_blocks, int64_t block_bytes,
                 uintptr_t block_mapping, int64_t num_pairs, int device, uintptr_t stream);

}  // namespace nano_kvcache
