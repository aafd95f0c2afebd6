// AdamW over a list of tensors with stochastic rounding to bfloat16: the CPU kernel of
// titan::fused_adamw_ (contract, math and random bits: titan_kernels/reference/fused_adamw.py).
//
// Included by kernels_impl.h inside namespace titan::cpu::CPU_CAPABILITY (it uses that file's Vec,
// Io, kStep and its includes), so it is compiled once per instruction set like the other kernels.
//
// Work split: every tensor is cut into chunks of kAdamWChunk elements; one at::parallel_for runs all
// chunks of all tensors, so a list of many small tensors keeps every thread busy. Each element is
// read once (g, p, m, v) and written once (p, m, v); the math is float32 in the reference's order
// (IEEE division and square root), so the float32 results equal the reference's bit for bit.

using IVec = at::vec::Vectorized<int32_t>;
constexpr int64_t kAdamWChunk = 16384;  // elements per task, a multiple of kStep

inline uint32_t hash32(uint32_t x) {  // lowbias32 (C. Wellons)
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// lowbias32 on int32 lanes: arithmetic shifts masked to logical ones, multiplications mod 2^32.
inline IVec hash32(IVec x) {
  const IVec s16(16), s15(15), m16(0xFFFF), m17(0x1FFFF);
  x = x ^ ((x >> s16) & m16);
  x = x * IVec(0x7feb352d);
  x = x ^ ((x >> s15) & m17);
  x = x * IVec(static_cast<int32_t>(0x846ca68bu));
  return x ^ ((x >> s16) & m16);
}

// The random words h(lo32(c) + h(key ^ hi32(c) ^ extra)) of counters c0 .. c0 + kStep - 1, as two
// int32 vectors (lanes 0..kF-1 and kF..2kF-1).
inline void random_words(uint32_t key, uint32_t extra, uint64_t c0, IVec& ra, IVec& rb) {
  const uint32_t lo = static_cast<uint32_t>(c0);
  const uint32_t hi = static_cast<uint32_t>(c0 >> 32);
  if (lo <= 0xFFFFFFFFu - static_cast<uint32_t>(kStep)) {
    static_assert(IVec::size() == kF, "int32 and float vectors must have the same lanes");
    alignas(64) int32_t lanes[kStep];
    for (int64_t i = 0; i < kStep; ++i) lanes[i] = static_cast<int32_t>(i);
    const IVec base(static_cast<int32_t>(lo + hash32(key ^ hi ^ extra)));
    ra = hash32(base + IVec::loadu(lanes));
    rb = hash32(base + IVec::loadu(lanes + kF));
    return;
  }
  // The block crosses a multiple of 2^32: per element (happens once per 4 G elements).
  alignas(64) int32_t w[kStep];
  for (int64_t i = 0; i < kStep; ++i) {
    const uint64_t c = c0 + static_cast<uint64_t>(i);
    const uint32_t k = hash32(key ^ static_cast<uint32_t>(c >> 32) ^ extra);
    w[i] = static_cast<int32_t>(hash32(static_cast<uint32_t>(c) + k));
  }
  ra = IVec::loadu(w);
  rb = IVec::loadu(w + kF);
}

// float32 -> bfloat16 bit pattern (as float32) rounded at random by the low 16 bits of r; NaN kept.
inline Vec round_bf16(const Vec& x, const IVec& r) {
  const IVec low(0xFFFF), high(static_cast<int32_t>(0xFFFF0000u));
  const IVec u = (at::vec::cast<int32_t>(x) + (r & low)) & high;
  return Vec::blendv(at::vec::cast<float>(u), x, x.isnan());
}

template <typename T>
inline void store_rounded(T* dst, int64_t n, const Vec& a, const Vec& b, const IVec& ra, const IVec& rb) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    Io<T>::store(dst, n, round_bf16(a, ra), round_bf16(b, rb));  // exact: the low halves are zero
  } else {
    Io<T>::store(dst, n, a, b);
  }
}

template <typename TP, typename TG, typename TS>
void adamw_span(const AdamWParams& q, const AdamWTensor& t, int64_t begin, int64_t end) {
  TP* P = static_cast<TP*>(t.p);
  const TG* G = static_cast<const TG*>(t.g);
  TS* M = static_cast<TS*>(t.m);
  TS* V = static_cast<TS*>(t.v);
  constexpr bool kBf16P = std::is_same_v<TP, c10::BFloat16>;
  constexpr bool kBf16S = std::is_same_v<TS, c10::BFloat16>;
  const Vec omb1(q.omb1), beta2(q.beta2), omb2(q.omb2), eps(q.eps);
  const Vec decay(q.decay), step_size(q.step_size), bc2(q.bc2_sqrt);
  const IVec s16(16), m16(0xFFFF);
  Vec g0, g1, p0, p1, m0, m1, v0, v1;
  IVec r1a(0), r1b(0), r2a(0), r2b(0);
  for (int64_t j = begin; j < end; j += kStep) {
    const int64_t n = std::min(kStep, end - j);
    Io<TG>::load(G + j, n, g0, g1);
    Io<TP>::load(P + j, n, p0, p1);
    Io<TS>::load(M + j, n, m0, m1);
    Io<TS>::load(V + j, n, v0, v1);
    p0 = p0 * decay;
    p1 = p1 * decay;
    m0 = m0 + omb1 * (g0 - m0);
    m1 = m1 + omb1 * (g1 - m1);
    v0 = v0 * beta2 + omb2 * g0 * g0;
    v1 = v1 * beta2 + omb2 * g1 * g1;
    p0 = p0 - step_size * (m0 / (v0.sqrt() / bc2 + eps));
    p1 = p1 - step_size * (m1 / (v1.sqrt() / bc2 + eps));
    if constexpr (kBf16P || kBf16S) {
      random_words(t.key, 0u, static_cast<uint64_t>(t.offset + j), r1a, r1b);
    }
    // The bf16 outputs of (p, m, v) in order take the words r1 low, r1 high, r2 low (one hash per
    // element for float32 parameters with bf16 states).
    store_rounded<TP>(P + j, n, p0, p1, r1a, r1b);
    if constexpr (kBf16S && kBf16P) {
      store_rounded<TS>(M + j, n, m0, m1, (r1a >> s16) & m16, (r1b >> s16) & m16);
      random_words(t.key, 0x5BD1E995u, static_cast<uint64_t>(t.offset + j), r2a, r2b);
      store_rounded<TS>(V + j, n, v0, v1, r2a, r2b);
    } else if constexpr (kBf16S) {
      store_rounded<TS>(M + j, n, m0, m1, r1a, r1b);
      store_rounded<TS>(V + j, n, v0, v1, (r1a >> s16) & m16, (r1b >> s16) & m16);
    } else {
      Io<TS>::store(M + j, n, m0, m1);
      Io<TS>::store(V + j, n, v0, v1);
    }
  }
}

using AdamWSpanFn = void (*)(const AdamWParams&, const AdamWTensor&, int64_t, int64_t);

template <typename TP, typename TG>
AdamWSpanFn adamw_fn_s(DType s) {
  return s == DType::BFloat16 ? &adamw_span<TP, TG, c10::BFloat16> : &adamw_span<TP, TG, float>;
}

template <typename TP>
AdamWSpanFn adamw_fn_g(DType g, DType s) {
  return g == DType::BFloat16 ? adamw_fn_s<TP, c10::BFloat16>(s) : adamw_fn_s<TP, float>(s);
}

void adamw(const AdamWParams& q) {
  const AdamWSpanFn fn = q.p_dtype == DType::BFloat16 ? adamw_fn_g<c10::BFloat16>(q.g_dtype, q.s_dtype)
                                                      : adamw_fn_g<float>(q.g_dtype, q.s_dtype);
  // Chunk c of the whole list: tensor first[c] ... found by a prefix sum over the tensors.
  std::vector<int64_t> first_chunk(q.n_tensors + 1, 0);
  for (int64_t i = 0; i < q.n_tensors; ++i) {
    first_chunk[i + 1] = first_chunk[i] + (q.tensors[i].numel + kAdamWChunk - 1) / kAdamWChunk;
  }
  const int64_t n_chunks = first_chunk[q.n_tensors];
  at::parallel_for(0, n_chunks, 1, [&](int64_t cb, int64_t ce) {
    int64_t i = std::upper_bound(first_chunk.begin(), first_chunk.end(), cb) - first_chunk.begin() - 1;
    for (int64_t c = cb; c < ce; ++c) {
      while (c >= first_chunk[i + 1]) ++i;
      const AdamWTensor& t = q.tensors[i];
      const int64_t begin = (c - first_chunk[i]) * kAdamWChunk;
      fn(q, t, begin, std::min(t.numel, begin + kAdamWChunk));
    }
  });
}
