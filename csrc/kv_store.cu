// KV-store kernels: store_kvcache, compute_slot_mapping, copy_blocks (see kv_store.h).
#include "kv_store.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace nano_kvcache {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("nano_kvcache ") + what + ": " + cudaGetErrorString(err));
  }
}

// Runs on `device` for the scope of a call, restoring the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ == device) {
      previous_ = -1;
    } else {
      check(cudaSetDevice(device), "cudaSetDevice");
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// The widest access (16, 8, 4, 2 or 1 bytes) that divides every address and stride given.
int access_bytes(std::initializer_list<uint64_t> values) {
  for (int bytes : {16, 8, 4, 2}) {
    bool aligned = true;
    for (uint64_t v : values) aligned = aligned && v % bytes == 0;
    if (aligned) return bytes;
  }
  return 1;
}

template <int Bytes>
struct Access;
template <>
struct Access<16> { using type = uint4; };
template <>
struct Access<8> { using type = uint2; };
template <>
struct Access<4> { using type = uint32_t; };
template <>
struct Access<2> { using type = uint16_t; };
template <>
struct Access<1> { using type = uint8_t; };

// One token per warp-row of threads (its `items` spread over the row), several tokens per
// block for small rows.
struct TokenLaunch {
  dim3 block, grid;
  TokenLaunch(int items, int64_t num_tokens) {
    const int tx = std::min(256, (items + 31) / 32 * 32);
    const int ty = std::max(1, 256 / tx);
    block = dim3(tx, ty);
    grid = dim3(static_cast<unsigned>((num_tokens + ty - 1) / ty));
  }
};

template <typename Fn>
void dispatch_access(int bytes, Fn&& fn) {
  switch (bytes) {
    case 16: fn(Access<16>{}); break;
    case 8: fn(Access<8>{}); break;
    case 4: fn(Access<4>{}); break;
    case 2: fn(Access<2>{}); break;
    default: fn(Access<1>{}); break;
  }
}

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// What a store does to each item of a row: copies it (a vector of any width), or rounds it into
// an FP8 (e4m3) cache as x * inv_scale, to nearest and saturated to +-448.
struct Copy {
  template <typename T>
  __device__ T operator()(T x, float) const { return x; }
};
struct ToFp8 {
  template <typename T>
  __device__ __nv_fp8_e4m3 operator()(T x, float inv_scale) const {
    return __nv_fp8_e4m3(to_float(x) * inv_scale);
  }
};

// One token per row of threads; a thread takes consecutive items of the token's heads, so reads
// and writes stay coalesced. k_arg, v_arg: the op's argument for keys and for values.
template <typename Src, typename Dst, typename Op, typename Slot>
__global__ void store_kvcache_kernel(const char* __restrict__ key, const char* __restrict__ value,
                                     Dst* __restrict__ k_cache, Dst* __restrict__ v_cache,
                                     const Slot* __restrict__ slot_mapping, int64_t num_tokens,
                                     int64_t num_slots, int num_heads, int row_items,
                                     int64_t key_stride_token, int64_t key_stride_head,
                                     int64_t value_stride_token, int64_t value_stride_head,
                                     int64_t block_size, float k_arg, float v_arg) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (t >= num_tokens) return;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;
  const int64_t block = slot / block_size;
  const int64_t row = slot - block * block_size;
  const int items = num_heads * row_items;
  const Op op;
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    const int h = i / row_items;
    const int c = i - h * row_items;
    const Src k = reinterpret_cast<const Src*>(key + t * key_stride_token + h * key_stride_head)[c];
    const Src v =
        reinterpret_cast<const Src*>(value + t * value_stride_token + h * value_stride_head)[c];
    const int64_t dst = ((block * num_heads + h) * block_size + row) * row_items + c;
    k_cache[dst] = op(k, k_arg);
    v_cache[dst] = op(v, v_arg);
  }
}

// fn(slots) with slot_mapping as int32 or int64 pointers.
template <typename Fn>
void dispatch_slots(int slot_bytes, uintptr_t slot_mapping, Fn&& fn) {
  if (slot_bytes == 8) {
    fn(reinterpret_cast<const int64_t*>(slot_mapping));
  } else if (slot_bytes == 4) {
    fn(reinterpret_cast<const int32_t*>(slot_mapping));
  } else {
    throw std::invalid_argument("slot_bytes must be 4 or 8");
  }
}

__global__ void slot_mapping_kernel(const int32_t* __restrict__ block_tables,
                                    int64_t table_stride, int64_t max_blocks,
                                    const int32_t* __restrict__ query_start_loc,
                                    const int32_t* __restrict__ start_pos, int64_t num_seqs,
                                    int64_t block_size, int64_t* __restrict__ slot_mapping,
                                    int64_t* __restrict__ positions, int64_t num_tokens) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= num_tokens) return;
  int64_t slot = -1;
  int64_t pos = 0;
  if (num_seqs > 0 && t >= query_start_loc[0] && t < query_start_loc[num_seqs]) {
    // The sequence of token t: the largest b with query_start_loc[b] <= t.
    int64_t lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (query_start_loc[mid] <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    pos = start_pos[lo] + (t - query_start_loc[lo]);
    const int64_t index = pos / block_size;
    if (pos >= 0 && index < max_blocks) {
      const int64_t block = block_tables[lo * table_stride + index];
      if (block >= 0) slot = block * block_size + pos % block_size;
    }
  }
  slot_mapping[t] = slot;
  if (positions != nullptr) positions[t] = pos;
}

template <typename V>
__global__ void copy_blocks_kernel(char* __restrict__ cache, int64_t num_blocks,
                                   int64_t block_vecs, const int64_t* __restrict__ block_mapping) {
  const int64_t src = block_mapping[2 * blockIdx.x];
  const int64_t dst = block_mapping[2 * blockIdx.x + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks || src == dst) return;
  V* plane = reinterpret_cast<V*>(cache) + blockIdx.y * num_blocks * block_vecs;
  const V* from = plane + src * block_vecs;
  V* to = plane + dst * block_vecs;
  for (int64_t i = threadIdx.x; i < block_vecs; i += blockDim.x) to[i] = from[i];
}

}  // namespace

void store_kvcache(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache,
                   uintptr_t slot_mapping, int slot_bytes, int64_t num_tokens, int64_t num_slots,
                   int64_t num_heads, int64_t row_bytes, int64_t key_stride_token,
                   int64_t key_stride_head, int64_t value_stride_token,
                   int64_t value_stride_head, int64_t block_size, int device, uintptr_t stream) {
  if (num_tokens == 0) return;
  DeviceGuard guard(device);
  const int bytes = access_bytes({key, value, k_cache, v_cache, static_cast<uint64_t>(row_bytes),
                                  static_cast<uint64_t>(key_stride_token),
                                  static_cast<uint64_t>(key_stride_head),
                                  static_cast<uint64_t>(value_stride_token),
                                  static_cast<uint64_t>(value_stride_head)});
  const int row_vecs = static_cast<int>(row_bytes / bytes);
  const TokenLaunch shape(static_cast<int>(num_heads) * row_vecs, num_tokens);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  dispatch_access(bytes, [&](auto access) {
    using V = typename decltype(access)::type;
    dispatch_slots(slot_bytes, slot_mapping, [&](auto* slots) {
      store_kvcache_kernel<V, V, Copy><<<shape.grid, shape.block, 0, s>>>(
          reinterpret_cast<const char*>(key), reinterpret_cast<const char*>(value),
          reinterpret_cast<V*>(k_cache), reinterpret_cast<V*>(v_cache), slots, num_tokens,
          num_slots, static_cast<int>(num_heads), row_vecs, key_stride_token, key_stride_head,
          value_stride_token, value_stride_head, block_size, 0.0f, 0.0f);
    });
  });
  check(cudaGetLastError(), "store_kvcache launch");
}

void store_kvcache_fp8(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache,
                       uintptr_t slot_mapping, int slot_bytes, int64_t num_tokens,
                       int64_t num_slots, int64_t num_heads, int64_t head_dim,
                       int64_t key_stride_token, int64_t key_stride_head,
                       int64_t value_stride_token, int64_t value_stride_head, int64_t block_size,
                       int dtype, float k_inv_scale, float v_inv_scale, int device,
                       uintptr_t stream) {
  if (num_tokens == 0) return;
  if (dtype < 0 || dtype > 2) throw std::invalid_argument("dtype must be 0, 1 or 2");
  DeviceGuard guard(device);
  const TokenLaunch shape(static_cast<int>(num_heads * head_dim), num_tokens);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  auto run = [&](auto in) {
    using In = decltype(in);
    dispatch_slots(slot_bytes, slot_mapping, [&](auto* slots) {
      store_kvcache_kernel<In, __nv_fp8_e4m3, ToFp8><<<shape.grid, shape.block, 0, s>>>(
          reinterpret_cast<const char*>(key), reinterpret_cast<const char*>(value),
          reinterpret_cast<__nv_fp8_e4m3*>(k_cache), reinterpret_cast<__nv_fp8_e4m3*>(v_cache),
          slots, num_tokens, num_slots, static_cast<int>(num_heads), static_cast<int>(head_dim),
          key_stride_token, key_stride_head, value_stride_token, value_stride_head, block_size,
          k_inv_scale, v_inv_scale);
    });
  };
  if (dtype == 0) {
    run(__half{});
  } else if (dtype == 1) {
    run(__nv_bfloat16{});
  } else {
    run(0.0f);
  }
  check(cudaGetLastError(), "store_kvcache_fp8 launch");
}

void compute_slot_mapping(uintptr_t block_tables, int64_t table_stride, int64_t max_blocks,
                          uintptr_t query_start_loc, uintptr_t start_pos, int64_t num_seqs,
                          int64_t block_size, uintptr_t slot_mapping, uintptr_t positions,
                          int64_t num_tokens, int device, uintptr_t stream) {
  if (num_tokens == 0) return;
  DeviceGuard guard(device);
  constexpr int threads = 256;
  const auto blocks = static_cast<unsigned>((num_tokens + threads - 1) / threads);
  slot_mapping_kernel<<<blocks, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const int32_t*>(block_tables), table_stride, max_blocks,
      reinterpret_cast<const int32_t*>(query_start_loc),
      reinterpret_cast<const int32_t*>(start_pos), num_seqs, block_size,
      reinterpret_cast<int64_t*>(slot_mapping), reinterpret_cast<int64_t*>(positions), num_tokens);
  check(cudaGetLastError(), "compute_slot_mapping launch");
}

void copy_blocks(uintptr_t cache, int64_t num_planes, int64_t num_blocks, int64_t block_bytes,
                 uintptr_t block_mapping, int64_t num_pairs, int device, uintptr_t stream) {
  if (num_pairs == 0 || num_planes == 0) return;
  if (num_planes > 65535) throw std::invalid_argument("copy_blocks: at most 65535 planes");
  DeviceGuard guard(device);
  const int bytes = access_bytes({cache, static_cast<uint64_t>(block_bytes)});
  const int64_t block_vecs = block_bytes / bytes;
  const int threads = static_cast<int>(std::min<int64_t>(512, (block_vecs + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(num_planes));
  dispatch_access(bytes, [&](auto access) {
    using V = typename decltype(access)::type;
    copy_blocks_kernel<V><<<grid, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        reinterpret_cast<char*>(cache), num_blocks, block_vecs,
        reinterpret_cast<const int64_t*>(block_mapping));
  });
  check(cudaGetLastError(), "copy_blocks launch");
}

}  // namespace nano_kvcache
