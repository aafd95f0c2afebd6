// Standalone test of the titan CUDA kernels (no PyTorch): RMSNorm forward/backward with residual
// and weight, and rotary forward/backward in both layouts, for float32 and bfloat16, at awkward
// shapes (odd widths that take the unaligned kernels, strided rows, rows wider than the register
// cache, many rows for the persistent backward, out-of-range positions). Each result is compared
// with a float64 host reference by relative norm error: float32 1e-5, bfloat16 1e-2.
//
// Exit status: 0 all passed, 1 a check failed, 77 no usable CUDA device (ctest reports "skipped").
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../titan_cuda.h"

namespace {

using titan::cuda::DType;

int g_failures = 0;

#define CUDA_OK(expr)                                                                    \
  do {                                                                                   \
    const cudaError_t err_ = (expr);                                                     \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

// bfloat16 <-> float on the host, round to nearest even (as __float2bfloat16_rn).
uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float bf2f(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A host tensor stored as float32 or bfloat16 bytes, with its values as double after rounding.
struct HostBuf {
  DType dtype;
  std::vector<uint8_t> bytes;
  size_t size() const { return bytes.size() / (dtype == DType::Float ? 4 : 2); }
  double get(size_t i) const {
    if (dtype == DType::Float) {
      float f;
      std::memcpy(&f, bytes.data() + 4 * i, 4);
      return f;
    }
    uint16_t b;
    std::memcpy(&b, bytes.data() + 2 * i, 2);
    return bf2f(b);
  }
  void set(size_t i, double v) {
    if (dtype == DType::Float) {
      const float f = static_cast<float>(v);
      std::memcpy(bytes.data() + 4 * i, &f, 4);
    } else {
      const uint16_t b = f2bf(static_cast<float>(v));
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    }
  }
  HostBuf(DType t, size_t n) : dtype(t), bytes(n * (t == DType::Float ? 4 : 2)) {}
};

HostBuf random_buf(DType t, size_t n, std::mt19937& rng, double scale = 1.0) {
  std::normal_distribution<double> d(0.1, scale);
  HostBuf b(t, n);
  for (size_t i = 0; i < n; ++i) b.set(i, d(rng));
  return b;
}

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t n) : bytes(n) { CUDA_OK(cudaMalloc(&p, n ? n : 1)); }
  explicit DevBuf(const HostBuf& h) : DevBuf(h.bytes.size()) {
    CUDA_OK(cudaMemcpy(p, h.bytes.data(), h.bytes.size(), cudaMemcpyHostToDevice));
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  HostBuf to_host(DType t) const {
    HostBuf h(t, bytes / (t == DType::Float ? 4 : 2));
    CUDA_OK(cudaMemcpy(h.bytes.data(), p, h.bytes.size(), cudaMemcpyDeviceToHost));
    return h;
  }
};

void check(const std::string& what, const std::vector<double>& got, const std::vector<double>& want, double tol) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i]) != std::isnan(got[i])) {
      std::printf("FAIL %s: NaN mismatch at %zu\n", what.c_str(), i);
      ++g_failures;
      return;
    }
    if (std::isnan(want[i])) continue;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  const double err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  const bool ok = err <= tol;
  std::printf("%s %s: rel err %.3g (tol %.0e)\n", ok ? "ok  " : "FAIL", what.c_str(), err, tol);
  if (!ok) ++g_failures;
}

std::vector<double> values(const HostBuf& b, size_t n) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = b.get(i);
  return v;
}

// The fields the RMSNorm forward and backward arguments share: dtype, sizes and a weight of x's dtype.
template <typename Args>
Args rms_norm_args(DType t, int64_t M, int64_t N, const void* weight) {
  Args a;
  a.dtype = t;
  a.M = M;
  a.N = N;
  a.weight = weight;
  a.weight_dtype = t;
  return a;
}

double tol_of(DType t) { return t == DType::Float ? 1e-5 : 1e-2; }
const char* name_of(DType t) { return t == DType::Float ? "f32" : "bf16"; }

void test_rms_norm(DType t, int64_t M, int64_t N, int64_t pad, int num_sms, std::mt19937& rng) {
  const int64_t ld = N + pad;  // row stride of x, residual, dy
  const double eps = 1e-6;
  const HostBuf x = random_buf(t, M * ld, rng, 2.0), r = random_buf(t, M * ld, rng), dy = random_buf(t, M * ld, rng);
  const HostBuf dres = random_buf(t, M * ld, rng), w = random_buf(t, N, rng);
  // float64 reference; h is rounded to the storage dtype as the kernel stores it.
  HostBuf h(t, M * N);
  std::vector<double> y(M * N), dx(M * N), dw(N, 0.0), rstd(M);
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t n = 0; n < N; ++n) {
      h.set(m * N + n, x.get(m * ld + n) + r.get(m * ld + n));
      ss += h.get(m * N + n) * h.get(m * N + n);
    }
    rstd[m] = 1.0 / std::sqrt(ss / N + eps);
    double c = 0;
    for (int64_t n = 0; n < N; ++n) {
      const double xhat = h.get(m * N + n) * rstd[m];
      y[m * N + n] = xhat * w.get(n);
      c += dy.get(m * ld + n) * w.get(n) * xhat;
      dw[n] += dy.get(m * ld + n) * xhat;
    }
    c /= N;
    for (int64_t n = 0; n < N; ++n) {
      const double xhat = h.get(m * N + n) * rstd[m];
      dx[m * N + n] = (dy.get(m * ld + n) * w.get(n) - xhat * c) * rstd[m] + dres.get(m * ld + n);
    }
  }
  const int es = t == DType::Float ? 4 : 2;
  DevBuf dX(x), dR(r), dDY(dy), dDR(dres), dW(w), dY(M * N * es), dH(M * N * es), dRSTD(M * 4), dDX(M * N * es),
      dDW(N * es);
  auto fa = rms_norm_args<titan::cuda::RmsNormFwdArgs>(t, M, N, dW.p);
  fa.eps = static_cast<float>(eps);
  fa.x = dX.p;
  fa.x_row_stride = ld;
  fa.residual = dR.p;
  fa.residual_row_stride = ld;
  fa.y = dY.p;
  fa.h = dH.p;
  fa.rstd = static_cast<float*>(dRSTD.p);
  CUDA_OK(titan::cuda::rms_norm_fwd(fa, nullptr));
  auto ba = rms_norm_args<titan::cuda::RmsNormBwdArgs>(t, M, N, dW.p);
  ba.dy = dDY.p;
  ba.dy_row_stride = ld;
  ba.x = dH.p;
  ba.x_row_stride = N;
  ba.rstd = static_cast<const float*>(dRSTD.p);
  ba.dresidual = dDR.p;
  ba.dresidual_row_stride = ld;
  ba.dx = dDX.p;
  ba.dweight = dDW.p;
  ba.num_sms = num_sms;
  DevBuf ws(titan::cuda::rms_norm_bwd_workspace(ba) * 4);
  CUDA_OK(titan::cuda::rms_norm_bwd(ba, static_cast<float*>(ws.p), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::string tag = std::string("rms_norm ") + name_of(t) + " M=" + std::to_string(M) + " N=" +
                          std::to_string(N) + " pad=" + std::to_string(pad);
  check(tag + " y", values(dY.to_host(t), M * N), y, tol_of(t));
  check(tag + " h", values(dH.to_host(t), M * N), values(h, M * N), 1e-6);
  check(tag + " rstd", values(dRSTD.to_host(DType::Float), M), rstd, 1e-5);
  check(tag + " dx", values(dDX.to_host(t), M * N), dx, tol_of(t));
  check(tag + " dweight", values(dDW.to_host(t), N), dw, tol_of(t));
}

void test_rotary(DType t, int64_t B, int64_t S, int64_t Hq, int64_t Hk, int64_t D, int64_t R, bool interleaved,
                 bool backward, std::mt19937& rng) {
  const int64_t P = S + 3;
  const HostBuf q = random_buf(t, B * S * Hq * D, rng), k = random_buf(t, B * S * Hk * D, rng);
  std::vector<float> cs(P * R), sn(P * R);
  std::uniform_real_distribution<double> ang(0, 6.28);
  for (int64_t i = 0; i < P * R; ++i) {
    const double a = ang(rng);
    cs[i] = static_cast<float>(std::cos(a));
    sn[i] = static_cast<float>(std::sin(a));
  }
  std::vector<int64_t> pos(B * S);
  for (int64_t i = 0; i < B * S; ++i) pos[i] = (i * 7) % P;
  pos[1] = P + 5;  // out of range: rotated dims NaN
  const double sign = backward ? -1.0 : 1.0;
  auto reference = [&](const HostBuf& x, int64_t H) {
    std::vector<double> out(x.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        const int64_t p = pos[b * S + s];
        const bool valid = p >= 0 && p < P;
        for (int64_t hh = 0; hh < H; ++hh) {
          const int64_t base = ((b * S + s) * H + hh) * D;
          for (int64_t i = 0; i < R; ++i) {
            const int64_t d1 = interleaved ? 2 * i : i, d2 = interleaved ? 2 * i + 1 : i + R;
            const double c = valid ? cs[p * R + i] : NAN, sv = valid ? sign * sn[p * R + i] : NAN;
            out[base + d1] = x.get(base + d1) * c - x.get(base + d2) * sv;
            out[base + d2] = x.get(base + d2) * c + x.get(base + d1) * sv;
          }
          for (int64_t d = 2 * R; d < D; ++d) out[base + d] = x.get(base + d);
        }
      }
    return out;
  };
  DevBuf dQ(q), dK(k), dQO(q.bytes.size()), dKO(k.bytes.size()), dC(cs.size() * 4), dS(sn.size() * 4),
      dP(pos.size() * 8);
  CUDA_OK(cudaMemcpy(dC.p, cs.data(), cs.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dS.p, sn.data(), sn.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dP.p, pos.data(), pos.size() * 8, cudaMemcpyHostToDevice));
  titan::cuda::RotaryArgs a;
  a.batch = B;
  a.seq = S;
  a.head_dim = D;
  a.half = R;
  a.cos = static_cast<const float*>(dC.p);
  a.sin = static_cast<const float*>(dS.p);
  a.cs_stride = R;
  a.max_positions = P;
  a.pos = static_cast<const int64_t*>(dP.p);
  a.pos_stride_b = S;
  a.pos_stride_s = 1;
  a.interleaved = interleaved;
  a.backward = backward;
  auto tensor = [&](DevBuf& x, DevBuf& o, int64_t H) {
    titan::cuda::RotaryTensor rt;
    rt.dtype = t;
    rt.n_heads = H;
    rt.x = x.p;
    rt.stride_b = S * H * D;
    rt.stride_s = H * D;
    rt.stride_h = D;
    rt.out = o.p;
    return rt;
  };
  CUDA_OK(titan::cuda::rotary(a, tensor(dQ, dQO, Hq), tensor(dK, dKO, Hk), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::string tag = std::string("rotary ") + name_of(t) + (interleaved ? " interleaved" : " rotate-half") +
                          (backward ? " bwd" : " fwd") + " D=" + std::to_string(D) + " R=" + std::to_string(R);
  check(tag + " q", values(dQO.to_host(t), q.size()), reference(q, Hq), tol_of(t));
  check(tag + " k", values(dKO.to_host(t), k.size()), reference(k, Hk), tol_of(t));
}

}  // namespace

int main() {
  int n_dev = 0;
  const cudaError_t err = cudaGetDeviceCount(&n_dev);
  if (err != cudaSuccess || n_dev == 0) {
    std::printf("SKIP: no usable CUDA device (%s)\n", err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return 77;
  }
  int num_sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  std::mt19937 rng(0);
  for (DType t : {DType::Float, DType::BFloat16}) {
    test_rms_norm(t, 37, 4096, 0, num_sms, rng);    // block per row, 16-byte packs
    test_rms_norm(t, 301, 512, 8, num_sms, rng);    // warp per row, strided rows, persistent backward
    test_rms_norm(t, 5, 1000, 3, num_sms, rng);     // misaligned row stride: one element per pack
    test_rms_norm(t, 6, 7, 0, num_sms, rng);        // odd width
    test_rms_norm(t, 3, 40000, 0, num_sms, rng);    // wider than the register cache
    for (bool inter : {false, true})
      for (bool bwd : {false, true}) {
        test_rotary(t, 2, 33, 4, 2, 128, 64, inter, bwd, rng);  // Llama head_dim, MQA-style k
        test_rotary(t, 1, 9, 3, 1, 128, 32, inter, bwd, rng);   // partial rotary_dim
        test_rotary(t, 2, 5, 2, 3, 74, 29, inter, bwd, rng);    // odd sizes: one pair per item
      }
  }
  std::printf("%s (%d failures)\n", g_failures ? "FAILED" : "PASSED", g_failures);
  return g_failures ? 1 : 0;
}
