// CPU kernels for RMSNorm (+ fused residual), rotary embedding, SwiGLU and AdamW (optim_impl.h),
// written once with ATen's at::vec::Vectorized types and compiled once per instruction set. The
// including file defines CPU_CAPABILITY (DEFAULT / AVX2 / AVX512), CPU_CAPABILITY_<ISA> and
// TITAN_CAPABILITY_NAME, and is compiled with the matching -m flags; everything here lives in
// namespace titan::cpu::CPU_CAPABILITY so the copies never collide.
//
// Math: RMSNorm, Zhang & Sennrich 2019 eq. 4 (titan_kernels/reference/rms_norm.py has the forward
// and backward formulas); rotary, Su et al. 2021 eq. 34 (titan_kernels/reference/rotary.py); SwiGLU,
// Shazeer 2020 eq. 5, and its clamped GPT-OSS variant (titan_kernels/reference/swiglu.py).
// All arithmetic is float32, whatever the storage dtype (float32, bfloat16, float16).
//
// Do not define static data that needs a dynamic initializer here: it would run instructions of
// this ISA when the library loads, on any machine (the same rule as ATen's cpu/ kernels).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace titan::cpu {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kF = Vec::size();
// Elements per step: two float vectors, i.e. one full vector of a 16-bit type.
constexpr int64_t kStep = 2 * kF;
// Work per parallel task, in elements: big enough that the OpenMP overhead (~ a few us) is small.
constexpr int64_t kGrainElems = 32768;

// Loads and stores of kStep elements as two float vectors; `n` < kStep handles a row's tail with
// masked loads (zero-filled) and stores.
template <typename T>
struct Io {  // bfloat16 and float16
  using VT = at::vec::Vectorized<T>;
  static_assert(VT::size() == kStep, "a 16-bit vector must hold two float vectors");

  static inline void load(const T* p, int64_t n, Vec& a, Vec& b) {
    if (n == kStep) {
      at::vec::load_to_float<T>(p, a, b);
    } else {
      std::tie(a, b) = at::vec::convert_to_float<T>(VT::loadu(p, n));
    }
  }
  static inline void store(T* p, int64_t n, const Vec& a, const Vec& b) {
    at::vec::convert_from_float<T>(a, b).store(p, n);
  }
  // Store and replace a, b by the values as stored (rounded to T), so later math sees exactly
  // what was written: the residual sum h is normalized as rounded, like unfused `rms_norm(x + r)`.
  static inline void store_rounded(T* p, int64_t n, Vec& a, Vec& b) {
    const VT v = at::vec::convert_from_float<T>(a, b);
    v.store(p, n);
    std::tie(a, b) = at::vec::convert_to_float<T>(v);
  }
};

template <>
struct Io<float> {
  static inline void load(const float* p, int64_t n, Vec& a, Vec& b) {
    if (n == kStep) {
      a = Vec::loadu(p);
      b = Vec::loadu(p + kF);
    } else {
      a = Vec::loadu(p, std::min(n, kF));
      b = n > kF ? Vec::loadu(p + kF, n - kF) : Vec(0.f);
    }
  }
  static inline void store(float* p, int64_t n, const Vec& a, const Vec& b) {
    if (n == kStep) {
      a.store(p);
      b.store(p + kF);
    } else {
      a.store(p, std::min(n, kF));
      if (n > kF) b.store(p + kF, n - kF);
    }
  }
  static inline void store_rounded(float* p, int64_t n, Vec& a, Vec& b) { store(p, n, a, b); }
};

inline float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// ------------------------------------------------------------------------------------------ RMSNorm

template <typename T>
void rms_norm_fwd_impl(const RmsNormFwdParams& p) {
  const int64_t N = p.N;
  const T* X = static_cast<const T*>(p.x.data);
  const T* R = static_cast<const T*>(p.r.data);
  T* Y = static_cast<T*>(p.y);
  T* H = static_cast<T*>(p.h);
  const float* W = p.w;
  const int64_t grain = std::max<int64_t>(1, kGrainElems / N);
  at::parallel_for(0, p.M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* x = X + p.x.rows.offset(m);
      T* y = Y + m * N;
      Vec acc0(0.f), acc1(0.f);
      Vec a, b, c, d;
      const T* src = x;  // the row that is normalized: x, or h = x + r
      if (R != nullptr) {
        const T* r = R + p.r.rows.offset(m);
        T* h = H + m * N;
        for (int64_t j = 0; j < N; j += kStep) {
          const int64_t n = std::min(kStep, N - j);
          Io<T>::load(x + j, n, a, b);
          Io<T>::load(r + j, n, c, d);
          a = a + c;
          b = b + d;
          Io<T>::store_rounded(h + j, n, a, b);
          acc0 = at::vec::fmadd(a, a, acc0);
          acc1 = at::vec::fmadd(b, b, acc1);
        }
        src = h;
      } else {
        for (int64_t j = 0; j < N; j += kStep) {
          const int64_t n = std::min(kStep, N - j);
          Io<T>::load(x + j, n, a, b);
          acc0 = at::vec::fmadd(a, a, acc0);
          acc1 = at::vec::fmadd(b, b, acc1);
        }
      }
      const float rstd = 1.f / std::sqrt(reduce_sum(acc0 + acc1) / static_cast<float>(N) + p.eps);
      p.rstd[m] = rstd;
      const Vec vr(rstd);
      // Second pass over the row (now in L1/L2): y = (x * rstd) * w, in the reference's order.
      for (int64_t j = 0; j < N; j += kStep) {
        const int64_t n = std::min(kStep, N - j);
        Io<T>::load(src + j, n, a, b);
        a = a * vr;
        b = b * vr;
        if (W != nullptr) {
          Io<float>::load(W + j, n, c, d);
          a = a * c;
          b = b * d;
        }
        Io<T>::store(y + j, n, a, b);
      }
    }
  });
}

template <typename T>
void rms_norm_bwd_impl(const RmsNormBwdParams& p) {
  const int64_t M = p.M;
  const int64_t N = p.N;
  const int64_t C = p.n_chunks;
  const T* DY = static_cast<const T*>(p.dy.data);
  const T* X = static_cast<const T*>(p.x.data);
  const T* DR = static_cast<const T*>(p.dres.data);
  T* DX = static_cast<T*>(p.dx);
  const float* W = p.w;
  const float inv_n = 1.f / static_cast<float>(N);
  // One task per chunk of rows; the chunk owns row c of dw_partial (float32, no atomics), so the
  // result does not depend on thread scheduling.
  at::parallel_for(0, C, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      float* dwp = p.dw_partial != nullptr ? p.dw_partial + ch * N : nullptr;
      if (dwp != nullptr) std::fill(dwp, dwp + N, 0.f);
      const int64_t m0 = M * ch / C;
      const int64_t m1 = M * (ch + 1) / C;
      for (int64_t m = m0; m < m1; ++m) {
        const T* dy = DY + p.dy.rows.offset(m);
        const T* x = X + p.x.rows.offset(m);
        T* dx = DX + m * N;
        const float rstd = p.rstd[m];
        Vec a, b, c, d, wa, wb;
        // Pass 1: s = sum(g * x) with g = dy * w.
        Vec s0(0.f), s1(0.f);
        for (int64_t j = 0; j < N; j += kStep) {
          const int64_t n = std::min(kStep, N - j);
          Io<T>::load(dy + j, n, a, b);
          Io<T>::load(x + j, n, c, d);
          if (W != nullptr) {
            Io<float>::load(W + j, n, wa, wb);
            a = a * wa;
            b = b * wb;
          }
          s0 = at::vec::fmadd(a, c, s0);
          s1 = at::vec::fmadd(b, d, s1);
        }
        // mean(g * xhat) = rstd * s / N; dx = (g - xhat * mean) * rstd = (g - x * k2) * rstd.
        const float mean_gxhat = rstd * reduce_sum(s0 + s1) * inv_n;
        const Vec k1(rstd), k2(rstd * mean_gxhat);
        const T* dr = DR != nullptr ? DR + p.dres.rows.offset(m) : nullptr;
        // Pass 2: dx, and dy * xhat into this chunk's float32 dweight row.
        for (int64_t j = 0; j < N; j += kStep) {
          const int64_t n = std::min(kStep, N - j);
          Io<T>::load(dy + j, n, a, b);
          Io<T>::load(x + j, n, c, d);
          Vec ga = a, gb = b;
          if (W != nullptr) {
            Io<float>::load(W + j, n, wa, wb);
            ga = a * wa;
            gb = b * wb;
          }
          Vec dxa = (ga - c * k2) * k1;
          Vec dxb = (gb - d * k2) * k1;
          if (dr != nullptr) {
            Vec ra, rb;
            Io<T>::load(dr + j, n, ra, rb);
            dxa = dxa + ra;
            dxb = dxb + rb;
          }
          Io<T>::store(dx + j, n, dxa, dxb);
          if (dwp != nullptr) {
            Vec pa, pb;
            Io<float>::load(dwp + j, n, pa, pb);
            pa = at::vec::fmadd(a, c * k1, pa);
            pb = at::vec::fmadd(b, d * k1, pb);
            Io<float>::store(dwp + j, n, pa, pb);
          }
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------ rotary

// Rotate every head of one token. c, s: the token's cos and sin rows (R floats each).
template <typename T>
inline void rotary_token(const RotaryParams& p, int64_t b, int64_t t, int64_t tok, const float* cs,
                         const float* sn) {
  const int64_t D = p.head_dim;
  const int64_t R = p.half;
  const T* xt = static_cast<const T*>(p.x) + b * p.x_stride_b + t * p.x_stride_s;
  T* ot = static_cast<T*>(p.out) + tok * p.n_heads * D;
  const Vec sign(p.backward ? -1.f : 1.f);
  for (int64_t hd = 0; hd < p.n_heads; ++hd) {
    const T* x = xt + hd * p.x_stride_h;
    T* o = ot + hd * D;
    if (p.interleaved) {
      // kF pairs (2 kF elements) per step: split even/odd lanes, rotate, interleave back.
      for (int64_t i = 0; i < R; i += kF) {
        const int64_t n = std::min(kF, R - i);
        Vec a, bb;
        Io<T>::load(x + 2 * i, 2 * n, a, bb);
        auto [x1, x2] = at::vec::deinterleave2(a, bb);
        const Vec cv = Vec::loadu(cs + i, n);
        const Vec sv = Vec::loadu(sn + i, n) * sign;
        const Vec y1 = x1 * cv - x2 * sv;
        const Vec y2 = x2 * cv + x1 * sv;
        auto [oa, ob] = at::vec::interleave2(y1, y2);
        Io<T>::store(o + 2 * i, 2 * n, oa, ob);
      }
    } else {
      // Rotate-half: x1 = x[i], x2 = x[i + R]; kStep pairs per step.
      for (int64_t i = 0; i < R; i += kStep) {
        const int64_t n = std::min(kStep, R - i);
        Vec x1a, x1b, x2a, x2b, ca, cb, sa, sb;
        Io<T>::load(x + i, n, x1a, x1b);
        Io<T>::load(x + R + i, n, x2a, x2b);
        Io<float>::load(cs + i, n, ca, cb);
        Io<float>::load(sn + i, n, sa, sb);
        sa = sa * sign;
        sb = sb * sign;
        Io<T>::store(o + i, n, x1a * ca - x2a * sa, x1b * cb - x2b * sb);
        Io<T>::store(o + R + i, n, x2a * ca + x1a * sa, x2b * cb + x1b * sb);
      }
    }
    if (2 * R < D) std::memcpy(o + 2 * R, x + 2 * R, (D - 2 * R) * sizeof(T));
  }
}

using RotaryTokenFn = void (*)(const RotaryParams&, int64_t, int64_t, int64_t, const float*, const float*);

inline RotaryTokenFn rotary_token_fn(DType dt) {
  switch (dt) {
    case DType::BFloat16: return &rotary_token<c10::BFloat16>;
    case DType::Half: return &rotary_token<c10::Half>;
    default: return &rotary_token<float>;
  }
}

void rotary(const RotaryParams& q, const RotaryParams& k) {
  const int64_t S = q.seq;
  const int64_t n_tokens = q.batch * S;
  const RotaryTokenFn fq = rotary_token_fn(q.dtype);
  const RotaryTokenFn fk = rotary_token_fn(k.dtype);
  const int64_t per_token = std::max<int64_t>(1, (q.n_heads + k.n_heads) * q.head_dim);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / per_token);
  at::parallel_for(0, n_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tok = begin; tok < end; ++tok) {
      const int64_t b = tok / S;
      const int64_t t = tok % S;
      const int64_t pos = q.pos != nullptr ? q.pos[b * q.pos_stride_b + t * q.pos_stride_s] : t;
      // A position outside the table is never read: its rotated dims become NaN.
      const bool valid = pos >= 0 && pos < q.max_positions;
      const float* cs = valid ? q.cos + pos * q.cs_stride : q.nan_row;
      const float* sn = valid ? q.sin + pos * q.cs_stride : q.nan_row;
      fq(q, b, t, tok, cs, sn);
      fk(k, b, t, tok, cs, sn);
    }
  });
}

// ------------------------------------------------------------------------------------------ SwiGLU

// sigmoid(g) = 1 / (1 + exp(-g)); exp is Sleef's 1-ulp expf on AVX2/AVX512, as in ATen's own silu.
inline Vec sigmoid(const Vec& g) {
  const Vec one(1.f);
  return one / (one + g.neg().exp());
}

// y = silu(g) * u over n contiguous elements.
template <typename T>
inline void swiglu_fwd_span(const T* g, const T* u, T* y, int64_t n) {
  Vec g0, g1, u0, u1;
  for (int64_t j = 0; j < n; j += kStep) {
    const int64_t k = std::min(kStep, n - j);
    Io<T>::load(g + j, k, g0, g1);
    Io<T>::load(u + j, k, u0, u1);
    Io<T>::store(y + j, k, g0 * sigmoid(g0) * u0, g1 * sigmoid(g1) * u1);
  }
}

// dg = dy * u * silu'(g), du = dy * silu(g) over n contiguous elements; silu'(g) = s (1 + g (1 - s)).
template <typename T>
inline void swiglu_bwd_span(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n) {
  const Vec one(1.f);
  Vec d0, d1, g0, g1, u0, u1;
  for (int64_t j = 0; j < n; j += kStep) {
    const int64_t k = std::min(kStep, n - j);
    Io<T>::load(dy + j, k, d0, d1);
    Io<T>::load(g + j, k, g0, g1);
    Io<T>::load(u + j, k, u0, u1);
    const Vec s0 = sigmoid(g0), s1 = sigmoid(g1);
    Io<T>::store(du + j, k, d0 * (g0 * s0), d1 * (g1 * s1));
    Io<T>::store(dg + j, k, d0 * u0 * (s0 * (one + g0 * (one - s0))), d1 * u1 * (s1 * (one + g1 * (one - s1))));
  }
}

// The clamped variant (GPT-OSS): g_c = min(g, L), u_c = clamp(u, -L, L), y = (u_c + c) * g_c * sigmoid(a g_c).
// ATen's clamp_max / clamp keep NaN on every ISA (torch.clamp); the gradient passes where g <= L and where
// -L <= u <= L, bounds included, and is 0 at NaN (torch.clamp's backward): a bitwise and with the
// comparison's mask (all bits or none), cheaper than a blend. L = +inf: no limit, no masks.
struct ClampedGlu {
  Vec alpha, lim, neg_lim, offset;
  Vec no_limit;  // every bit set without a limit (the masks then pass everything), else 0
  explicit ClampedGlu(const SwigluParams& p)
      : alpha(p.alpha), lim(p.limit), neg_lim(-p.limit), offset(p.up_offset),
        no_limit(std::isinf(p.limit) ? Vec(0.f) == Vec(0.f) : Vec(0.f)) {}

  inline Vec clamp_g(const Vec& g) const { return at::vec::clamp_max(g, lim); }
  inline Vec clamp_u(const Vec& u) const { return at::vec::clamp(u, neg_lim, lim); }
  inline Vec fwd(const Vec& g, const Vec& u) const {
    const Vec gc = clamp_g(g);
    return gc * sigmoid(alpha * gc) * (clamp_u(u) + offset);
  }
  // dg = dy (u_c + c) s (1 + a g_c (1 - s)) where g passes, du = dy g_c s where u passes; s = sigmoid(a g_c).
  inline void bwd(const Vec& d, const Vec& g, const Vec& u, Vec& dg, Vec& du) const {
    const Vec one(1.f);
    const Vec gc = clamp_g(g);
    const Vec s = sigmoid(alpha * gc);
    du = (d * (gc * s)) & (((u >= neg_lim) & (u <= lim)) | no_limit);
    dg = (d * (clamp_u(u) + offset) * (s * (one + alpha * gc * (one - s)))) & ((g <= lim) | no_limit);
  }
};

// The constants are copied into the span (c by value): the stores through y could alias a referenced
// ClampedGlu, which would make the compiler reload them every step.
template <typename T>
inline void clamped_fwd_span(const T* g, const T* u, T* y, int64_t n, const ClampedGlu c) {
  Vec g0, g1, u0, u1;
  for (int64_t j = 0; j < n; j += kStep) {
    const int64_t k = std::min(kStep, n - j);
    Io<T>::load(g + j, k, g0, g1);
    Io<T>::load(u + j, k, u0, u1);
    Io<T>::store(y + j, k, c.fwd(g0, u0), c.fwd(g1, u1));
  }
}

template <typename T>
inline void clamped_bwd_span(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n, const ClampedGlu c) {
  Vec d0, d1, g0, g1, u0, u1, dg0, dg1, du0, du1;
  for (int64_t j = 0; j < n; j += kStep) {
    const int64_t k = std::min(kStep, n - j);
    Io<T>::load(dy + j, k, d0, d1);
    Io<T>::load(g + j, k, g0, g1);
    Io<T>::load(u + j, k, u0, u1);
    c.bwd(d0, g0, u0, dg0, du0);
    c.bwd(d1, g1, u1, dg1, du1);
    Io<T>::store(du + j, k, du0, du1);
    Io<T>::store(dg + j, k, dg0, dg1);
  }
}

// The spans of the plain SwiGLU (its own code, unchanged: the same results as before the variant
// existed, but for the sign bit of a NaN) and of the clamped variant; swiglu_impl runs either over the rows.
template <typename T>
struct PlainSpans {
  explicit PlainSpans(const SwigluParams&) {}
  static inline void fwd(const T* g, const T* u, T* y, int64_t n) { swiglu_fwd_span<T>(g, u, y, n); }
  static inline void bwd(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n) {
    swiglu_bwd_span<T>(dy, g, u, dg, du, n);
  }
};

template <typename T>
struct ClampedSpans {
  const ClampedGlu c;
  explicit ClampedSpans(const SwigluParams& p) : c(p) {}
  inline void fwd(const T* g, const T* u, T* y, int64_t n) const { clamped_fwd_span<T>(g, u, y, n, c); }
  inline void bwd(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n) const {
    clamped_bwd_span<T>(dy, g, u, dg, du, n, c);
  }
};

template <typename T, typename Spans>
void swiglu_impl(const SwigluParams& p, bool backward) {
  const T* G = static_cast<const T*>(p.g.data);
  const T* U = static_cast<const T*>(p.u.data);
  const T* DY = static_cast<const T*>(p.dy.data);
  T* Y = static_cast<T*>(p.y);
  T* DU = static_cast<T*>(p.du);
  const int64_t N = p.N;
  const Spans spans(p);
  if (p.contiguous) {
    // One flat row: the work splits evenly whatever N is, and short rows pay no per-row tail.
    at::parallel_for(0, p.M * N, kGrainElems, [&](int64_t b, int64_t e) {
      if (backward) {
        spans.bwd(DY + b, G + b, U + b, Y + b, DU + b, e - b);
      } else {
        spans.fwd(G + b, U + b, Y + b, e - b);
      }
    });
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kGrainElems / N);
  at::parallel_for(0, p.M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* g = G + p.g.rows.offset(m);
      const T* u = U + p.u.rows.offset(m);
      if (backward) {
        spans.bwd(DY + p.dy.rows.offset(m), g, u, Y + m * N, DU + m * N, N);
      } else {
        spans.fwd(g, u, Y + m * N, N);
      }
    }
  });
}

template <typename T>
void swiglu_dispatch(const SwigluParams& p, bool backward) {
  const bool plain = p.alpha == 1.f && p.up_offset == 0.f && std::isinf(p.limit);
  plain ? swiglu_impl<T, PlainSpans<T>>(p, backward) : swiglu_impl<T, ClampedSpans<T>>(p, backward);
}

// AdamW (multi-tensor, stochastic rounding): its own file, in this ISA's namespace.
#include "optim_impl.h"

// ------------------------------------------------------------------------------------------ table

void rms_norm_fwd(const RmsNormFwdParams& p) {
  switch (p.dtype) {
    case DType::Float: return rms_norm_fwd_impl<float>(p);
    case DType::BFloat16: return rms_norm_fwd_impl<c10::BFloat16>(p);
    case DType::Half: return rms_norm_fwd_impl<c10::Half>(p);
  }
}

void rms_norm_bwd(const RmsNormBwdParams& p) {
  switch (p.dtype) {
    case DType::Float: return rms_norm_bwd_impl<float>(p);
    case DType::BFloat16: return rms_norm_bwd_impl<c10::BFloat16>(p);
    case DType::Half: return rms_norm_bwd_impl<c10::Half>(p);
  }
}

void swiglu_fwd(const SwigluParams& p) {
  switch (p.dtype) {
    case DType::Float: return swiglu_dispatch<float>(p, false);
    case DType::BFloat16: return swiglu_dispatch<c10::BFloat16>(p, false);
    case DType::Half: return swiglu_dispatch<c10::Half>(p, false);
  }
}

void swiglu_bwd(const SwigluParams& p) {
  switch (p.dtype) {
    case DType::Float: return swiglu_dispatch<float>(p, true);
    case DType::BFloat16: return swiglu_dispatch<c10::BFloat16>(p, true);
    case DType::Half: return swiglu_dispatch<c10::Half>(p, true);
  }
}

// Constant-initialized (addresses only): no code of this ISA runs at load time.
const KernelTable kTable = {TITAN_CAPABILITY_NAME, &rms_norm_fwd, &rms_norm_bwd, &rotary, &swiglu_fwd, &swiglu_bwd,
                           &adamw};

}  // namespace CPU_CAPABILITY
}  // namespace titan::cpu
