// titan::rms_norm_fwd_native / rms_norm_bwd_native for CPU tensors: checks, output allocation,
// then the vectorized kernels of this machine's instruction set (kernels_impl.h).
//
// Contract (titan_kernels/reference/rms_norm.py): forward (x, residual?, weight?, eps) ->
// (y, h, rstd) with y, h contiguous in x.dtype (h undefined, i.e. None, without residual) and
// rstd (...) float32; backward (dy, x, weight?, rstd, dresidual?, compute_dweight) -> (dx, dweight)
// with dx contiguous in x.dtype and dweight (N,) in weight.dtype accumulated in float32 (undefined
// unless compute_dweight and weight is given).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "../op_checks.h"
#include "kernels.h"
#include "tensor_rows.h"

namespace titan::cpu {
namespace {

using at::Tensor;

// Below this many elements per thread, splitting the backward across threads costs more than it saves.
constexpr int64_t kMinElemsPerChunk = 32768;

std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd(const Tensor& x, const std::optional<Tensor>& residual,
                                                const std::optional<Tensor>& weight, double eps) {
  check_rms_norm_fwd(x, residual, weight, eps);
  const int64_t N = x.size(-1);
  Tensor y = at::empty(x.sizes(), x.options());
  Tensor h = residual.has_value() ? at::empty(x.sizes(), x.options()) : Tensor();
  Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  const int64_t M = rstd.numel();
  if (M == 0) return {y, h, rstd};
  if (N == 0) {  // an empty row: sum of squares 0, as the Triton kernel defines it
    rstd.fill_(1.0 / std::sqrt(eps));
    return {y, h, rstd};
  }
  RmsNormFwdParams p{};
  p.dtype = dtype_of(x);
  p.M = M;
  p.N = N;
  p.eps = static_cast<float>(eps);
  const Tensor xr = rows_view(x, p.x_rows);
  p.x = xr.const_data_ptr();
  Tensor rr;
  if (residual.has_value()) {
    rr = rows_view(*residual, p.r_rows);
    p.r = rr.const_data_ptr();
    p.h = h.mutable_data_ptr();
  }
  Tensor wf;
  if (weight.has_value()) {
    wf = weight->to(at::kFloat).contiguous();
    p.w = wf.const_data_ptr<float>();
  }
  p.y = y.mutable_data_ptr();
  p.rstd = rstd.mutable_data_ptr<float>();
  kernels().rms_norm_fwd(p);
  return {y, h, rstd};
}

std::tuple<Tensor, Tensor> rms_norm_bwd(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& weight,
                                        const Tensor& rstd, const std::optional<Tensor>& dresidual,
                                        bool compute_dweight) {
  check_rms_norm_bwd(dy, x, weight, rstd, dresidual);
  const int64_t N = x.size(-1);
  const int64_t M = rstd.numel();
  const bool want_dw = compute_dweight && weight.has_value();
  Tensor dx = at::empty(x.sizes(), x.options());
  if (M == 0 || N == 0) {
    if (dresidual.has_value()) dx.copy_(*dresidual);
    return {dx, want_dw ? at::zeros({N}, weight->options()) : Tensor()};
  }
  RmsNormBwdParams p{};
  p.dtype = dtype_of(x);
  p.M = M;
  p.N = N;
  const Tensor dyr = rows_view(dy, p.dy_rows);
  const Tensor xr = rows_view(x, p.x_rows);
  p.dy = dyr.const_data_ptr();
  p.x = xr.const_data_ptr();
  const Tensor rs = rstd.contiguous();
  p.rstd = rs.const_data_ptr<float>();
  Tensor drr, wf, dwp;
  if (dresidual.has_value()) {
    drr = rows_view(*dresidual, p.dres_rows);
    p.dres = drr.const_data_ptr();
  }
  if (weight.has_value()) {
    wf = weight->to(at::kFloat).contiguous();
    p.w = wf.const_data_ptr<float>();
  }
  p.n_chunks = std::clamp<int64_t>(M * N / kMinElemsPerChunk, 1, std::min<int64_t>(at::get_num_threads(), M));
  if (want_dw) {
    dwp = at::empty({p.n_chunks, N}, x.options().dtype(at::kFloat));
    p.dw_partial = dwp.mutable_data_ptr<float>();
  }
  p.dx = dx.mutable_data_ptr();
  kernels().rms_norm_bwd(p);
  Tensor dw;
  if (want_dw) dw = dwp.sum(0).to(weight->scalar_type());
  return {dx, dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(titan, CPU, m) {
  m.impl("rms_norm_fwd_native", &rms_norm_fwd);
  m.impl("rms_norm_bwd_native", &rms_norm_bwd);
}

}  // namespace titan::cpu
