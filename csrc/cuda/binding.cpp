// torch.ops.titan.*_native for CUDA tensors: argument checks (shared with CPU, op_checks.h),
// output allocation on the current stream's device, then the standalone kernels of titan_cuda.h.
// Contracts as the CPU implementations (csrc/cpu/rms_norm.cpp, csrc/cpu/rotary.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "../op_prologue.h"
#include "../op_registration.h"
#include "titan_cuda.h"

namespace titan::cuda {
namespace {

using at::Tensor;

DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::Float;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Half;
    default: TORCH_CHECK_TYPE(false, "expected dtype float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

// t as (rows, N) with unit stride inside a row: a view when the leading dims flatten, else a copy.
Tensor rows2d(const Tensor& t) {
  Tensor r = t.reshape({-1, t.size(-1)});
  if (r.size(1) > 1 && r.stride(1) != 1) r = r.contiguous();
  return r;
}

// The kernels read weight as float32 or as x's dtype; any other dtype is converted once here.
Tensor weight_for(const std::optional<Tensor>& weight, const Tensor& x) {
  Tensor w = *weight;
  if (w.scalar_type() != at::kFloat && w.scalar_type() != x.scalar_type()) w = w.to(at::kFloat);
  return w.contiguous();
}

int sm_count(int device) {
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "titan::", op, " (cuda): ", cudaGetErrorString(err));
}

std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd_cuda(const Tensor& x, const std::optional<Tensor>& residual,
                                                     const std::optional<Tensor>& weight, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  auto [y, h, rstd, done] = rms_norm_fwd_outputs(x, residual, weight, eps);
  if (done) return {y, h, rstd};
  const Tensor x2 = rows2d(x);
  RmsNormFwdArgs a;
  a.dtype = dtype_of(x);
  a.M = rstd.numel();
  a.N = x.size(-1);
  a.eps = static_cast<float>(eps);
  a.x = x2.const_data_ptr();
  a.x_row_stride = x2.stride(0);
  Tensor r2, w;
  if (residual.has_value()) {
    r2 = rows2d(*residual);
    a.residual = r2.const_data_ptr();
    a.residual_row_stride = r2.stride(0);
    a.h = h.mutable_data_ptr();
  }
  if (weight.has_value()) {
    w = weight_for(weight, x);
    a.weight = w.const_data_ptr();
    a.weight_dtype = dtype_of(w);
  }
  a.y = y.mutable_data_ptr();
  a.rstd = rstd.mutable_data_ptr<float>();
  check_launch(rms_norm_fwd(a, c10::cuda::getCurrentCUDAStream()), "rms_norm_fwd_native");
  return {y, h, rstd};
}

std::tuple<Tensor, Tensor> rms_norm_bwd_cuda(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& weight,
                                             const Tensor& rstd, const std::optional<Tensor>& dresidual,
                                             bool compute_dweight) {
  const c10::cuda::CUDAGuard guard(x.device());
  auto [dx, dw, want_dw, done] = rms_norm_bwd_outputs(dy, x, weight, rstd, dresidual, compute_dweight);
  if (done) return {dx, dw};
  const Tensor dy2 = rows2d(dy);
  const Tensor x2 = rows2d(x);
  const Tensor rs = rstd.contiguous();
  RmsNormBwdArgs a;
  a.dtype = dtype_of(x);
  a.M = rstd.numel();
  a.N = x.size(-1);
  a.dy = dy2.const_data_ptr();
  a.dy_row_stride = dy2.stride(0);
  a.x = x2.const_data_ptr();
  a.x_row_stride = x2.stride(0);
  a.rstd = rs.const_data_ptr<float>();
  a.num_sms = sm_count(x.get_device());
  Tensor dr2, w, ws;
  if (dresidual.has_value()) {
    dr2 = rows2d(*dresidual);
    a.dresidual = dr2.const_data_ptr();
    a.dresidual_row_stride = dr2.stride(0);
  }
  if (weight.has_value()) {
    w = weight_for(weight, x);
    a.weight = w.const_data_ptr();
    a.weight_dtype = dtype_of(w);
  }
  if (want_dw) {
    // Written in w's dtype (float32 or x's), returned in weight's.
    dw = at::empty({a.N}, w.options());
    a.dweight = dw.mutable_data_ptr();
    ws = at::empty({rms_norm_bwd_workspace(a)}, x.options().dtype(at::kFloat));
  }
  a.dx = dx.mutable_data_ptr();
  check_launch(rms_norm_bwd(a, ws.defined() ? ws.mutable_data_ptr<float>() : nullptr,
                            c10::cuda::getCurrentCUDAStream()),
               "rms_norm_bwd_native");
  if (want_dw && dw.scalar_type() != weight->scalar_type()) dw = dw.to(weight->scalar_type());
  return {dx, dw};
}

RotaryTensor rotary_tensor(const Tensor& x, Tensor& out) {
  RotaryTensor t;
  t.dtype = dtype_of(x);
  t.n_heads = x.size(2);
  t.x = x.const_data_ptr();
  t.stride_b = x.stride(0);
  t.stride_s = x.stride(1);
  t.stride_h = x.stride(2);
  t.out = out.mutable_data_ptr();
  return t;
}

template <bool kBackward>
std::tuple<Tensor, Tensor> rotary_cuda(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                       const std::optional<Tensor>& position_ids, bool interleaved) {
  const c10::cuda::CUDAGuard guard(q.device());
  auto [qo, ko, done] = rotary_outputs(q, k, cos, sin, position_ids);
  if (done) return {qo, ko};
  const Tensor qc = rotary_unit_inner(q);
  const Tensor kc = rotary_unit_inner(k);
  const auto [cf, sf] = rotary_tables(cos, sin);
  RotaryArgs a;
  a.batch = q.size(0);
  a.seq = q.size(1);
  a.head_dim = q.size(3);
  a.half = cf.size(1);
  a.cos = cf.const_data_ptr<float>();
  a.sin = sf.const_data_ptr<float>();
  a.cs_stride = cf.stride(0);
  a.max_positions = cf.size(0);
  const Tensor pos = rotary_positions(position_ids, a.batch, a.seq);
  if (pos.defined()) {
    a.pos = pos.const_data_ptr<int64_t>();
    a.pos_stride_b = pos.stride(0);
    a.pos_stride_s = pos.stride(1);
  }
  a.interleaved = interleaved;
  a.backward = kBackward;
  check_launch(rotary(a, rotary_tensor(qc, qo), rotary_tensor(kc, ko), c10::cuda::getCurrentCUDAStream()),
               kBackward ? "rotary_bwd_native" : "rotary_fwd_native");
  return {qo, ko};
}

}  // namespace

TORCH_LIBRARY_IMPL(titan, CUDA, m) {
  register_rms_norm<&rms_norm_fwd_cuda, &rms_norm_bwd_cuda>(m);
  register_rotary<&rotary_cuda<false>, &rotary_cuda<true>>(m);
}

}  // namespace titan::cuda
