// What the CPU, CUDA and Meta implementations of a native op do before their kernel, written once:
// check the arguments (op_checks.h), allocate the outputs of the op's contract
// (titan_kernels/reference/*.py) and settle the calls that leave the kernel nothing to compute; and
// the input preparations that the raw-pointer kernels of both devices share. `shapes_only` (Meta):
// check and allocate, nothing that reads a size's value (sizes may be symbolic there).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <optional>

#include "op_checks.h"

namespace titan {

// rms_norm_fwd_native: y and h (h only with a residual) like x, rstd (...) float32. `done`: no rows,
// or empty rows, whose rstd (sum of squares 0, as the Triton kernel defines it) is set here.
struct RmsNormFwdOutputs {
  at::Tensor y, h, rstd;
  bool done = false;
};

inline RmsNormFwdOutputs rms_norm_fwd_outputs(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                              const std::optional<at::Tensor>& weight, double eps,
                                              bool shapes_only = false) {
  check_rms_norm_fwd(x, residual, weight, eps);
  RmsNormFwdOutputs o;
  o.y = at::empty(x.sizes(), x.options());
  if (residual.has_value()) o.h = at::empty(x.sizes(), x.options());
  o.rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  if (shapes_only) return o;
  if (o.rstd.numel() == 0) {
    o.done = true;
  } else if (x.size(-1) == 0) {
    o.rstd.fill_(1.0 / std::sqrt(eps));
    o.done = true;
  }
  return o;
}

// rms_norm_bwd_native: dx like x; dweight (N,) in weight's dtype when `want_dw` (compute_dweight and a
// weight), allocated by the caller, which accumulates it in float32 (here with shapes_only). `done`:
// no rows or empty rows, with dx = dresidual (or uninitialized: no elements) and dweight zeros set.
struct RmsNormBwdOutputs {
  at::Tensor dx, dw;
  bool want_dw = false;
  bool done = false;
};

inline RmsNormBwdOutputs rms_norm_bwd_outputs(const at::Tensor& dy, const at::Tensor& x,
                                              const std::optional<at::Tensor>& weight, const at::Tensor& rstd,
                                              const std::optional<at::Tensor>& dresidual, bool compute_dweight,
                                              bool shapes_only = false) {
  check_rms_norm_bwd(dy, x, weight, rstd, dresidual);
  RmsNormBwdOutputs o;
  o.dx = at::empty(x.sizes(), x.options());
  o.want_dw = compute_dweight && weight.has_value();
  if (shapes_only) {
    if (o.want_dw) o.dw = at::empty({x.size(-1)}, weight->options());
  } else if (rstd.numel() == 0 || x.size(-1) == 0) {
    if (dresidual.has_value()) o.dx.copy_(*dresidual);
    if (o.want_dw) o.dw = at::zeros({x.size(-1)}, weight->options());
    o.done = true;
  }
  return o;
}

// rotary_{fwd,bwd}_native: contiguous q_out, k_out like q, k. `done`: no tokens or no head dims.
struct RotaryOutputs {
  at::Tensor q_out, k_out;
  bool done = false;
};

inline RotaryOutputs rotary_outputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                    const at::Tensor& sin, const std::optional<at::Tensor>& position_ids,
                                    bool shapes_only = false) {
  check_rotary(q, k, cos, sin, position_ids);
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options()),
          !shapes_only && (q.size(0) * q.size(1) == 0 || q.size(3) == 0)};
}

// q or k with unit stride in head_dim (the kernels' vector loads need it): itself, else a contiguous copy.
inline at::Tensor rotary_unit_inner(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

// cos and sin as the kernels read them: float32 (max_positions, R), one column stride 1 and one row
// stride for both.
struct RotaryTables {
  at::Tensor cos, sin;
};

inline RotaryTables rotary_tables(const at::Tensor& cos, const at::Tensor& sin) {
  RotaryTables t{cos.to(at::kFloat), sin.to(at::kFloat)};
  if (t.cos.size(1) > 1 && (t.cos.stride(1) != 1 || t.sin.strides() != t.cos.strides())) {
    t.cos = t.cos.contiguous();
    t.sin = t.sin.contiguous();
  }
  return t;
}

// position_ids as int64 (batch, seq), a view where it broadcasts; undefined without position_ids.
inline at::Tensor rotary_positions(const std::optional<at::Tensor>& position_ids, int64_t batch, int64_t seq) {
  return position_ids.has_value() ? position_ids->to(at::kLong).expand({batch, seq}) : at::Tensor();
}

}  // namespace titan
