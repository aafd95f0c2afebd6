// titan::swiglu_{fwd,bwd}_native and swiglu_clamped_{fwd,bwd}_native for CPU tensors: checks, output
// allocation, then the vectorized kernels of this machine's instruction set (kernels_impl.h).
//
// Contract (titan_kernels/reference/swiglu.py): forward (gate, up) -> y = silu(gate) * up; backward
// (dy, gate, up) -> (dgate, dup) with sigmoid(gate) recomputed; with alpha, limit, up_offset the clamped
// variant (GPT-OSS). Inputs of one shape (..., N) and dtype (float32, bfloat16, float16), any strides;
// outputs contiguous in that dtype; float32 math.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <tuple>

#include "../op_checks.h"
#include "../op_registration.h"
#include "kernels.h"
#include "tensor_rows.h"

namespace titan::cpu {
namespace {

using at::Tensor;

// Fills the row views of the inputs and the scalars; returns false when a (M, N) tensor has zero elements.
bool fill(SwigluParams& p, const Tensor& gate, const Tensor& up, const Tensor* dy, Tensor (&views)[3], double alpha,
          const std::optional<double>& limit, double up_offset) {
  p.dtype = dtype_of(gate);
  p.alpha = static_cast<float>(alpha);
  p.limit = limit.has_value() ? static_cast<float>(*limit) : std::numeric_limits<float>::infinity();
  p.up_offset = static_cast<float>(up_offset);
  p.N = gate.size(-1);
  p.M = p.N == 0 ? 0 : gate.numel() / p.N;
  if (gate.numel() == 0) return false;
  views[0] = rows_view(gate, p.g);
  views[1] = rows_view(up, p.u);
  p.contiguous = views[0].is_contiguous() && views[1].is_contiguous();
  if (dy != nullptr) {
    views[2] = rows_view(*dy, p.dy);
    p.contiguous = p.contiguous && views[2].is_contiguous();
  }
  return true;
}

Tensor swiglu_clamped_fwd(const Tensor& gate, const Tensor& up, double alpha, std::optional<double> limit,
                          double up_offset) {
  check_swiglu(gate, up, nullptr, alpha, limit, up_offset);
  Tensor y = at::empty(gate.sizes(), gate.options());
  SwigluParams p{};
  Tensor views[3];
  if (!fill(p, gate, up, nullptr, views, alpha, limit, up_offset)) return y;
  p.y = y.mutable_data_ptr();
  kernels().swiglu_fwd(p);
  return y;
}

std::tuple<Tensor, Tensor> swiglu_clamped_bwd(const Tensor& dy, const Tensor& gate, const Tensor& up, double alpha,
                                              std::optional<double> limit, double up_offset) {
  check_swiglu(gate, up, &dy, alpha, limit, up_offset);
  Tensor dg = at::empty(gate.sizes(), gate.options());
  Tensor du = at::empty(gate.sizes(), gate.options());
  SwigluParams p{};
  Tensor views[3];
  if (!fill(p, gate, up, &dy, views, alpha, limit, up_offset)) return {dg, du};
  p.y = dg.mutable_data_ptr();
  p.du = du.mutable_data_ptr();
  kernels().swiglu_bwd(p);
  return {dg, du};
}

}  // namespace

TORCH_LIBRARY_IMPL(titan, CPU, m) { register_swiglu<&swiglu_clamped_fwd, &swiglu_clamped_bwd>(m); }

}  // namespace titan::cpu
