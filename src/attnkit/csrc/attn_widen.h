// Widening bf16 / fp16 to fp32: one number, one vector, one row; and the way back for the outputs (narrow_row). Included by attn_impl.h inside AK_NS (it uses
// that header's vector types), so every instruction-set build has its own copy. The forward and backward
// (attn_impl.h) widen each tile as they pack it and the decode entry (attn_decode.h) widens in registers: a
// bf16 / fp16 input is never converted whole.
//
// bf16: shift left 16 (exact); fp16: F16C in the AVX2 / AVX-512 builds, a portable bit conversion in the base
// build (exact: subnormals, inf and NaN included).

typedef uint16_t vh_u __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

// one bf16 / fp16 number to fp32 (the portable conversion; exact, subnormals, inf and NaN included)
static inline float bf16_to_f32(uint16_t h) {
  const uint32_t b = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

static inline float f16_to_f32(uint16_t h) {
  const uint32_t em = h & 0x7fffu, sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t b;
  if (em >= 0x7c00u) {
    b = (em << 13) | 0x7f800000u;  // inf, NaN (payload kept)
  } else {
    float f;
    const uint32_t m = em << 13;
    std::memcpy(&f, &m, 4);
    f *= 0x1p112f;  // exponent bias 15 -> 127; a subnormal half becomes the normal float it equals
    std::memcpy(&b, &f, 4);
  }
  b |= sign;
  float out;
  std::memcpy(&out, &b, 4);
  return out;
}

template <int DT>
static inline float ld1(const void* p, long i) {
  if constexpr (DT == AK_F32) return ((const float*)p)[i];
  else if constexpr (DT == AK_BF16) return bf16_to_f32(((const uint16_t*)p)[i]);
  else return f16_to_f32(((const uint16_t*)p)[i]);
}

// VW elements at p + i, widened to fp32
template <int DT>
static inline vf ld(const void* p, long i) {
  if constexpr (DT == AK_F32) {
    return load((const float*)p + i);
  } else if constexpr (DT == AK_BF16) {
    const vu w = __builtin_convertvector(*(const vh_u*)((const uint16_t*)p + i), vu);
    return (vf)(w << 16);
  } else {
#if AK_VW == 16 && AK_X86_INTRIN
    // the zero-masked form: GCC 12 warns about the plain one's undefined pass-through operand
    return (vf)_mm512_maskz_cvtph_ps((__mmask16)0xffff, _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i)));
#elif AK_VW == 8 && AK_X86_INTRIN
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i)));
#else
    const vu h = __builtin_convertvector(*(const vh_u*)((const uint16_t*)p + i), vu);
    const vu em = h & 0x7fffu, sign = (h & 0x8000u) << 16;
    const vf scaled = (vf)(em << 13) * splat(0x1p112f);
    const vi special = (vi)(em >= 0x7c00u);
    const vu bits = special ? ((em << 13) | 0x7f800000u) : (vu)scaled;
    return (vf)(bits | sign);
#endif
  }
}

// n elements of type dt at p + off (stride 1), widened into dst
static inline void widen_row(float* __restrict dst, const void* p, long off, long n, int dt) {
  long d = 0;
  if (dt == AK_F32) {
    std::memcpy(dst, (const float*)p + off, n * sizeof(float));
    return;
  }
  if (dt == AK_BF16) {
    for (; d + VW <= n; d += VW) store(dst + d, ld<AK_BF16>(p, off + d));
    for (; d < n; d++) dst[d] = ld1<AK_BF16>(p, off + d);
  } else {
    for (; d + VW <= n; d += VW) store(dst + d, ld<AK_F16>(p, off + d));
    for (; d < n; d++) dst[d] = ld1<AK_F16>(p, off + d);
  }
}

// element off of p (type dt), widened
static inline float widen1(const void* p, long off, int dt) {
  return dt == AK_F32 ? ((const float*)p)[off] : dt == AK_BF16 ? ld1<AK_BF16>(p, off) : ld1<AK_F16>(p, off);
}

// n elements of type dt at p + off, `step` elements apart (a row of dO at any last-dim stride: 0 for an expanded
// gradient), widened into dst
static inline void widen_strided(float* __restrict dst, const void* p, long off, long n, long step, int dt) {
  if (step == 1)
    widen_row(dst, p, off, n, dt);
  else
    for (long d = 0; d < n; d++) dst[d] = widen1(p, off + d * step, dt);
}

// ---- fp32 -> bf16 / fp16, rounded to nearest even (as torch's .to() rounds; the outputs of a low-precision call) ----

// bf16: the upper half of the fp32 bits after adding half an ulp (ties to even); a NaN becomes 0xffff, as torch's
// vectorised conversion writes it
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) return 0xffffu;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// fp16 (portable; the same bits as F16C's vcvtps2ph with round-to-nearest-even): NaN quietened, payload's top
// bits kept; overflow to inf; subnormals rounded to nearest even
static inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // >= 65520 rounds to 65536: inf
  if (ax >= 0x38800000u) {                                    // a normal half (>= 2^-14): rebias 127 -> 15
    const uint32_t r = ax - 0x38000000u;
    return (uint16_t)(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
  }
  float a;  // below 2^-14: a multiple of 2^-24 (a subnormal half; 1024 of them is the smallest normal)
  std::memcpy(&a, &ax, 4);
  volatile float t = a * 0x1p24f + 0x1p23f;  // exact scaling; the add rounds to an integer, ties to even
  return (uint16_t)(sign | (uint32_t)(t - 0x1p23f));
}

// n fp32 values at src into dst + off (elements of type dt: AK_BF16 / AK_F16; AK_F32: copied)
static inline void narrow_row(void* dst, long off, const float* __restrict src, long n, int dt) {
  long d = 0;
  if (dt == AK_F32) {
    std::memcpy((float*)dst + off, src, n * sizeof(float));
    return;
  }
  uint16_t* o = (uint16_t*)dst + off;
  if (dt == AK_BF16) {
    for (; d + VW <= n; d += VW) {
      const vf x = load(src + d);
      const vu u = (vu)x, nan = (vu)(x != x);
      const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      *(vh_u*)(o + d) = __builtin_convertvector((r & ~nan) | (nan & 0xffffu), vh_u);
    }
    for (; d < n; d++) o[d] = f32_to_bf16(src[d]);
    return;
  }
#if AK_VW == 16 && AK_X86_INTRIN
  for (; d + 16 <= n; d += 16)
    _mm256_storeu_si256((__m256i*)(o + d),  // (zero-masked: as ld's conversion, no pass-through warning)
                        _mm512_maskz_cvtps_ph((__mmask16)0xffff, _mm512_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
#elif AK_VW == 8 && AK_X86_INTRIN
  for (; d + 8 <= n; d += 8)
    _mm_storeu_si128((__m128i*)(o + d), _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; d < n; d++) o[d] = f32_to_f16(src[d]);
}

// n zeros of type dt at dst + off
static inline void zero_row(void* dst, long off, long n, int dt) {
  std::memset((char*)dst + off * (dt == AK_F32 ? 4 : 2), 0, n * (dt == AK_F32 ? 4 : 2));
}
