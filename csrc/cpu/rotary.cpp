// titan::rotary_fwd_native / rotary_bwd_native for CPU tensors: checks, output allocation, then the
// vectorized kernel of this machine's instruction set (kernels_impl.h).
//
// Contract (titan_kernels/reference/rotary.py): q (batch, seq, n_heads, head_dim) and
// k (batch, seq, n_kv_heads, head_dim), any strides; cos, sin (max_positions, R) with 2R <= head_dim;
// position_ids None (= arange(seq)), (seq,) or (batch, seq) integers. Returns contiguous rotated
// copies of q and k in their dtypes; the backward rotates by -theta. A position outside
// [0, max_positions) is never read: its rotated dims come out NaN.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

#include "../op_checks.h"
#include "kernels.h"
#include "tensor_rows.h"

namespace titan::cpu {
namespace {

using at::Tensor;

// Unit stride in head_dim (the kernels' vector loads need it), else a contiguous copy.
Tensor unit_inner(const Tensor& t) { return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous(); }

void fill_params(RotaryParams& p, const Tensor& x, Tensor& out) {
  p.dtype = dtype_of(x);
  p.batch = x.size(0);
  p.seq = x.size(1);
  p.n_heads = x.size(2);
  p.head_dim = x.size(3);
  p.x = x.const_data_ptr();
  p.x_stride_b = x.stride(0);
  p.x_stride_s = x.stride(1);
  p.x_stride_h = x.stride(2);
  p.out = out.mutable_data_ptr();
}

std::tuple<Tensor, Tensor> rotary(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                  const std::optional<Tensor>& position_ids, bool interleaved, bool backward) {
  check_rotary(q, k, cos, sin, position_ids);
  Tensor qo = at::empty(q.sizes(), q.options());
  Tensor ko = at::empty(k.sizes(), k.options());
  if (q.size(0) * q.size(1) == 0 || q.size(3) == 0) return {qo, ko};
  const int64_t R = cos.size(1);
  Tensor cf = cos.to(at::kFloat);
  Tensor sf = sin.to(at::kFloat);
  if (R > 1 && (cf.stride(1) != 1 || sf.strides() != cf.strides())) {
    cf = cf.contiguous();
    sf = sf.contiguous();
  }
  Tensor pos;
  if (position_ids.has_value()) pos = position_ids->to(at::kLong).expand({q.size(0), q.size(1)});
  const std::vector<float> nan_row(std::max<int64_t>(R, 1), std::numeric_limits<float>::quiet_NaN());

  const Tensor qc = unit_inner(q);
  const Tensor kc = unit_inner(k);
  RotaryParams pq{}, pk{};
  for (RotaryParams* p : {&pq, &pk}) {
    p->half = R;
    p->cos = cf.const_data_ptr<float>();
    p->sin = sf.const_data_ptr<float>();
    p->cs_stride = cf.stride(0);
    p->max_positions = cf.size(0);
    p->nan_row = nan_row.data();
    if (pos.defined()) {
      p->pos = pos.const_data_ptr<int64_t>();
      p->pos_stride_b = pos.stride(0);
      p->pos_stride_s = pos.stride(1);
    }
    p->interleaved = interleaved;
    p->backward = backward;
  }
  fill_params(pq, qc, qo);
  fill_params(pk, kc, ko);
  kernels().rotary(pq, pk);
  return {qo, ko};
}

std::tuple<Tensor, Tensor> rotary_fwd(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                      const std::optional<Tensor>& position_ids, bool interleaved) {
  return rotary(q, k, cos, sin, position_ids, interleaved, /*backward=*/false);
}

std::tuple<Tensor, Tensor> rotary_bwd(const Tensor& dq, const Tensor& dk, const Tensor& cos, const Tensor& sin,
                                      const std::optional<Tensor>& position_ids, bool interleaved) {
  return rotary(dq, dk, cos, sin, position_ids, interleaved, /*backward=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(titan, CPU, m) {
  m.impl("rotary_fwd_native", &rotary_fwd);
  m.impl("rotary_bwd_native", &rotary_bwd);
}

}  // namespace titan::cpu
