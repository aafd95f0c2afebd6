// Rotary embedding forward / backward for sm_90 / sm_80: q and k in one launch.
//
// Layout: one 128-thread block per token (batch x seq). The block's work items are, for every head
// of q and then of k, the rotation packs of that head followed by the copy packs of the dims past
// rotary_dim. A rotation pack is 16 bytes: VEC elements of x1 and VEC of x2 (rotate-half), or VEC
// interleaved elements = VEC / 2 pairs. The token's cos/sin row (float32) is read from L1/L2 by
// every head. Inputs that are not 16-byte aligned take a one-pair-per-item kernel.
#include <limits>

#include "common.cuh"

namespace titan::cuda {
namespace {

constexpr int kThreads = 128;

struct Token {
  int64_t tok, b, s;
  const float* cs;  // nullptr: position out of range, rotated dims become NaN
  const float* sn;
};

__device__ __forceinline__ Token token_of(const RotaryArgs& a) {
  Token t;
  t.tok = blockIdx.x;
  t.b = t.tok / a.seq;
  t.s = t.tok - t.b * a.seq;
  const int64_t pos = a.pos != nullptr ? a.pos[t.b * a.pos_stride_b + t.s * a.pos_stride_s] : t.s;
  const bool valid = pos >= 0 && pos < a.max_positions;  // a position outside the table is never read
  t.cs = valid ? a.cos + pos * a.cs_stride : nullptr;
  t.sn = valid ? a.sin + pos * a.cs_stride : nullptr;
  return t;
}

template <typename T>
struct Item {
  int64_t j;   // the item within its head
  const T* x;  // the head's input
  T* o;        // the head's output
};

// Work item `idx` of this token, `per_head` items per head (q heads first, then k heads).
template <typename T>
__device__ __forceinline__ Item<T> item_of(const RotaryArgs& a, const RotaryTensor& q, const RotaryTensor& k,
                                           const Token& t, int64_t idx, int64_t per_head) {
  const int64_t hh = idx / per_head;
  const bool is_q = hh < q.n_heads;
  const int64_t head = is_q ? hh : hh - q.n_heads;
  const int64_t nh = is_q ? q.n_heads : k.n_heads;
  const T* x = static_cast<const T*>(is_q ? q.x : k.x) + t.b * (is_q ? q.stride_b : k.stride_b) +
               t.s * (is_q ? q.stride_s : k.stride_s) + head * (is_q ? q.stride_h : k.stride_h);
  T* o = static_cast<T*>(is_q ? q.out : k.out) + (t.tok * nh + head) * a.head_dim;
  return {idx - hh * per_head, x, o};
}

template <int CNT>
__device__ __forceinline__ void load_cs(const Token& t, int64_t off, float sign, float (&c)[CNT], float (&s)[CNT]) {
  if (t.cs != nullptr) {
    load_floats<CNT>(t.cs + off, c);
    load_floats<CNT>(t.sn + off, s);
#pragma unroll
    for (int m = 0; m < CNT; ++m) s[m] *= sign;
  } else {
#pragma unroll
    for (int m = 0; m < CNT; ++m) c[m] = s[m] = __int_as_float(0x7fc00000);  // NaN
  }
}

template <typename T, int VEC, bool INTERLEAVED>
__global__ void __launch_bounds__(kThreads) rotary_vec_kernel(RotaryArgs a, RotaryTensor q, RotaryTensor k) {
  using P = Pack<T, VEC>;
  constexpr int PAIRS = INTERLEAVED ? VEC / 2 : VEC;  // pairs per rotation pack
  const Token t = token_of(a);
  const float sign = a.backward ? -1.f : 1.f;
  const int64_t R = a.half;
  const int64_t np = R / PAIRS;
  const int64_t per_head = np + (a.head_dim - 2 * R) / VEC;
  const int64_t total = (q.n_heads + k.n_heads) * per_head;
  for (int64_t idx = threadIdx.x; idx < total; idx += kThreads) {
    const auto [j, x, o] = item_of<T>(a, q, k, t, idx, per_head);
    if (j < np) {
      float c[PAIRS], s[PAIRS];
      load_cs<PAIRS>(t, j * PAIRS, sign, c, s);
      if constexpr (INTERLEAVED) {
        const int64_t off = j * VEC;
        float f[VEC];
        to_float(load_pack<T, VEC>(x + off), f);
#pragma unroll
        for (int m = 0; m < PAIRS; ++m) {
          const float x1 = f[2 * m], x2 = f[2 * m + 1];
          f[2 * m] = x1 * c[m] - x2 * s[m];
          f[2 * m + 1] = x2 * c[m] + x1 * s[m];
        }
        store_pack(o + off, from_float<T, VEC>(f));
      } else {
        const int64_t off = j * VEC;
        float f1[VEC], f2[VEC], y1[VEC], y2[VEC];
        to_float(load_pack<T, VEC>(x + off), f1);
        to_float(load_pack<T, VEC>(x + R + off), f2);
#pragma unroll
        for (int m = 0; m < VEC; ++m) {
          y1[m] = f1[m] * c[m] - f2[m] * s[m];
          y2[m] = f2[m] * c[m] + f1[m] * s[m];
        }
        store_pack(o + off, from_float<T, VEC>(y1));
        store_pack(o + R + off, from_float<T, VEC>(y2));
      }
    } else {
      const int64_t off = 2 * R + (j - np) * VEC;
      store_pack(o + off, load_pack<T, VEC>(x + off));
    }
  }
}

// Any alignment: one pair (or one copied element) per work item.
template <typename T>
__global__ void __launch_bounds__(kThreads) rotary_scalar_kernel(RotaryArgs a, RotaryTensor q, RotaryTensor k) {
  const Token t = token_of(a);
  const float sign = a.backward ? -1.f : 1.f;
  const int64_t R = a.half;
  const int64_t per_head = a.head_dim - R;  // R pairs + (head_dim - 2R) copies
  const int64_t total = (q.n_heads + k.n_heads) * per_head;
  for (int64_t idx = threadIdx.x; idx < total; idx += kThreads) {
    const auto [j, x, o] = item_of<T>(a, q, k, t, idx, per_head);
    if (j < R) {
      float c[1], s[1];
      load_cs<1>(t, j, sign, c, s);
      const int64_t d1 = a.interleaved ? 2 * j : j;
      const int64_t d2 = a.interleaved ? 2 * j + 1 : j + R;
      const float x1 = Cvt<T>::to(x[d1]), x2 = Cvt<T>::to(x[d2]);
      o[d1] = Cvt<T>::from(x1 * c[0] - x2 * s[0]);
      o[d2] = Cvt<T>::from(x2 * c[0] + x1 * s[0]);
    } else {
      const int64_t d = R + j;  // 2R + (j - R)
      o[d] = x[d];
    }
  }
}

template <typename T>
bool vec_ok(const RotaryArgs& a, const RotaryTensor& x) {
  constexpr int VEC = 16 / sizeof(T);
  if (x.n_heads == 0) return true;
  return aligned16(x.x) && aligned16(x.out) && x.stride_b % VEC == 0 && x.stride_s % VEC == 0 &&
         x.stride_h % VEC == 0;
}

template <typename T>
cudaError_t launch(const RotaryArgs& a, const RotaryTensor& q, const RotaryTensor& k, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t tokens = a.batch * a.seq;
  const bool shape_ok = a.head_dim % VEC == 0 && (a.interleaved ? (2 * a.half) % VEC == 0 : a.half % VEC == 0);
  const bool table_ok = a.half == 0 || (aligned16(a.cos) && aligned16(a.sin) && a.cs_stride % 4 == 0);
  if (shape_ok && table_ok && vec_ok<T>(a, q) && vec_ok<T>(a, k)) {
    if (a.interleaved) {
      rotary_vec_kernel<T, VEC, true><<<tokens, kThreads, 0, stream>>>(a, q, k);
    } else {
      rotary_vec_kernel<T, VEC, false><<<tokens, kThreads, 0, stream>>>(a, q, k);
    }
  } else {
    rotary_scalar_kernel<T><<<tokens, kThreads, 0, stream>>>(a, q, k);
  }
  return cudaGetLastError();
}

cudaError_t launch_dtype(DType dt, const RotaryArgs& a, const RotaryTensor& q, const RotaryTensor& k,
                         cudaStream_t stream) {
  switch (dt) {
    case DType::BFloat16: return launch<__nv_bfloat16>(a, q, k, stream);
    case DType::Half: return launch<__half>(a, q, k, stream);
    default: return launch<float>(a, q, k, stream);
  }
}

}  // namespace

cudaError_t rotary(const RotaryArgs& a, const RotaryTensor& q, const RotaryTensor& k, cudaStream_t stream) {
  if (a.batch < 0 || a.seq < 0 || a.head_dim < 0 || a.half < 0 || 2 * a.half > a.head_dim || q.n_heads < 0 ||
      k.n_heads < 0 || (a.half > 0 && (a.cos == nullptr || a.sin == nullptr)))
    return cudaErrorInvalidValue;
  const int64_t tokens = a.batch * a.seq;
  if (tokens == 0 || a.head_dim == 0 || q.n_heads + k.n_heads == 0) return cudaSuccess;
  if (tokens > std::numeric_limits<int>::max()) return cudaErrorInvalidValue;  // grid.x limit
  if (k.n_heads == 0 || q.dtype == k.dtype) return launch_dtype(q.dtype, a, q, k, stream);
  // Different dtypes: one launch per tensor.
  RotaryTensor none = k;
  none.n_heads = 0;
  const cudaError_t err = launch_dtype(q.dtype, a, q, none, stream);
  if (err != cudaSuccess) return err;
  RotaryTensor none_q = q;
  none_q.n_heads = 0;
  return launch_dtype(k.dtype, a, k, none_q, stream);
}

}  // namespace titan::cuda
