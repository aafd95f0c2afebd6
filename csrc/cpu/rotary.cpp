// titan::rotary_fwd_native / rotary_bwd_native for CPU tensors: checks, output allocation, then the
// vectorized kernel of this machine's instruction set (kernels_impl.h).
//
// Contract (titan_kernels/reference/rotary.py): q (batch, seq, n_heads, head_dim) and
// k (batch, seq, n_kv_heads, head_dim), any strides; cos, sin (max_positions, R) with 2R <= head_dim;
// position_ids None (= arange(seq)), (seq,) or (batch, seq) integers. Returns contiguous rotated
// copies of q and k in their dtypes; the backward rotates by -theta. A position outside
// [0, max_positions) is never read: its rotated dims come out NaN.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "../op_prologue.h"
#include "../op_registration.h"
#include "kernels.h"
#include "tensor_rows.h"

namespace titan::cpu {
namespace {

using at::Tensor;

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

template <bool kBackward>
std::tuple<Tensor, Tensor> rotary(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                  const std::optional<Tensor>& position_ids, bool interleaved) {
  auto [qo, ko, done] = rotary_outputs(q, k, cos, sin, position_ids);
  if (done) return {qo, ko};
  const auto [cf, sf] = rotary_tables(cos, sin);
  const int64_t R = cf.size(1);
  const Tensor pos = rotary_positions(position_ids, q.size(0), q.size(1));
  const std::vector<float> nan_row(std::max<int64_t>(R, 1), std::numeric_limits<float>::quiet_NaN());

  const Tensor qc = rotary_unit_inner(q);
  const Tensor kc = rotary_unit_inner(k);
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
    p->backward = kBackward;
  }
  fill_params(pq, qc, qo);
  fill_params(pk, kc, ko);
  kernels().rotary(pq, pk);
  return {qo, ko};
}

}  // namespace

TORCH_LIBRARY_IMPL(titan, CPU, m) { register_rotary<&rotary<false>, &rotary<true>>(m); }

}  // namespace titan::cpu
