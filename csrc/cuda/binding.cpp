// torch.ops.titan.*_native for CUDA tensors: argument checks (shared with CPU, op_checks.h),
// output allocation on the current stream's device, then the standalone kernels of titan_cuda.h.
// Contracts as the CPU implementations (csrc/cpu/rms_norm.cpp, csrc/cpu/rotary.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "../op_checks.h"
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
  check_rms_norm_fwd(x, residual, weight, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t N = x.size(-1);
  Tensor y = at::empty(x.sizes(), x.options());
  Tensor h = residual.has_value() ? at::empty(x.sizes(), x.options()) : Tensor();
  Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  const int64_t M = rstd.numel();
  if (M == 0) return {y, h, rstd};
  if (N == 0) {  // an empty row: sum of squares 0, as the CPU and Triton kernels define it
    rstd.fill_(1.0 / std::sqrt(eps));
    return {y, h, rstd};
  }
  const Tensor x2 = rows2d(x);
  RmsNormFwdArgs a;
  a.dtype = dtype_of(x);
  a.M = M;
  a.N = N;
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
  check_rms_norm_bwd(dy, x, weight, rstd, dresidual);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t N = x.size(-1);
  const int64_t M = rstd.numel();
  const bool want_dw = compute_dweight && weight.has_value();
  Tensor dx = at::empty(x.sizes(), x.options());
  if (M == 0 || N == 0) {
    if (dresidual.has_value()) dx.copy_(*dresidual);
    return {dx, want_dw ? at::zeros({N}, weight->options()) : Tensor()};
  }
  const Tensor dy2 = rows2d(dy);
  const Tensor x2 = rows2d(x);
  const Tensor rs = rstd.contiguous();
  RmsNormBwdArgs a;
  a.dtype = dtype_of(x);
  a.M = M;
  a.N = N;
  a.dy = dy2.const_data_ptr();
  a.dy_row_stride = dy2.stride(0);
  a.x = x2.const_data_ptr();
  a.x_row_stride = x2.stride(0);
  a.rstd = rs.const_data_ptr<float>();
  a.num_sms = sm_count(x.get_device());
  Tensor dr2, w, dw, ws;
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
    dw = at::empty({N}, w.options());
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

std::tuple<Tensor, Tensor> rotary_cuda(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                       const std::optional<Tensor>& position_ids, bool interleaved, bool backward) {
  check_rotary(q, k, cos, sin, position_ids);
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor qo = at::empty(q.sizes(), q.options());
  Tensor ko = at::empty(k.sizes(), k.options());
  if (q.size(0) * q.size(1) == 0 || q.size(3) == 0) return {qo, ko};
  auto unit_inner = [](const Tensor& t) { return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous(); };
  const Tensor qc = unit_inner(q);
  const Tensor kc = unit_inner(k);
  Tensor cf = cos.to(at::kFloat);
  Tensor sf = sin.to(at::kFloat);
  const int64_t R = cf.size(1);
  if (R > 1 && (cf.stride(1) != 1 || sf.strides() != cf.strides())) {
    cf = cf.contiguous();
    sf = sf.contiguous();
  }
  RotaryArgs a;
  a.batch = q.size(0);
  a.seq = q.size(1);
  a.head_dim = q.size(3);
  a.half = R;
  a.cos = cf.const_data_ptr<float>();
  a.sin = sf.const_data_ptr<float>();
  a.cs_stride = cf.stride(0);
  a.max_positions = cf.size(0);
  Tensor pos;
  if (position_ids.has_value()) {
    pos = position_ids->to(at::kLong).expand({a.batch, a.seq});
    a.pos = pos.const_data_ptr<int64_t>();
    a.pos_stride_b = pos.stride(0);
    a.pos_stride_s = pos.stride(1);
  }
  a.interleaved = interleaved;
  a.backward = backward;
  check_launch(rotary(a, rotary_tensor(qc, qo), rotary_tensor(kc, ko), c10::cuda::getCurrentCUDAStream()),
               backward ? "rotary_bwd_native" : "rotary_fwd_native");
  return {qo, ko};
}

std::tuple<Tensor, Tensor> rotary_fwd_cuda(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                           const std::optional<Tensor>& position_ids, bool interleaved) {
  return rotary_cuda(q, k, cos, sin, position_ids, interleaved, /*backward=*/false);
}

std::tuple<Tensor, Tensor> rotary_bwd_cuda(const Tensor& dq, const Tensor& dk, const Tensor& cos, const Tensor& sin,
                                           const std::optional<Tensor>& position_ids, bool interleaved) {
  return rotary_cuda(dq, dk, cos, sin, position_ids, interleaved, /*backward=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(titan, CUDA, m) {
  m.impl("rms_norm_fwd_native", &rms_norm_fwd_cuda);
  m.impl("rms_norm_bwd_native", &rms_norm_bwd_cuda);
  m.impl("rotary_fwd_native", &rotary_fwd_cuda);
  m.impl("rotary_bwd_native", &rotary_bwd_cuda);
}

}  // namespace titan::cuda
