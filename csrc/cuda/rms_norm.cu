// RMSNorm forward (+ fused residual add) and backward for sm_90 / sm_80.
//
// Layout: TPR threads share a row. Narrow rows (<= 32 * kItems packs) use one warp per row and
// 8 rows per 256-thread block; wide rows use one block of 128 / 256 / 512 threads per row. In the
// forward each thread keeps up to kItems 16-byte packs of its row in registers, so x (or h) is read
// from HBM once; a row wider than TPR * kItems packs streams the rest and re-reads it from L2.
// The backward keeps float32 dweight sums in registers instead and reads dy and x a second time
// from L1/L2.
// Rows that are not 16-byte aligned (odd N, odd strides, offset views) take the same kernels with
// one element per pack.
//
// The backward is persistent: a grid of (SMs x resident blocks) strides over the rows; each thread
// accumulates dweight for its columns in float32 registers, each block writes one float32 row of
// partial sums, and a second kernel adds the rows up in a fixed order (deterministic, no atomics,
// never accumulated in bf16).
#include <algorithm>
#include <type_traits>

#include "common.cuh"

namespace titan::cuda {
namespace {

constexpr int kItems = 4;     // packs per thread kept in registers
constexpr int kWarpRows = 8;  // rows per block in the warp-per-row layout

template <int TPR>
__host__ __device__ constexpr int block_threads() { return TPR == 32 ? 32 * kWarpRows : TPR; }
template <int TPR>
__host__ __device__ constexpr int rows_per_block() { return TPR == 32 ? kWarpRows : 1; }
// Resident blocks asked of ptxas: at least 512 threads per SM, i.e. at most 128 registers a thread.
// Without a minimum, ptxas may trade a few spilled bytes for occupancy.
template <int TPR>
__host__ __device__ constexpr int min_blocks() { return block_threads<TPR>() >= 512 ? 1 : 512 / block_threads<TPR>(); }

// VEC weights at element offset off, as float32 (weight is float32 or the activation dtype T).
template <typename T, int VEC>
__device__ __forceinline__ void load_weight(const void* w, bool w_float, int64_t off, float (&f)[VEC]) {
  if (w_float) {
    load_floats<VEC>(static_cast<const float*>(w) + off, f);
  } else {
    to_float(load_pack<T, VEC>(static_cast<const T*>(w) + off), f);
  }
}

// The pack of the row to normalize at off: x, or h = x + r rounded to T (and written to h).
// Adds its squares to ss.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_input(const T* x, const T* r, T* h, int64_t off, float& ss) {
  Pack<T, VEC> p = load_pack<T, VEC>(x + off);
  float f[VEC];
  to_float(p, f);
  if (r != nullptr) {
    float g[VEC];
    to_float(load_pack<T, VEC>(r + off), g);
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] += g[j];
    p = from_float<T, VEC>(f);
    store_pack(h + off, p);
    to_float(p, f);  // normalize h as stored, as the unfused rms_norm(x + r) does
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) ss = fmaf(f[j], f[j], ss);
  return p;
}

template <typename T, int VEC>
__device__ __forceinline__ void store_normed(T* y, const Pack<T, VEC>& p, float rstd, const void* w, bool w_float,
                                             int64_t off) {
  float f[VEC];
  to_float(p, f);
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] *= rstd;
  if (w != nullptr) {
    float wf[VEC];
    load_weight<T, VEC>(w, w_float, off, wf);
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] *= wf[j];
  }
  store_pack(y + off, from_float<T, VEC>(f));
}

template <typename T, int VEC, int TPR>
__global__ void __launch_bounds__(block_threads<TPR>(), min_blocks<TPR>()) rms_norm_fwd_kernel(RmsNormFwdArgs a) {
  using P = Pack<T, VEC>;
  __shared__ float smem[32];
  const int lane = TPR == 32 ? threadIdx.x % 32 : threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block<TPR>() + (TPR == 32 ? threadIdx.x / 32 : 0);
  if (row >= a.M) return;  // uniform over a block when a block owns one row
  const int64_t N = a.N;
  const int64_t nvec = N / VEC;
  const T* x = static_cast<const T*>(a.x) + row * a.x_row_stride;
  const T* r = a.residual != nullptr ? static_cast<const T*>(a.residual) + row * a.residual_row_stride : nullptr;
  T* h = r != nullptr ? static_cast<T*>(a.h) + row * N : nullptr;
  T* y = static_cast<T*>(a.y) + row * N;
  const bool w_float = a.weight_dtype == DType::Float;

  P cache[kItems];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * TPR;
    if (i < nvec) cache[k] = load_input<T, VEC>(x, r, h, i * VEC, ss);
  }
  for (int64_t i = lane + static_cast<int64_t>(kItems) * TPR; i < nvec; i += TPR) load_input<T, VEC>(x, r, h, i * VEC, ss);
  ss = row_sum<TPR>(ss, smem);
  const float rstd = rsqrtf(ss / static_cast<float>(N) + a.eps);
  if (lane == 0) a.rstd[row] = rstd;
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * TPR;
    if (i < nvec) store_normed<T, VEC>(y, cache[k], rstd, a.weight, w_float, i * VEC);
  }
  const T* src = r != nullptr ? h : x;  // this thread wrote the h it re-reads here
  for (int64_t i = lane + static_cast<int64_t>(kItems) * TPR; i < nvec; i += TPR)
    store_normed<T, VEC>(y, load_pack<T, VEC>(src + i * VEC), rstd, a.weight, w_float, i * VEC);
}

// The backward's operands of one pack as float32: dy, x and (false without a weight) the weights.
template <typename T, int VEC>
__device__ __forceinline__ bool load_dy_x_w(const Pack<T, VEC>& dyp, const Pack<T, VEC>& xp, const void* w,
                                            bool w_float, int64_t off, float (&d)[VEC], float (&xf)[VEC],
                                            float (&wf)[VEC]) {
  to_float(dyp, d);
  to_float(xp, xf);
  if (w == nullptr) return false;
  load_weight<T, VEC>(w, w_float, off, wf);
  return true;
}

// sum over the pack of g * x, with g = dy * w
template <typename T, int VEC>
__device__ __forceinline__ float dot_gx(const Pack<T, VEC>& dyp, const Pack<T, VEC>& xp, const void* w, bool w_float,
                                        int64_t off) {
  float d[VEC], xf[VEC], wf[VEC];
  if (load_dy_x_w<T, VEC>(dyp, xp, w, w_float, off, d, xf, wf)) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) d[j] *= wf[j];
  }
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) s = fmaf(d[j], xf[j], s);
  return s;
}

// dx = (g - x * k2) * k1 (+ dres) for one pack; acc += dy * x * k1 (k1 = rstd) when dweight is wanted.
template <typename T, int VEC>
__device__ __forceinline__ void grad_pack(const Pack<T, VEC>& dyp, const Pack<T, VEC>& xp, const void* w, bool w_float,
                                          const T* dr, T* dx, int64_t off, float k1, float k2, bool want_dw,
                                          float (&acc)[VEC]) {
  float d[VEC], xf[VEC], wf[VEC], o[VEC];
  if (load_dy_x_w<T, VEC>(dyp, xp, w, w_float, off, d, xf, wf)) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] = (d[j] * wf[j] - xf[j] * k2) * k1;
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] = (d[j] - xf[j] * k2) * k1;
  }
  if (dr != nullptr) {
    float rf[VEC];
    to_float(load_pack<T, VEC>(dr + off), rf);
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] += rf[j];
  }
  store_pack(dx + off, from_float<T, VEC>(o));
  if (want_dw) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = fmaf(d[j], xf[j] * k1, acc[j]);
  }
}

template <typename T, int VEC, int TPR>
__global__ void __launch_bounds__(block_threads<TPR>(), min_blocks<TPR>()) rms_norm_bwd_kernel(RmsNormBwdArgs a, float* dw_partial) {
  constexpr int RPB = rows_per_block<TPR>();
  __shared__ float smem[32];
  extern __shared__ float dw_smem[];  // RPB x N floats, warp-per-row layout with dweight only
  const int lane = TPR == 32 ? threadIdx.x % 32 : threadIdx.x;
  const int sub = TPR == 32 ? threadIdx.x / 32 : 0;
  const int64_t N = a.N;
  const int64_t nvec = N / VEC;
  const bool w_float = a.weight_dtype == DType::Float;
  const bool want_dw = dw_partial != nullptr;
  float* dwp = want_dw ? dw_partial + static_cast<int64_t>(blockIdx.x) * N : nullptr;
  const float inv_n = 1.f / static_cast<float>(N);

  // dweight of this thread's first kItems packs of columns, in float32 registers. Columns past
  // them (block-per-row layout only) accumulate in this block's own partial row; each column
  // belongs to one thread, so plain read-modify-write is race free.
  float acc[kItems][VEC];
#pragma unroll
  for (int k = 0; k < kItems; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[k][j] = 0.f;
  if (want_dw)
    for (int64_t i = lane + static_cast<int64_t>(kItems) * TPR; i < nvec; i += TPR)
#pragma unroll
      for (int j = 0; j < VEC; ++j) dwp[i * VEC + j] = 0.f;

  for (int64_t row = static_cast<int64_t>(blockIdx.x) * RPB + sub; row < a.M;
       row += static_cast<int64_t>(gridDim.x) * RPB) {
    const T* dy = static_cast<const T*>(a.dy) + row * a.dy_row_stride;
    const T* x = static_cast<const T*>(a.x) + row * a.x_row_stride;
    const T* dr = a.dresidual != nullptr ? static_cast<const T*>(a.dresidual) + row * a.dresidual_row_stride : nullptr;
    T* dx = static_cast<T*>(a.dx) + row * N;
    const float rstd = a.rstd[row];
    // Pass 1: s = sum(g * x). Pass 2 reads dy and x again, from L1/L2: holding them in registers
    // as well as the float32 dweight sums would spill.
    float s = 0.f;
    for (int64_t i = lane; i < nvec; i += TPR)
      s += dot_gx<T, VEC>(load_pack<T, VEC>(dy + i * VEC), load_pack<T, VEC>(x + i * VEC), a.weight, w_float, i * VEC);
    s = row_sum<TPR>(s, smem);
    // mean(g * xhat) = rstd * s / N; dx = (g - xhat * mean) * rstd = (g - x * k2) * k1.
    const float k1 = rstd;
    const float k2 = rstd * (rstd * s * inv_n);
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t i = lane + static_cast<int64_t>(k) * TPR;
      if (i < nvec)
        grad_pack<T, VEC>(load_pack<T, VEC>(dy + i * VEC), load_pack<T, VEC>(x + i * VEC), a.weight, w_float, dr, dx,
                          i * VEC, k1, k2, want_dw, acc[k]);
    }
    for (int64_t i = lane + static_cast<int64_t>(kItems) * TPR; i < nvec; i += TPR) {
      float t[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) t[j] = want_dw ? dwp[i * VEC + j] : 0.f;
      grad_pack<T, VEC>(load_pack<T, VEC>(dy + i * VEC), load_pack<T, VEC>(x + i * VEC), a.weight, w_float, dr, dx,
                        i * VEC, k1, k2, want_dw, t);
      if (want_dw)
#pragma unroll
        for (int j = 0; j < VEC; ++j) dwp[i * VEC + j] = t[j];
    }
  }
  if (!want_dw) return;
  // The register sums go to the block's partial row, or first to this warp's row of shared memory
  // when the block's warps hold sums for the same columns (warp per row).
  float* out = TPR == 32 ? dw_smem + sub * N : dwp;
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t i = lane + static_cast<int64_t>(k) * TPR;
    if (i < nvec)
#pragma unroll
      for (int j = 0; j < VEC; ++j) out[i * VEC + j] = acc[k][j];
  }
  if constexpr (TPR == 32) {
    __syncthreads();
    for (int64_t c = threadIdx.x; c < N; c += blockDim.x) {
      float t = 0.f;
#pragma unroll
      for (int w = 0; w < RPB; ++w) t += dw_smem[w * N + c];
      dwp[c] = t;
    }
  }
}

// dweight[c] = sum over the G partial rows, in a fixed order.
template <typename W>
__global__ void __launch_bounds__(256) dw_reduce_kernel(const float* part, int64_t G, int64_t N, W* dw) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= N) return;
  float t = 0.f;
  for (int64_t g = 0; g < G; ++g) t += part[g * N + c];
  dw[c] = Cvt<W>::from(t);
}

// ------------------------------------------------------------------------------------------ host

struct Config {
  bool vec;  // 16-byte packs, else one element per pack
  int tpr;   // threads per row: 32 (warp per row), 128, 256 or 512 (block per row)
};

template <typename T>
constexpr int pack_elems() { return 16 / static_cast<int>(sizeof(T)); }

Config pick_config(int64_t N, int vec_elems, bool aligned) {
  Config c;
  c.vec = aligned && N % vec_elems == 0;
  const int64_t nvec = N / (c.vec ? vec_elems : 1);
  c.tpr = nvec <= 32 * kItems ? 32 : nvec <= 128 * kItems ? 128 : nvec <= 256 * kItems ? 256 : 512;
  return c;
}

// Calls f(T{}, std::integral_constant<int, VEC>{}, std::integral_constant<int, TPR>{}).
template <typename T, typename F>
void with_config(const Config& c, F&& f) {
  auto with_vec = [&](auto vec) {
    switch (c.tpr) {
      case 32: return f(T{}, vec, std::integral_constant<int, 32>{});
      case 128: return f(T{}, vec, std::integral_constant<int, 128>{});
      case 256: return f(T{}, vec, std::integral_constant<int, 256>{});
      default: return f(T{}, vec, std::integral_constant<int, 512>{});
    }
  };
  if (c.vec) {
    with_vec(std::integral_constant<int, pack_elems<T>()>{});
  } else {
    with_vec(std::integral_constant<int, 1>{});
  }
}

template <typename F>
void with_dtype(DType t, F&& f) {
  switch (t) {
    case DType::BFloat16: return f(__nv_bfloat16{});
    case DType::Half: return f(__half{});
    default: return f(float{});
  }
}

bool row_ok(const void* p, int64_t row_stride, int vec_elems) {
  return p == nullptr || (aligned16(p) && row_stride % vec_elems == 0);
}

bool weight_ok(const void* w, DType w_dtype, DType dtype) {
  return w == nullptr || w_dtype == DType::Float || w_dtype == dtype;
}

bool fwd_aligned(const RmsNormFwdArgs& a, int ve) {
  return row_ok(a.x, a.x_row_stride, ve) && row_ok(a.residual, a.residual_row_stride, ve) &&
         row_ok(a.y, a.N, ve) && row_ok(a.h, a.N, ve) && (a.weight == nullptr || aligned16(a.weight));
}

bool bwd_aligned(const RmsNormBwdArgs& a, int ve) {
  return row_ok(a.dy, a.dy_row_stride, ve) && row_ok(a.x, a.x_row_stride, ve) &&
         row_ok(a.dresidual, a.dresidual_row_stride, ve) && row_ok(a.dx, a.N, ve) &&
         (a.weight == nullptr || aligned16(a.weight));
}

struct BwdLaunch {
  Config cfg;
  int threads = 0;
  int grid = 0;
  size_t smem = 0;
  cudaError_t err = cudaSuccess;
};

BwdLaunch plan_bwd(const RmsNormBwdArgs& a) {
  BwdLaunch l;
  const bool want_dw = a.dweight != nullptr;
  with_dtype(a.dtype, [&](auto t) {
    using T = decltype(t);
    l.cfg = pick_config(a.N, pack_elems<T>(), bwd_aligned(a, pack_elems<T>()));
    with_config<T>(l.cfg, [&](auto, auto vec, auto tpr) {
      constexpr int TPR = decltype(tpr)::value;
      auto kernel = rms_norm_bwd_kernel<T, decltype(vec)::value, TPR>;
      l.threads = block_threads<TPR>();
      l.smem = (TPR == 32 && want_dw) ? sizeof(float) * rows_per_block<TPR>() * a.N : 0;
      int per_sm = 0;
      l.err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, l.threads, l.smem);
      const int64_t groups = (a.M + rows_per_block<TPR>() - 1) / rows_per_block<TPR>();
      const int64_t resident = static_cast<int64_t>(std::max(a.num_sms, 1)) * std::max(per_sm, 1);
      l.grid = static_cast<int>(std::max<int64_t>(1, std::min(groups, resident)));
    });
  });
  return l;
}

}  // namespace

cudaError_t rms_norm_fwd(const RmsNormFwdArgs& a, cudaStream_t stream) {
  if (a.M < 0 || a.N <= 0 || a.x == nullptr || a.y == nullptr || a.rstd == nullptr ||
      (a.residual != nullptr && a.h == nullptr) || !weight_ok(a.weight, a.weight_dtype, a.dtype))
    return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  with_dtype(a.dtype, [&](auto t) {
    using T = decltype(t);
    const Config cfg = pick_config(a.N, pack_elems<T>(), fwd_aligned(a, pack_elems<T>()));
    with_config<T>(cfg, [&](auto, auto vec, auto tpr) {
      constexpr int TPR = decltype(tpr)::value;
      const int64_t grid = (a.M + rows_per_block<TPR>() - 1) / rows_per_block<TPR>();
      rms_norm_fwd_kernel<T, decltype(vec)::value, TPR><<<grid, block_threads<TPR>(), 0, stream>>>(a);
    });
  });
  return cudaGetLastError();
}

int64_t rms_norm_bwd_workspace(const RmsNormBwdArgs& a) {
  if (a.dweight == nullptr || a.M <= 0 || a.N <= 0) return 0;
  const BwdLaunch l = plan_bwd(a);
  return l.err == cudaSuccess ? static_cast<int64_t>(l.grid) * a.N : 0;
}

cudaError_t rms_norm_bwd(const RmsNormBwdArgs& a, float* workspace, cudaStream_t stream) {
  if (a.M < 0 || a.N <= 0 || a.dy == nullptr || a.x == nullptr || a.rstd == nullptr || a.dx == nullptr ||
      (a.dweight != nullptr && (a.weight == nullptr || workspace == nullptr)) ||
      !weight_ok(a.weight, a.weight_dtype, a.dtype))
    return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  const BwdLaunch l = plan_bwd(a);
  if (l.err != cudaSuccess) return l.err;
  float* part = a.dweight != nullptr ? workspace : nullptr;
  with_dtype(a.dtype, [&](auto t) {
    using T = decltype(t);
    with_config<T>(l.cfg, [&](auto, auto vec, auto tpr) {
      auto kernel = rms_norm_bwd_kernel<T, decltype(vec)::value, decltype(tpr)::value>;
      if (l.smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, l.smem);
      kernel<<<l.grid, l.threads, l.smem, stream>>>(a, part);
    });
  });
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || part == nullptr) return err;
  const int64_t blocks = (a.N + 255) / 256;
  with_dtype(a.weight_dtype, [&](auto w) {
    using W = decltype(w);
    dw_reduce_kernel<W><<<blocks, 256, 0, stream>>>(part, l.grid, a.N, static_cast<W*>(a.dweight));
  });
  return cudaGetLastError();
}

}  // namespace titan::cuda
