// Meta (shape-only) implementations of the native ops, so they trace under FakeTensorMode and
// torch.compile like any aten op. Same checks and output shapes as the real kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

#include "op_checks.h"

namespace titan {
namespace {

using at::Tensor;

std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd_meta(const Tensor& x, const std::optional<Tensor>& residual,
                                                     const std::optional<Tensor>& weight, double eps) {
  check_rms_norm_fwd(x, residual, weight, eps);
  return {at::empty(x.sizes(), x.options()), residual.has_value() ? at::empty(x.sizes(), x.options()) : Tensor(),
          at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat))};
}

std::tuple<Tensor, Tensor> rms_norm_bwd_meta(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& weight,
                                             const Tensor& rstd, const std::optional<Tensor>& dresidual,
                                             bool compute_dweight) {
  check_rms_norm_bwd(dy, x, weight, rstd, dresidual);
  Tensor dw;
  if (compute_dweight && weight.has_value()) dw = at::empty({x.size(-1)}, weight->options());
  return {at::empty(x.sizes(), x.options()), dw};
}

std::tuple<Tensor, Tensor> rotary_meta(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                       const std::optional<Tensor>& position_ids, bool /*interleaved*/) {
  check_rotary(q, k, cos, sin, position_ids);
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options())};
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

Tensor swiglu_fwd_meta(const Tensor& gate, const Tensor& up) {
  return swiglu_clamped_fwd_meta(gate, up, 1.0, std::nullopt, 0.0);
}

std::tuple<Tensor, Tensor> swiglu_bwd_meta(const Tensor& dy, const Tensor& gate, const Tensor& up) {
  return swiglu_clamped_bwd_meta(dy, gate, up, 1.0, std::nullopt, 0.0);
}

void fused_adamw_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, double, double, double, double, double, double,
                      at::IntArrayRef keys, at::IntArrayRef offsets) {
  check_fused_adamw(params, grads, exp_avgs, exp_avg_sqs, keys, offsets);
}

}  // namespace

TORCH_LIBRARY_IMPL(titan, Meta, m) {
  m.impl("rms_norm_fwd_native", &rms_norm_fwd_meta);
  m.impl("rms_norm_bwd_native", &rms_norm_bwd_meta);
  m.impl("rotary_fwd_native", &rotary_meta);
  m.impl("rotary_bwd_native", &rotary_meta);
  m.impl("swiglu_fwd_native", &swiglu_fwd_meta);
  m.impl("swiglu_bwd_native", &swiglu_bwd_meta);
  m.impl("swiglu_clamped_fwd_native", &swiglu_clamped_fwd_meta);
  m.impl("swiglu_clamped_bwd_native", &swiglu_clamped_bwd_meta);
  m.impl("fused_adamw_native_", &fused_adamw_meta);
}

}  // namespace titan
