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
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "../op_prologue.h"
#include "../op_registration.h"
#include "kernels.h"
#include "tensor_rows.h"

namespace titan::cpu {
namespace {

using at::Tensor;

// Below this many elements per thread, splitting the backward across threads costs more than it saves.
constexpr int64_t kMinElemsPerChunk = 32768;

std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd(const Tensor& x, const std::optional<Tensor>& residual,
                                                const std::optional<Tensor>& weight, double eps) {
  auto [y, h, rstd, done] = rms_norm_fwd_outputs(x, residual, weight, eps);
  if (done) return {y, h, rstd};
  RmsNormFwdParams p{};
  p.dtype = dtype_of(x);
  p.M = rstd.numel();
  p.N = x.size(-1);
  p.eps = static_cast<float>(eps);
  const Tensor xr = rows_view(x, p.x);
  Tensor rr;
  if (residual.has_value()) {
    rr = rows_view(*residual, p.r);
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
  auto [dx, dw, want_dw, done] = rms_norm_bwd_outputs(dy, x, weight, rstd, dresidual, compute_dweight);
  if (done) return {dx, dw};
  RmsNormBwdParams p{};
  p.dtype = dtype_of(x);
  p.M = rstd.numel();
  p.N = x.size(-1);
  const Tensor dyr = rows_view(dy, p.dy);
  const Tensor xr = rows_view(x, p.x);
  const Tensor rs = rstd.contiguous();
  p.rstd = rs.const_data_ptr<float>();
  Tensor drr, wf, dwp;
  if (dresidual.has_value()) drr = rows_view(*dresidual, p.dres);
  if (weight.has_value()) {
    wf = weight->to(at::kFloat).contiguous();
    p.w = wf.const_data_ptr<float>();
  }
  p.n_chunks = std::clamp<int64_t>(p.M * p.N / kMinElemsPerChunk, 1, std::min<int64_t>(at::get_num_threads(), p.M));
  if (want_dw) {
    dwp = at::empty({p.n_chunks, p.N}, x.options().dtype(at::kFloat));
    p.dw_partial = dwp.mutable_data_ptr<float>();
  }
  p.dx = dx.mutable_data_ptr();
  kernels().rms_norm_bwd(p);
  if (want_dw) dw = dwp.sum(0).to(weight->scalar_type());
  return {dx, dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(titan, CPU, m) { register_rms_norm<&rms_norm_fwd, &rms_norm_bwd>(m); }

}  // namespace titan::cpu
