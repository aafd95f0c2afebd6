// Bridges at::Tensor to the raw-pointer kernel parameters (kernels.h): dtype tags and row indexers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "kernels.h"

namespace titan::cpu {

inline DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::Float;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Half;
    default: TORCH_CHECK_TYPE(false, "expected dtype float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

// The leading dims of t (all but the last) as a RowIndexer: size-1 dims dropped, dims that flatten
// onto one stride merged. Returns false when more than kMaxRowDims remain.
inline bool make_row_indexer(const at::Tensor& t, RowIndexer& out) {
  int64_t sizes[kMaxRowDims];
  int64_t strides[kMaxRowDims];
  int k = 0;  // dims collected, innermost first
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    const int64_t s = t.size(d);
    const int64_t st = t.stride(d);
    if (s == 1) continue;
    if (k > 0 && st == strides[k - 1] * sizes[k - 1]) {
      sizes[k - 1] *= s;
      continue;
    }
    if (k == kMaxRowDims) return false;
    sizes[k] = s;
    strides[k] = st;
    ++k;
  }
  if (k == 0) {
    out.ndim = 1;
    out.sizes[0] = 1;
    out.strides[0] = 0;
    return true;
  }
  out.ndim = k;
  for (int i = 0; i < k; ++i) {  // outermost first, as RowIndexer::offset expects
    out.sizes[i] = sizes[k - 1 - i];
    out.strides[i] = strides[k - 1 - i];
  }
  return true;
}

// t itself when its rows can be read in place (unit stride in the last dim, indexable leading
// dims), else a contiguous copy; `in` is filled for the returned tensor, which must outlive the kernel.
inline at::Tensor rows_view(const at::Tensor& t, RowsIn& in) {
  const bool inner_ok = t.size(-1) <= 1 || t.stride(-1) == 1;
  at::Tensor v = inner_ok && make_row_indexer(t, in.rows) ? t : t.contiguous();
  if (!v.is_same(t)) TORCH_INTERNAL_ASSERT(make_row_indexer(v, in.rows));
  in.data = v.const_data_ptr();
  return v;
}

}  // namespace titan::cpu
