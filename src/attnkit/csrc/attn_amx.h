// The forward's and the backward's bf16 matrix products on AMX tiles (TDPBF16PS: a 16 x 16 fp32 tile += a 16 x 32
// bf16 tile times a 16 x 16 tile of bf16 pairs). Included by attn_impl.h inside AK_NS, in the AVX-512 build only
// (AK_BDOT 1; 0 elsewhere, or with a compiler too old for AMX); used where the CPU has AMX (and the OS grants its
// tile state) and the call is bf16 (Shape::bdot, set by attn_entry.h); a D that is not a multiple of 32 zero-padded to
// one in the scores' products (pack_q_pairs, pad_rows).
//
// What changes against the widening path, and what does not:
//   scores   S^T = K Q^T from the bf16 inputs themselves: each product is exact in fp32 (8-bit significands),
//            accumulated in fp32 (another order of fp32 roundings than the widening path's); K is read in place;
//   softmax  unchanged (fp32 scores, statistics, lse; masks, ALiBi and score_mod programs on the fp32 scores);
//   O += P V P rounded to bf16 (to nearest even) once per tile, fp32 accumulation; the row's sum l stays the fp32
//            sum of the unrounded P (lse is exact as before). The rounding of P is the one error this path adds:
//            at most 2^-9 of each weight, so at most 2^-9 · max|v| in an output (FlashAttention's bf16 kernels
//            and torch's CPU flash kernel round P the same way).
// The backward (where D % 16 == 0 and Dv % 16 == 0: dK's, dQ's and dV's columns; S's and dP's depths padded to 32):
// S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ = dS K on
// tiles, from bf16 rows of Q, dO (per pair of tiles) and K, V (per key tile), P and dS rounded to bf16 where they
// are multiplied; delta, the softmax and dS = P (dP - delta) stay fp32 (attn_impl.h's key_tile_item).
// Measured (Intel Xeon with AMX, one thread): a 64 x 64 x 64 tile product at ~1.8 TFLOP/s on tiles against
// ~150 GFLOP/s in fp32 FMAs; avx512_bf16's vector dot product (VDPBF16PS) ran at half fp32's rate there, so it
// is not used.
//
// Layouts (uint32 = two bf16, the first in the low half), per query block (BM = 64 queries) and key tile (BN = 64):
//   Q^T pairs  qtb[(d / 2) · BM + i] = (q[i][d], q[i][d + 1]),   zero in the padding columns i >= m
//   P pairs    pb[(j / 2) · BM + i]  = (P[i][j], P[i][j + 1]),   zero past n keys and past the mc live columns
//   V^T        vt[d · BN + j] = v[j][d],                         zero past n keys and past Dv
//   O^T        acc[d · BM + i] (fp32; the widening path keeps O, acc[i · Dvp + d])
//
//     S^T (64 keys x 64 queries)  =  K (keys x D, in place)  .  Q^T pairs (D/2 x 64)        16 tile products / 32 d
//     O^T (Dvp x 64 queries)     +=  V^T (Dvp x 64 keys)      .  P pairs (32 x 64)           4 per 16 rows of Dv
#if AK_VW == 16 && AK_X86_INTRIN && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define AK_BDOT 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,f16c,avx512bf16,amx-tile,amx-bf16")
// GCC 12's AVX-512 headers pass `_mm512_undefined_epi32()` (a self-initialised variable) to the unmasked forms of
// unpack, shift, shuffle and widen, and -Wall then reports it "used uninitialized" where they inline (GCC PR 105593,
// fixed in GCC 13); nothing of ours is uninitialised. Those two warnings only, only in this file.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Whether this process may use AMX tiles: the CPU has them and Linux grants the tile data state (asked once)
static bool amx_usable() {
  static const bool ok = [] {
    // CPUID leaf 7: subleaf 0 EDX bit 24 AMX-TILE, bit 22 AMX-BF16; subleaf 1 EAX bit 5 AVX512-BF16 (read here, not
    // by __builtin_cpu_supports: older compilers do not know these names)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 22 & 1)) return false;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a >> 5 & 1)) return false;
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// The tile configuration (palette 1): eight tiles of 16 rows x 64 bytes. Loaded by each thread for the span of one
// forward (TileScope), after saving the configuration it found (another library's — torch's bf16 kernels use AMX
// too — restored when the scope ends; none: the tiles are released)
struct alignas(64) TileCfg {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// (a constant: GCC does not count LDTILECFG as a read of its operand, and dropped the stores that filled a local
// configuration before it)
static const TileCfg TILE_CFG = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

struct TileScope {
  TileCfg saved;
  bool on;
  explicit TileScope(bool use) : on(use) {
    if (!on) return;
    _tile_storeconfig(&saved);
    __asm__ volatile("" : : "r"(&saved) : "memory");  // (written by STTILECFG: read it from memory)
    _tile_loadconfig(&TILE_CFG);
  }
  ~TileScope() {
    if (!on) return;
    if (saved.palette) _tile_loadconfig(&saved);
    else _tile_release();
  }
};

// A 16 x 16 block of 32-bit elements transposed in registers: r[t] row t in, column t out (4 rounds of
// unpacks and 128-bit lane shuffles, 64 instructions for what was 256 scalar moves)
static inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // lane k of u[i + c]: column 4k + c of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)  // t[h + 2c], t[h + 2c + 1]: columns (c, c + 8) and (c + 4, c + 12), rows h..h+7
    for (int c = 0; c < 4; c++) {
      t[h + 2 * c] = _mm512_shuffle_i32x4(u[h + c], u[h + 4 + c], 0x88);
      t[h + 2 * c + 1] = _mm512_shuffle_i32x4(u[h + c], u[h + 4 + c], 0xdd);
    }
  for (int p = 0; p < 8; p++) {
    const int col = (p >> 1) + 4 * (p & 1);
    r[col] = _mm512_shuffle_i32x4(t[p], t[p + 8], 0x88);
    r[col + 8] = _mm512_shuffle_i32x4(t[p], t[p + 8], 0xdd);
  }
}

// O (mc rows x Dvp, row stride Dvp) from the O^T the tiles accumulate (Dvp rows x BM, row stride BM), 16 x 16
// blocks transposed in registers (mc and Dvp multiples of 16). The row-by-row gather it replaced, a strided scalar
// load per element, was a tenth of a bf16 sliding-window forward's time on an Intel Xeon (perf, window 256,
// L = 4096: a block's output gathered once for its five tiles)
static void rows_of_ot(const float* ot, long Dvp, long mc, float* o) {
  for (long i0 = 0; i0 < mc; i0 += 16)
    for (long d0 = 0; d0 < Dvp; d0 += 16) {
      __m512i r[16];
      for (int t = 0; t < 16; t++) r[t] = _mm512_loadu_si512(ot + (d0 + t) * BM + i0);
      transpose16(r);
      for (int c = 0; c < 16; c++) _mm512_storeu_si512(o + (i0 + c) * Dvp + d0, r[c]);
    }
}

// The first `left` (<= 32 keeps all) of 32 bf16 lanes: a row's last 32 values loaded under it, zero past the row
static inline __mmask32 tail32(long left) {
  return left >= 32 ? ~(__mmask32)0 : left > 0 ? (__mmask32)((1u << left) - 1) : (__mmask32)0;
}

// 16 rows' values [d, d + 32) as 16 rows of pairs: dst[(d / 2 + c) * ld + t] = (rows[t][d + 2c], rows[t][d + 2c + 1]),
// zero past D and for t >= n (rows[t] not read) — 16 x 16 32-bit lanes transposed in registers
static inline void pairs16(uint32_t* dst, long ld, const uint16_t* const* rows, long n, long d, long D) {
  const __mmask32 m = tail32(D - d);
  __m512i r[16];
  for (int t = 0; t < 16; t++) r[t] = t < n ? _mm512_maskz_loadu_epi16(m, rows[t] + d) : _mm512_setzero_si512();
  transpose16(r);
  for (int c = 0; c < 16; c++) _mm512_storeu_si512(dst + (d / 2 + c) * ld, r[c]);
}

// Q^T pairs of a query block (m rows of D bf16 at src + off, row stride `stride`): round_up(D, 32) / 2 pair rows of
// BM, zero past D and in the columns i >= m (D not a multiple of 32: the depth the tiles multiply, zero-padded)
static void pack_q_pairs(uint32_t* dst, const void* src, long off, long stride, long m, long D) {
  const uint16_t* q = (const uint16_t*)src + off;
  for (long i0 = 0; i0 < BM; i0 += 16) {
    const uint16_t* rows[16];
    const long n = mx2<long>(0, mn<long>(16, m - i0));
    for (long t = 0; t < n; t++) rows[t] = q + (i0 + t) * stride;
    for (long d = 0; d < D; d += 32) pairs16(dst + i0, BM, rows, n, d, D);
  }
}

// n rows of D bf16 (row stride `stride`) into `total` rows of Dq (D rounded up to 32; zero past D and past n rows):
// a key tile the tiles cannot read in place (fewer keys than the tile, or D not a multiple of 32), a q row
static void pad_rows(uint16_t* dst, const uint16_t* k, long stride, long n, long total, long D) {
  const long Dq = (D + 31) / 32 * 32;
  for (long j = 0; j < total; j++)
    for (long d = 0; d < Dq; d += 32)
      _mm512_storeu_si512(dst + j * Dq + d, _mm512_maskz_loadu_epi16(tail32(j < n ? D - d : 0), k + j * stride + d));
}

// 16 bf16 halves (rounded from 16 fp32) widened to the low halves of 16 uint32 lanes
static inline __m512i halves_of(__m512 x) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)); }

// P pairs of a tile from its fp32 P^T (st: n rows of BM), every one of the BN / 2 pair rows and BM columns written
static void pack_p_pairs(uint32_t* dst, const float* st, long n, long mc) {
  const __m512i zero = _mm512_setzero_si512();
  for (long j = 0; j < BN; j += 2)
    for (long c = 0; c < BM; c += 16) {
      __m512i a = zero, b = zero;
      if (c < mc && j < n) a = halves_of(_mm512_loadu_ps(st + j * BM + c));
      if (c < mc && j + 1 < n) b = halves_of(_mm512_loadu_ps(st + (j + 1) * BM + c));
      _mm512_storeu_si512(dst + (j / 2) * BM + c, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
}

// 16 bf16 at p widened to the low halves of 16 uint32 lanes
static inline __m512i halves(const uint16_t* p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)); }

// V^T of a key tile (n rows of Dv bf16 at src + off, row stride `stride`) into Dvp rows of BN bf16, zero past n
// keys and past Dv. A full tile with Dv a multiple of 16 goes 32 keys x 16 values at a time: pairs of keys
// (2j, 2j + 1) side by side in 32-bit lanes, 16 x 16 of them transposed in registers
static void pack_v_t(uint16_t* dst, long Dvp, const void* src, long off, long stride, long n, long Dv) {
  const uint16_t* v = (const uint16_t*)src + off;
  if (n == BN && Dv % 16 == 0) {
    uint32_t* d32 = (uint32_t*)dst;  // row d: BN / 2 pairs of keys
    for (long j2 = 0; j2 < BN / 2; j2 += 16)
      for (long d0 = 0; d0 < Dv; d0 += 16) {
        __m512i r[16];
        for (int t = 0; t < 16; t++) {
          const uint16_t* row = v + 2 * (j2 + t) * stride + d0;
          r[t] = _mm512_or_si512(halves(row), _mm512_slli_epi32(halves(row + stride), 16));
        }
        transpose16(r);
        for (int c = 0; c < 16; c++) _mm512_storeu_si512(d32 + (d0 + c) * (BN / 2) + j2, r[c]);
      }
    if (Dvp > Dv) std::memset(dst + Dv * BN, 0, (Dvp - Dv) * BN * 2);
    return;
  }
  std::memset(dst, 0, Dvp * BN * 2);
  for (long j = 0; j < n; j++)
    for (long d = 0; d < Dv; d++) dst[d * BN + j] = v[j * stride + d];
}

// C (M x N fp32, row stride ldc) (+)= A (M x K bf16 rows, row stride lda elements) . B (K / 2 x N bf16 pairs,
// row stride ldb pairs): M, N multiples of 16, K a multiple of 32. Tiles 0-3: C (16 rows x up to 64 columns),
// 4: A, 5 and 6: B (tile numbers are immediates: one instantiation per column count)
template <int NB, bool ZERO>
static inline void amx_block(long K, const uint16_t* A, long lda, const uint32_t* B, long ldb, float* C, long ldc) {
  if (ZERO) {
    _tile_zero(0);
    if (NB > 1) {
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, C, ldc * 4);
    if (NB > 1) {
      _tile_loadd(1, C + 16, ldc * 4);
      _tile_loadd(2, C + 32, ldc * 4);
      _tile_loadd(3, C + 48, ldc * 4);
    }
  }
  for (long k = 0; k < K; k += 32) {
    _tile_loadd(4, A + k, lda * 2);
    const uint32_t* b = B + (k / 2) * ldb;
    _tile_loadd(5, b, ldb * 4);
    _tile_dpbf16ps(0, 4, 5);
    if (NB > 1) {
      _tile_loadd(6, b + 16, ldb * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, b + 32, ldb * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, b + 48, ldb * 4);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, C, ldc * 4);
  if (NB > 1) {
    _tile_stored(1, C + 16, ldc * 4);
    _tile_stored(2, C + 32, ldc * 4);
    _tile_stored(3, C + 48, ldc * 4);
  }
}

template <bool ZERO>
static void amx_gemm(long M, long N, long K, const uint16_t* A, long lda, const uint32_t* B, long ldb, float* C,
                     long ldc) {
  for (long i = 0; i < M; i += 16) {
    long j = 0;
    for (; j + 64 <= N; j += 64) amx_block<4, ZERO>(K, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc);
    for (; j < N; j += 16) amx_block<1, ZERO>(K, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc);
  }
}

// S^T (BN x BM) = K (BN rows of D bf16, row stride ldk) . Q^T pairs (D / 2 x BM)
static void scores_amx(const uint16_t* k, long ldk, const uint32_t* qtb, long D, float* st) {
  amx_gemm<true>(BN, BM, D, k, ldk, qtb, BM, st, BM);
}

// O^T (Dvp x BM) += V^T (Dvp x BN bf16) . P pairs (BN / 2 x BM)
static void pv_amx(const uint16_t* vt, long Dvp, const uint32_t* pb, float* acc) {
  amx_gemm<false>(Dvp, BM, BN, vt, BN, pb, BM, acc, BM);
}

// ---- the backward's operands (row layout: S = Q K^T, queries x keys) ----

// m rows of X bf16 (element stride sx along a row: 1, or e.g. 0 for an expanded gradient) into BM rows of Xp >= X
// (zero past X: a product's depth padded to a multiple of 32), zero past m
static void rows16(uint16_t* dst, long Xp, const void* src, long off, long stride, long sx, long m, long X) {
  const uint16_t* p = (const uint16_t*)src + off;
  for (long i = 0; i < BM; i++) {
    uint16_t* o = dst + i * Xp;
    if (i >= m) {
      std::memset(o, 0, Xp * 2);
      continue;
    }
    if (sx == 1) std::memcpy(o, p + i * stride, X * 2);
    else
      for (long d = 0; d < X; d++) o[d] = p[i * stride + d * sx];
    if (Xp > X) std::memset(o + X, 0, (Xp - X) * 2);
  }
}

// pairs of rows: dst[(i / 2) * X + d] = (r[i][d], r[i + 1][d]) from BM rows of X bf16 (row stride ldr, X % 16 == 0)
static void row_pairs(uint32_t* dst, const uint16_t* r, long ldr, long X) {
  for (long i = 0; i < BM; i += 2)
    for (long d = 0; d < X; d += 16)
      _mm512_storeu_si512(dst + (i / 2) * X + d, _mm512_or_si512(halves(r + i * ldr + d),
                                                                 _mm512_slli_epi32(halves(r + (i + 1) * ldr + d), 16)));
}

// the transpose of an fp32 tile (m rows of BN, row stride BN; zero past m) in bf16: dst (BN x BM), row j holding
// the BM queries' values at key j (rounded to nearest even) -- pairs of rows side by side, 16 x 16 transposed
static void t_bf16(uint16_t* dst, const float* src, long m) {
  uint32_t* d32 = (uint32_t*)dst;
  const __m512i zero = _mm512_setzero_si512();
  for (long i2 = 0; i2 < BM / 2; i2 += 16)
    for (long j0 = 0; j0 < BN; j0 += 16) {
      __m512i r[16];
      for (int t = 0; t < 16; t++) {
        const long i = 2 * (i2 + t);
        const __m512i a = i < m ? halves_of(_mm512_loadu_ps(src + i * BN + j0)) : zero;
        const __m512i b = i + 1 < m ? halves_of(_mm512_loadu_ps(src + (i + 1) * BN + j0)) : zero;
        r[t] = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
      }
      transpose16(r);
      for (int c = 0; c < 16; c++) _mm512_storeu_si512(d32 + (j0 + c) * (BM / 2) + i2, r[c]);
    }
}

// an fp32 tile (m rows of BN) in bf16 rows, zero past m
static void rows_bf16(uint16_t* dst, const float* src, long m) {
  for (long i = 0; i < BM; i++)
    for (long c = 0; c < BN; c += 16) {
      const __m256i h = i < m ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i * BN + c)) : _mm256_setzero_si256();
      _mm256_storeu_si256((__m256i*)(dst + i * BN + c), h);
    }
}

// A thread's bf16 operands for the backward on tiles: Q and dO rows (BM x D32, BM x Dv32: S's and dP's depths, D and
// Dv rounded up to 32, zero past them) and their pairs of rows, K rows and pairs of keys, K^T and V^T pairs along D
// and Dv (per key tile, D32 / 2 and Dv32 / 2 pair rows), P^T / dS^T and dS in bf16
struct AmxBwd {
  Buf<uint16_t> q16, do16, k16, pt, ds;
  Buf<uint32_t> qp, dop, ktp, vtp, kp;
  AmxBwd(bool on, long D, long Dv)
      : q16(on ? BM * round_up(D, 32) : 1), do16(on ? BM * round_up(Dv, 32) : 1), k16(on ? BN * D : 1),
        pt(on ? BN * BM : 1), ds(on ? BM * BN : 1), qp(on ? BM / 2 * D : 1), dop(on ? BM / 2 * Dv : 1),
        ktp(on ? round_up(D, 32) / 2 * BN : 1), vtp(on ? round_up(Dv, 32) / 2 * BN : 1), kp(on ? BN / 2 * D : 1) {}
};

#pragma GCC diagnostic pop
#pragma GCC pop_options
#else
#define AK_BDOT 0
struct AmxBwd {  // (no tiles in this build)
  AmxBwd(bool, long, long) {}
};
#endif
