// titan::fused_adamw_native_ for CPU tensors: checks, the tensor table, then the AdamW kernel of
// this machine's instruction set (optim_impl.h).
//
// Contract (titan_kernels/reference/fused_adamw.py): in place over lists of contiguous tensors of
// one shape each (param float32/bfloat16, grad float32/bfloat16, exp_avg and exp_avg_sq of one
// dtype float32/bfloat16); bfloat16 storage is written with stochastic rounding from the per-tensor
// stream keys[i] at counters offsets[i]... Every tensor of a call has the same dtype combination
// (the Python op groups them).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "../op_checks.h"
#include "kernels.h"
#include "tensor_rows.h"

namespace titan::cpu {
namespace {

using at::Tensor;

void fused_adamw(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 double beta1, double beta2, double eps, double decay, double step_size, double bc2_sqrt,
                 at::IntArrayRef keys, at::IntArrayRef offsets) {
  check_fused_adamw(params, grads, exp_avgs, exp_avg_sqs, keys, offsets);
  if (params.empty()) return;
  std::vector<AdamWTensor> table;
  table.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    table.push_back({params[i].mutable_data_ptr(), grads[i].const_data_ptr(), exp_avgs[i].mutable_data_ptr(),
                     exp_avg_sqs[i].mutable_data_ptr(), params[i].numel(), offsets[i],
                     static_cast<uint32_t>(keys[i])});
  }
  if (table.empty()) return;
  AdamWParams q{};
  q.p_dtype = dtype_of(params[0]);
  q.g_dtype = dtype_of(grads[0]);
  q.s_dtype = dtype_of(exp_avgs[0]);
  q.tensors = table.data();
  q.n_tensors = static_cast<int64_t>(table.size());
  // The same float32 constants as the reference's Python scalars (computed in double, then rounded).
  q.omb1 = static_cast<float>(1.0 - beta1);
  q.beta2 = static_cast<float>(beta2);
  q.omb2 = static_cast<float>(1.0 - beta2);
  q.eps = static_cast<float>(eps);
  q.decay = static_cast<float>(decay);
  q.step_size = static_cast<float>(step_size);
  q.bc2_sqrt = static_cast<float>(bc2_sqrt);
  kernels().adamw(q);
}

}  // namespace

TORCH_LIBRARY_IMPL(titan, CPU, m) { m.impl("fused_adamw_native_", &fused_adamw); }

}  // namespace titan::cpu
