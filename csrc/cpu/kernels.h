// CPU kernel interface: plain parameter structs (raw pointers, sizes, strides) and the per-ISA
// kernel tables.
//
// kernels_impl.h is compiled once per instruction set (kernels_default.cpp, kernels_avx2.cpp,
// kernels_avx512.cpp, each with its own compiler flags), the way ATen builds its own CPU kernels;
// dispatch.cpp picks the table for the machine at run time. Only this header is shared between those
// objects, so it holds nothing but POD types and declarations.
#pragma once

#include <cstdint>

namespace titan::cpu {

enum class DType : int { Float = 0, BFloat16 = 1, Half = 2 };

// Offsets of the rows of a tensor viewed as (rows, N): the leading dims (coalesced where they
// flatten) with their element strides. Handles slices and transposes of the leading dims without a
// copy; the last dim must have stride 1 (the caller makes it so).
constexpr int kMaxRowDims = 6;

struct RowIndexer {
  int ndim = 1;
  int64_t sizes[kMaxRowDims] = {0};
  int64_t strides[kMaxRowDims] = {0};

  int64_t offset(int64_t row) const {
    if (ndim == 1) return row * strides[0];
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t i = row % sizes[d];
      row /= sizes[d];
      off += i * strides[d];
    }
    return off;
  }
};

// A (rows, N) input read in place: its data and the offsets of its rows (unit stride inside a row).
struct RowsIn {
  const void* data = nullptr;  // nullptr: an optional input that is absent
  RowIndexer rows;
};

// y = x * rstd * w (h = x + r first when r is given). y, h, rstd are contiguous outputs.
struct RmsNormFwdParams {
  DType dtype;
  int64_t M;  // rows
  int64_t N;  // hidden size (row width), > 0
  float eps;
  RowsIn x;
  RowsIn r;        // residual, or no data
  const float* w;  // weight as float32 (N,) or nullptr
  void* y;         // (M, N) contiguous, dtype
  void* h;         // (M, N) contiguous, dtype, or nullptr when r is nullptr
  float* rstd;     // (M,)
};

// dx = rstd * (g - xhat * mean(g * xhat)) (+ dres), g = dy * w, xhat = x * rstd;
// dw_partial[c] = sum over the rows of chunk c of dy * xhat (float32).
struct RmsNormBwdParams {
  DType dtype;
  int64_t M;
  int64_t N;  // > 0
  RowsIn dy;
  RowsIn x;
  const float* w;     // float32 (N,) or nullptr
  const float* rstd;  // (M,) contiguous
  RowsIn dres;        // or no data
  void* dx;             // (M, N) contiguous, dtype
  float* dw_partial;    // (n_chunks, N) or nullptr when dweight is not wanted
  int64_t n_chunks;     // rows are split into n_chunks contiguous ranges, one per dw_partial row
};

// Rotary embedding of one tensor x (batch, seq, n_heads, head_dim) into a contiguous output.
struct RotaryParams {
  DType dtype;
  int64_t batch, seq, n_heads, head_dim;
  int64_t half;  // R = rotary_dim / 2 pairs; dims >= 2R are copied
  const void* x;
  int64_t x_stride_b, x_stride_s, x_stride_h;  // stride of head_dim is 1
  void* out;  // (batch, seq, n_heads, head_dim) contiguous
  const float* cos;  // (max_positions, R) float32, row stride cs_stride, column stride 1
  const float* sin;  // same shape and strides as cos
  int64_t cs_stride;
  int64_t max_positions;
  const float* nan_row;  // R NaNs: the cos/sin row of a position outside the table
  const int64_t* pos;  // positions or nullptr (= s); pos[b * pos_stride_b + s * pos_stride_s]
  int64_t pos_stride_b, pos_stride_s;
  bool interleaved;  // pairs (2i, 2i+1) instead of (i, i + R)
  bool backward;     // rotate by -theta
};

// SwiGLU over (M, N) rows, elementwise, s = sigmoid(g) recomputed in both passes:
// forward y = g * s * u; backward dg = dy * u * s * (1 + g * (1 - s)), du = dy * g * s.
// The clamped variant (GPT-OSS; alpha, limit, up_offset not 1, +inf, 0): g -> min(g, limit),
// u -> clamp(u, -limit, limit) + up_offset, s = sigmoid(alpha * g) (titan_kernels/reference/swiglu.py).
struct SwigluParams {
  DType dtype;
  int64_t M;
  int64_t N;  // > 0
  RowsIn g;
  RowsIn u;
  RowsIn dy;        // backward only (no data in the forward)
  bool contiguous;  // every input is (M, N) contiguous: the kernel may treat it as one flat row
  void* y;          // forward: y; backward: dg. (M, N) contiguous, dtype
  void* du;         // backward: du, (M, N) contiguous, dtype; nullptr in the forward
  float alpha;      // > 0; 1 for the plain SwiGLU
  float limit;      // > 0; +inf: no clamp
  float up_offset;  // 0 for the plain SwiGLU
};

// AdamW over a list of contiguous tensors, in place, float32 math; bfloat16 storage (parameter or
// states) written with stochastic rounding (titan_kernels/reference/fused_adamw.py: math and bits).
struct AdamWTensor {
  void* p;        // parameter: float32 or bfloat16
  const void* g;  // gradient: float32 or bfloat16
  void* m;        // exp_avg: float32 or bfloat16 (v has the same dtype)
  void* v;        // exp_avg_sq
  int64_t numel;
  int64_t offset;  // counter of element 0 in the random stream
  uint32_t key;    // the tensor's stream key
};

struct AdamWParams {
  DType p_dtype, g_dtype, s_dtype;  // Float or BFloat16 each
  const AdamWTensor* tensors;
  int64_t n_tensors;
  float omb1, beta2, omb2, eps;  // omb = one minus beta
  float decay, step_size, bc2_sqrt;
};

struct KernelTable {
  const char* name;
  void (*rms_norm_fwd)(const RmsNormFwdParams&);
  void (*rms_norm_bwd)(const RmsNormBwdParams&);
  // Rotates q and k in one parallel region (one pass over the tokens, cos/sin rows read once).
  void (*rotary)(const RotaryParams& q, const RotaryParams& k);
  void (*swiglu_fwd)(const SwigluParams&);
  void (*swiglu_bwd)(const SwigluParams&);
  void (*adamw)(const AdamWParams&);
};

// One table per instruction set built into this extension (see dispatch.cpp).
namespace DEFAULT { extern const KernelTable kTable; }
#ifdef TITAN_CPU_AVX2
namespace AVX2 { extern const KernelTable kTable; }
#endif
#ifdef TITAN_CPU_AVX512
namespace AVX512 { extern const KernelTable kTable; }
#endif

// The table for this machine: the best built ISA that the CPU supports and that ATen would use
// (ATEN_CPU_CAPABILITY caps it), unless set_capability() chose another.
const KernelTable& kernels();
// "default", "avx2", "avx512" or "auto"; throws c10::ValueError for an unknown or unsupported one.
void set_capability(const char* name);
const char* capability();

}  // namespace titan::cpu
