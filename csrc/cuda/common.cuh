// Device helpers shared by the titan CUDA kernels: 16-byte packs, float conversion, reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "titan_cuda.h"

namespace titan::cuda {

template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  static __device__ __forceinline__ float to(float v) { return v; }
  static __device__ __forceinline__ float from(float v) { return v; }
};
template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float to(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Cvt<__half> {
  static __device__ __forceinline__ float to(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from(float v) { return __float2half_rn(v); }
};

// VEC elements loaded / stored as one instruction (16 bytes when VEC * sizeof(T) == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, VEC>& v) {
  *reinterpret_cast<Pack<T, VEC>*>(p) = v;
}

template <typename T, int VEC>
__device__ __forceinline__ void to_float(const Pack<T, VEC>& p, float (&f)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = Cvt<T>::to(p.v[j]);
}

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> from_float(const float (&f)[VEC]) {
  Pack<T, VEC> p;
#pragma unroll
  for (int j = 0; j < VEC; ++j) p.v[j] = Cvt<T>::from(f[j]);
  return p;
}

// CNT consecutive float32 values, with the widest aligned loads (the host guarantees alignment to
// min(16, 4 * CNT) bytes).
template <int CNT>
__device__ __forceinline__ void load_floats(const float* p, float (&f)[CNT]) {
  if constexpr (CNT % 4 == 0) {
#pragma unroll
    for (int j = 0; j < CNT; j += 4) {
      const float4 v = *reinterpret_cast<const float4*>(p + j);
      f[j] = v.x;
      f[j + 1] = v.y;
      f[j + 2] = v.z;
      f[j + 3] = v.w;
    }
  } else if constexpr (CNT == 2) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    f[0] = v.x;
    f[1] = v.y;
  } else {
#pragma unroll
    for (int j = 0; j < CNT; ++j) f[j] = p[j];
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the TPR threads that share a row (one warp, or the whole block), returned to all of
// them. smem: at least TPR / 32 floats. With TPR > 32 every thread of the block must call it.
template <int TPR>
__device__ __forceinline__ float row_sum(float v, float* smem) {
  v = warp_sum(v);
  if constexpr (TPR == 32) {
    return v;
  } else {
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    float t = lane < TPR / 32 ? smem[lane] : 0.f;
    t = warp_sum(t);
    __syncthreads();  // smem is reused by the next row
    return t;
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int dtype_size(DType t) { return t == DType::Float ? 4 : 2; }

}  // namespace titan::cuda
