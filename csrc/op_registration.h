// The names each backend registers for an op family, written once (the schemas are in ops.cpp):
// CPU (cpu/*.cpp), CUDA (cuda/binding.cpp) and Meta (meta.cpp) call these in their
// TORCH_LIBRARY_IMPL blocks with their own functions, so no backend can miss or misspell one.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace titan {

// rms_norm_fwd_native, rms_norm_bwd_native.
template <auto Fwd, auto Bwd>
void register_rms_norm(torch::Library& m) {
  m.impl("rms_norm_fwd_native", Fwd);
  m.impl("rms_norm_bwd_native", Bwd);
}

// rotary_fwd_native, rotary_bwd_native (the backward is the rotation by -theta).
template <auto Fwd, auto Bwd>
void register_rotary(torch::Library& m) {
  m.impl("rotary_fwd_native", Fwd);
  m.impl("rotary_bwd_native", Bwd);
}

// swiglu_clamped_{fwd,bwd}_native, and the plain swiglu_{fwd,bwd}_native as the clamped kernels at
// alpha 1, no limit, up_offset 0 (separate ops: a schema with defaults costs every plain call ~0.2 us).
template <auto ClampedFwd, auto ClampedBwd>
void register_swiglu(torch::Library& m) {
  m.impl("swiglu_clamped_fwd_native", ClampedFwd);
  m.impl("swiglu_clamped_bwd_native", ClampedBwd);
  m.impl("swiglu_fwd_native",
         [](const at::Tensor& gate, const at::Tensor& up) { return ClampedFwd(gate, up, 1.0, std::nullopt, 0.0); });
  m.impl("swiglu_bwd_native", [](const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up) {
    return ClampedBwd(dy, gate, up, 1.0, std::nullopt, 0.0);
  });
}

}  // namespace titan
