// Meta (shape-only) implementations of the native ops, so they trace under FakeTensorMode and
// torch.compile like any aten op. Same checks and output shapes as the real kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

#include "op_checks.h"
#include "op_prologue.h"
#include "op_registration.h"

namespace titan {
namespace {

using at::Tensor;

std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd_meta(const Tensor& x, const std::optional<Tensor>& residual,
                                                     const std::optional<Tensor>& weight, double eps) {
  const auto o = rms_norm_fwd_outputs(x, residual, weight, eps, /*shapes_only=*/true);
  return {o.y, o.h, o.rstd};
}

std::tuple<Tensor, Tensor> rms_norm_bwd_meta(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& weight,
                                             const Tensor& rstd, const std::optional<Tensor>& dresidual,
                                             bool compute_dweight) {
  const auto o = rms_norm_bwd_outputs(dy, x, weight, rstd, dresidual, compute_dweight, /*shapes_only=*/true);
  return {o.dx, o.dw};
}

std::tuple<Tensor, Tensor> rotary_meta(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                       const std::optional<Tensor>& position_ids, bool /*interleaved*/) {
  const auto o = rotary_outputs(q, k, cos, sin, position_ids, /*shapes_only=*/true);
  return {o.q_out, o.k_out};
}

Tensor swiglu_clamped_fwd_meta(const Tensor& gate, const Tensor& up, double alpha, std::optional<double> limit,
                               double up_offset) {
  check_swiglu(gate, up, nullptr, alpha, limit, up_offset);
  return at::empty(gate.sizes(), gate.options());
}

std::tuple<Tensor, Tensor> swiglu_clamped_bwd_meta(const Tensor& dy, const Tensor& gate, const Tensor& up,
                                                   double alpha, std::optional<double> limit, double up_offset) {
  check_swiglu(gate, up, &dy, alpha, limit, up_offset);
  return {at::empty(gate.sizes(), gate.options()), at::empty(gate.sizes(), gate.options())};
}

void fused_adamw_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, double, double, double, double, double, double,
                      at::IntArrayRef keys, at::IntArrayRef offsets) {
  check_fused_adamw(params, grads, exp_avgs, exp_avg_sqs, keys, offsets);
}

}  // namespace

TORCH_LIBRARY_IMPL(titan, Meta, m) {
  register_rms_norm<&rms_norm_fwd_meta, &rms_norm_bwd_meta>(m);
  register_rotary<&rotary_meta, &rotary_meta>(m);
  register_swiglu<&swiglu_clamped_fwd_meta, &swiglu_clamped_bwd_meta>(m);
  m.impl("fused_adamw_native_", &fused_adamw_meta);
}

}  // namespace titan
