// titan::swiglu_fwd_native / swiglu_bwd_native for CPU tensors: checks, output allocation, then the
// vectorized kernels of this machine's instruction set (kernels_impl.h).
//
// Contract (titan_kernels/reference/swiglu.py): forward (gate, up) -> y = silu(gate) * up; backward
// (dy, gate, up) -> (dgate, dup) with sigmoid(gate) recomputed. Inputs of one shape (..., N) and
// dtype (float32, bfloat16, float16), any strides; outputs contiguous in that dtype; float32 math.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

#include "../op_checks.h"
#include "kernels.h"
#include "tensor_rows.h"

namespace titan::cpu {
namespace {

using at::Tensor;

// Fills the row views of the inputs; returns false when a (M, N) tensor has zero elements.
bool fill(SwigluParams& p, const Tensor& gate, const Tensor& up, const Tensor* dy, Tensor (&views)[3]) {
  p.dtype = dtype_of(gate);
  p.N = gate.size(-1);
  p.M = p.N == 0 ? 0 : gate.numel() / p.N;
  if (gate.numel() == 0) return false;
  views[0] = rows_view(gate, p.g_rows);
  views[1] = rows_view(up, p.u_rows);
  p.g = views[0].const_data_ptr();
  p.u = views[1].const_data_ptr();
  p.contiguous = views[0].is_contiguous() && views[1].is_contiguous();
  if (dy != nullptr) {
    views[2] = rows_view(*dy, p.dy_rows);
    p.dy = views[2].const_data_ptr();
    p.contiguous = p.contiguous && views[2].is_contiguous();
  }
  return true;
}

Tensor swiglu_fwd(const Tensor& gate, const Tensor& up) {
  check_swiglu(gate, up);
  Tensor y = at::empty(gate.sizes(), gate.options());
  SwigluParams p{};
  Tensor views[3];
  if (!fill(p, gate, up, nullptr, views)) return y;
  p.y = y.mutable_data_ptr();
  kernels().swiglu_fwd(p);
  return y;
}

std::tuple<Tensor, Tensor> swiglu_bwd(const Tensor& dy, const Tensor& gate, const Tensor& up) {
  check_swiglu(gate, up, &dy);
  Tensor dg = at::empty(gate.sizes(), gate.options());
  Tensor du = at::empty(gate.sizes(), gate.options());
  SwigluParams p{};
  Tensor views[3];
  if (!fill(p, gate, up, &dy, views)) return {dg, du};
  p.y = dg.mutable_data_ptr();
  p.du = du.mutable_data_ptr();
  kernels().swiglu_bwd(p);
  return {dg, du};
}

}  // namespace

TORCH_LIBRARY_IMPL(titan, CPU, m) {
  m.impl("swiglu_fwd_native", &swiglu_fwd);
  m.impl("swiglu_bwd_native", &swiglu_bwd);
}

}  // namespace titan::cpu
