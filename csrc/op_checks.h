// Argument checks shared by the CPU, CUDA and Meta implementations of the native ops.
// Errors name the argument, what was given and what was expected:
// TORCH_CHECK_TYPE -> TypeError (dtype), TORCH_CHECK_VALUE -> ValueError (shape, device, value).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>

namespace titan {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

inline void check_float_tensor(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_TYPE(is_supported_float(t.scalar_type()), arg,
                   ": expected dtype float32, bfloat16 or float16, got ", t.scalar_type());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* arg, const char* ref_arg) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), arg, ": expected device ", ref.device(), " (the device of ", ref_arg,
                    "), got ", t.device());
}

inline void check_like(const at::Tensor& t, const at::Tensor& ref, const char* arg, const char* ref_arg) {
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), arg, ": expected shape ", ref.sizes(), " (the shape of ", ref_arg,
                    "), got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), arg, ": expected dtype ", ref.scalar_type(),
                   " (the dtype of ", ref_arg, "), got ", t.scalar_type());
  check_same_device(t, ref, arg, ref_arg);
}

inline void check_weight(const std::optional<at::Tensor>& weight, const at::Tensor& x) {
  if (!weight.has_value()) return;
  check_float_tensor(*weight, "weight");
  TORCH_CHECK_VALUE(weight->dim() == 1 && weight->size(0) == x.size(-1), "weight: expected shape (", x.size(-1),
                    ",) to match the last dim of x, got ", weight->sizes());
  check_same_device(*weight, x, "weight", "x");
}

// rms_norm_fwd_native(x, residual, weight, eps)
inline void check_rms_norm_fwd(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                               const std::optional<at::Tensor>& weight, double eps) {
  check_float_tensor(x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, "x: expected at least 1 dimension (..., hidden), got a 0-d tensor");
  if (residual.has_value()) check_like(*residual, x, "residual", "x");
  check_weight(weight, x);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0, "eps: expected a finite value > 0, got ", eps);
}

// rms_norm_bwd_native(dy, x, weight, rstd, dresidual, compute_dweight)
inline void check_rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                               const at::Tensor& rstd, const std::optional<at::Tensor>& dresidual) {
  check_float_tensor(x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, "x: expected at least 1 dimension (..., hidden), got a 0-d tensor");
  check_like(dy, x, "dy", "x");
  if (dresidual.has_value()) check_like(*dresidual, x, "dresidual", "x");
  check_weight(weight, x);
  TORCH_CHECK_TYPE(rstd.scalar_type() == at::kFloat, "rstd: expected dtype float32, got ", rstd.scalar_type());
  TORCH_CHECK_VALUE(rstd.sizes() == x.sizes().slice(0, x.dim() - 1), "rstd: expected shape ",
                    x.sizes().slice(0, x.dim() - 1), " (the leading dims of x), got ", rstd.sizes());
  check_same_device(rstd, x, "rstd", "x");
}

// rotary_{fwd,bwd}_native(q, k, cos, sin, position_ids, interleaved)
inline void check_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                         const std::optional<at::Tensor>& position_ids) {
  check_float_tensor(q, "q");
  check_float_tensor(k, "k");
  TORCH_CHECK_VALUE(q.dim() == 4, "q: expected 4 dims (batch, seq, n_heads, head_dim), got shape ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4, "k: expected 4 dims (batch, seq, n_kv_heads, head_dim), got shape ", k.sizes());
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
                    "k: expected shape (", q.size(0), ", ", q.size(1), ", n_kv_heads, ", q.size(3),
                    ") to match q's batch, seq and head_dim, got ", k.sizes());
  check_same_device(k, q, "k", "q");
  check_float_tensor(cos, "cos");
  TORCH_CHECK_VALUE(cos.dim() == 2, "cos: expected 2 dims (max_positions, rotary_dim / 2), got shape ", cos.sizes());
  TORCH_CHECK_VALUE(sin.sizes() == cos.sizes(), "sin: expected shape ", cos.sizes(), " (the shape of cos), got ",
                    sin.sizes());
  check_float_tensor(sin, "sin");
  TORCH_CHECK_VALUE(2 * cos.size(1) <= q.size(3), "cos: expected rotary_dim / 2 <= head_dim / 2 = ", q.size(3) / 2,
                    ", got ", cos.size(1));
  check_same_device(cos, q, "cos", "q");
  check_same_device(sin, q, "sin", "q");
  if (position_ids.has_value()) {
    const at::Tensor& p = *position_ids;
    TORCH_CHECK_TYPE(at::isIntegralType(p.scalar_type(), /*includeBool=*/false),
                     "position_ids: expected an integer dtype, got ", p.scalar_type());
    const bool ok = (p.dim() == 1 && p.size(0) == q.size(1)) ||
                    (p.dim() == 2 && (p.size(0) == q.size(0) || p.size(0) == 1) && p.size(1) == q.size(1));
    TORCH_CHECK_VALUE(ok, "position_ids: expected shape (", q.size(1), ",) or (", q.size(0), ", ", q.size(1),
                      ") (seq or batch x seq), got ", p.sizes());
    check_same_device(p, q, "position_ids", "q");
  }
}

// swiglu_[clamped_]{fwd,bwd}_native([dy,] gate, up[, alpha, limit, up_offset]): gate and up (and dy) of
// one shape, dtype and device; alpha finite > 0, limit none or finite > 0, up_offset finite.
inline void check_swiglu(const at::Tensor& gate, const at::Tensor& up, const at::Tensor* dy, double alpha,
                         const std::optional<double>& limit, double up_offset) {
  check_float_tensor(gate, "gate");
  TORCH_CHECK_VALUE(gate.dim() >= 1, "gate: expected at least 1 dimension (..., hidden), got a 0-d tensor");
  check_like(up, gate, "up", "gate");
  if (dy != nullptr) check_like(*dy, gate, "dy", "gate");
  TORCH_CHECK_VALUE(std::isfinite(alpha) && alpha > 0, "alpha: expected a finite value > 0, got ", alpha);
  TORCH_CHECK_VALUE(!limit.has_value() || (std::isfinite(*limit) && *limit > 0),
                    "limit: expected None (no clamp) or a finite value > 0, got ", limit.value_or(0.0));
  TORCH_CHECK_VALUE(std::isfinite(up_offset), "up_offset: expected a finite value, got ", up_offset);
}

// fused_adamw_native_(params, grads, exp_avgs, exp_avg_sqs, ..., keys, offsets): lists of one length;
// tensor i of each list of params[i]'s shape and device, contiguous; one dtype combination per call:
// params float32 or bfloat16, grads float32 or bfloat16, exp_avgs and exp_avg_sqs one dtype of those.
inline void check_fused_adamw(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, at::IntArrayRef keys, at::IntArrayRef offsets) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && keys.size() == n &&
                        offsets.size() == n,
                    "fused_adamw: expected params, grads, exp_avgs, exp_avg_sqs, keys and offsets of one length, got ",
                    n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ", keys.size(), ", ",
                    offsets.size());
  auto ok16 = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; };
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor* ts[4] = {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i]};
    const char* names[4] = {"params", "grads", "exp_avgs", "exp_avg_sqs"};
    for (int j = 0; j < 4; ++j) {
      TORCH_CHECK_TYPE(ok16(ts[j]->scalar_type()), names[j], "[", i, "]: expected dtype float32 or bfloat16, got ",
                       ts[j]->scalar_type());
      TORCH_CHECK_VALUE(ts[j]->sizes() == params[i].sizes(), names[j], "[", i, "]: expected shape ", params[i].sizes(),
                        " (the shape of params[", i, "]), got ", ts[j]->sizes());
      TORCH_CHECK_VALUE(ts[j]->device() == params[i].device(), names[j], "[", i, "]: expected device ",
                        params[i].device(), " (the device of params[", i, "]), got ", ts[j]->device());
      TORCH_CHECK_VALUE(ts[j]->is_contiguous(), names[j], "[", i, "]: expected a contiguous tensor");
    }
    TORCH_CHECK_TYPE(exp_avg_sqs[i].scalar_type() == exp_avgs[i].scalar_type(), "exp_avg_sqs[", i,
                     "]: expected dtype ", exp_avgs[i].scalar_type(), " (the dtype of exp_avgs[", i, "]), got ",
                     exp_avg_sqs[i].scalar_type());
    const at::TensorList lists[3] = {params, grads, exp_avgs};
    for (int j = 0; j < 3; ++j) {
      TORCH_CHECK_TYPE(lists[j][i].scalar_type() == lists[j][0].scalar_type(), names[j], "[", i, "]: expected dtype ",
                       lists[j][0].scalar_type(), " (one dtype per call, as ", names[j], "[0]), got ",
                       lists[j][i].scalar_type());
    }
  }
}

}  // namespace titan
