// Standalone CUDA kernels of titan: RMSNorm (+ fused residual) forward/backward and rotary
// embedding forward/backward, for sm_90 (and sm_80).
//
// The interface is raw device pointers, sizes and element strides plus a cudaStream_t; it depends
// on nothing but the CUDA runtime, so CMake builds and tests it without PyTorch
// (csrc/cuda/test/test_kernels.cu). csrc/cuda/binding.cpp registers it as torch.ops.titan.*_native.
//
// Math and contracts: titan_kernels/reference/rms_norm.py and titan_kernels/reference/rotary.py
// (Zhang & Sennrich 2019 eq. 4; Su et al. 2021 eq. 34). Arithmetic is float32 for every storage
// dtype. Every function returns cudaSuccess or the launch error; cudaErrorInvalidValue for
// arguments outside the contract (the binding checks them first and names the argument).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace titan::cuda {

enum class DType : int { Float = 0, BFloat16 = 1, Half = 2 };

// x, residual: (M, N) rows with a row stride (element stride 1 inside a row).
// Outputs y, h: (M, N) contiguous; rstd: (M,) float32.
struct RmsNormFwdArgs {
  DType dtype;            // of x, residual, y, h
  int64_t M = 0, N = 0;   // rows, hidden size
  float eps = 1e-6f;
  const void* x = nullptr;
  int64_t x_row_stride = 0;
  const void* residual = nullptr;  // optional; then h = x + residual is written and normalized
  int64_t residual_row_stride = 0;
  const void* weight = nullptr;    // optional (N,), dtype weight_dtype
  DType weight_dtype = DType::Float;
  void* y = nullptr;
  void* h = nullptr;               // required when residual is given
  float* rstd = nullptr;
};

// dy, x, dresidual: (M, N) rows with row strides; rstd (M,) float32.
// Outputs: dx (M, N) contiguous; dweight (N,) in weight_dtype when given.
struct RmsNormBwdArgs {
  DType dtype;
  int64_t M = 0, N = 0;
  const void* dy = nullptr;
  int64_t dy_row_stride = 0;
  const void* x = nullptr;
  int64_t x_row_stride = 0;
  const void* weight = nullptr;  // optional
  DType weight_dtype = DType::Float;
  const float* rstd = nullptr;
  const void* dresidual = nullptr;  // optional, added to dx
  int64_t dresidual_row_stride = 0;
  void* dx = nullptr;
  void* dweight = nullptr;  // optional (needs weight): float32 partial sums per block, then reduced
  int num_sms = 0;          // of the device; sizes the persistent grid
};

// One tensor to rotate: x (batch, seq, n_heads, head_dim) with strides (head_dim stride 1) into a
// contiguous out of the same shape.
struct RotaryTensor {
  DType dtype;
  int64_t n_heads = 0;
  const void* x = nullptr;
  int64_t stride_b = 0, stride_s = 0, stride_h = 0;
  void* out = nullptr;
};

// What q and k share: sizes, the cos/sin tables (max_positions, half) float32 with unit column
// stride, optional int64 positions at pos[b * pos_stride_b + s * pos_stride_s] (else s).
struct RotaryArgs {
  int64_t batch = 0, seq = 0, head_dim = 0;
  int64_t half = 0;  // rotary_dim / 2 pairs; dims >= 2 * half are copied
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t cs_stride = 0;  // row stride of cos and sin
  int64_t max_positions = 0;
  const int64_t* pos = nullptr;
  int64_t pos_stride_b = 0, pos_stride_s = 0;
  bool interleaved = false;  // pairs (2i, 2i+1), else (i, i + half)
  bool backward = false;     // rotate by -theta
};

cudaError_t rms_norm_fwd(const RmsNormFwdArgs& a, cudaStream_t stream);

// Float32 elements of scratch memory rms_norm_bwd needs (0 when dweight is not wanted).
int64_t rms_norm_bwd_workspace(const RmsNormBwdArgs& a);
cudaError_t rms_norm_bwd(const RmsNormBwdArgs& a, float* workspace, cudaStream_t stream);

// Rotates q and k (k.n_heads may be 0) in one launch when they share a dtype, else in two.
cudaError_t rotary(const RotaryArgs& a, const RotaryTensor& q, const RotaryTensor& k, cudaStream_t stream);

}  // namespace titan::cuda
