// Decode: a few query rows (L <= 64) against a long key/value cache, at the speed of reading the cache.
//
// Compiled once per instruction set, after attn_impl.h (its vector types, exp2v, scratch arenas), inside AK_NS.
//
// Work: the g = H / Hkv query heads of a kv head are packed as g * L rows ("a unit", at most 64 rows; more rows
// make more units) against that kv head's keys, so K and V are read once per group, not once per query head.
// The keys a unit may see (the union of its rows' intervals [lo, hi)) are cut into chunks of `chunk` keys
// (a multiple of 64, at absolute key offsets), and every (unit, chunk) pair is one work item: a long cache
// is spread over all threads even when B * Hkv is 1. Each item leaves its rows' partial softmax state
// (max m, sum l, unnormalised output acc) in a scratch array; the chunks of a row are then merged exactly
// (out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c, lse = M + log(...)) in chunk order. The chunk size
// depends on S only (never on the thread count), so the result is the same bits at any thread count.
//
// Per item, key tiles of 64: scores q . k by dot products (VW keys at a time, the VW partial sums reduced in
// registers; a bf16 call's by VDPBF16PS, or on AMX tiles for a unit of 2 to 16 rows: dots_bdot, dots_amx), scaled
// (then ALiBi's bias or a score_mod's program, as the forward), masked to each row's interval, online softmax per
// row, then acc += P V with V rows broadcast-free (P broadcast, V rows read in place; in a tile
// where some row does not see every key, each row multiplies only its own keys' values: a NaN / inf stored at a key
// a row does not see never reaches it, as the formula has it). In a call
// of at least STREAM_BYTES, a unit of up to FEW_ROWS rows reads each key's and value's row through in turn (memory
// order: the hardware prefetcher follows the stream, so reading overlaps the arithmetic; the register-blocked column
// order leaves it a stride it does not follow): the same sums in the same order either way, so the same bits. K and
// V are read in place at any batch / head / row strides (last dim contiguous); bf16 and fp16 caches are widened to
// fp32 per vector in registers (bf16: shift left 16; fp16: F16C in the AVX2 / AVX-512 builds, a portable bit
// conversion in the base build).
// A row may see a few stretches of keys (attention sinks and a window: nst of them, their union): a tile's lanes
// outside every stretch are masked, a tile no row's stretch meets skipped, in one pass over the keys (one online
// softmax, one read of K and V) whatever the stretch count.
// A row that sees no key: out 0, lse -inf. NaN in a row's scores gives NaN there (as in the forward).
#include <chrono>

#include "attn_common.h"

namespace AK_NS {

// lane c of the result: the sum of a[c]'s lanes
static inline vf reduce_lanes(const vf* a) {
#if AK_VW == 8 && AK_X86_INTRIN
  const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // lanes 0-3 of a[0..3], then 4-7; a[4..7]
  return (vf)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#elif AK_VW == 16 && AK_X86_INTRIN
  // four rounds of pairwise sums: (x, y) -> [x0+x1, x2+x3, ..., y0+y1, ...], the order of the a[c] kept
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512 x[16];
  for (int c = 0; c < 16; c++) x[c] = (__m512)a[c];
#pragma GCC unroll 4
  for (int n = 16; n > 1; n /= 2)
#pragma GCC unroll 8
    for (int i = 0; i < n / 2; i++)
      x[i] = _mm512_add_ps(_mm512_permutex2var_ps(x[2 * i], ev, x[2 * i + 1]),
                           _mm512_permutex2var_ps(x[2 * i], od, x[2 * i + 1]));
  return (vf)x[0];
#else
  vf r;
  for (int c = 0; c < VW; c++) r[c] = hsum(a[c]);
  return r;
#endif
}

// A call whose K and V hold at least STREAM_BYTES, in units of at most FEW_ROWS rows (one query row of MHA, a GQA
// group of up to 8 heads), may read K and V in memory order (dots_keys, pv_keys): the rule's order there is learned
// per call shape (ak_order_choice, attn_common.h: an Intel Xeon with AMX read it faster register-blocked, the AMD
// EPYC below in memory order; with learning off, memory order); smaller calls and more rows use the
// register-blocked dots_block / pv_block (fewer loads and stores per multiply-add: faster where K and V sit in
// cache, slower where they stream from memory) — but a bf16 / fp16 cache's scores at up to FEW_ROWS rows take
// dots_keys at any size (see dots). On a 2-core AMD EPYC (Zen 3), one query over 65 536 keys, MHA:
// 1.57-1.61 -> 1.22-1.28x the time of reading K and V once in fp32, 1.71-1.72 -> 1.26x in bf16; GQA 32 / 8 fp32 stays
// 1.65-2.3x, its arithmetic not overlapping the reading (benchmarks/decode_splitk.py; the seventeenth session's
// benchmarks/stream_overlap.cpp: the same reads and multiply-adds in plainer loops do overlap); the orders cross at
// K + V = 16 MiB of a call repeated on the same cache (below it the cache still holds them), and a model's decode
// step reads each layer's cache after every other layer's, from memory: 8 MiB. The same sums in the same order
// either way: the same bits.
constexpr long FEW_ROWS = 8;
constexpr long STREAM_BYTES = 8L << 20;

struct Dec {
  long B, H, Hkv, L, S, D, Dv, g;
  long sq[3], sk[3], sv[3];
  const int32_t* lo;
  const int32_t* hi;
  long lob;
  long nst, lst;  // stretches per row (>= 1) and the stride between their lo / hi planes
  float scale;
  int threads;
  long chunk;     // keys per chunk (a multiple of BN)
  long rb, nrb;   // rows per unit (<= BM) and units per (batch, kv head)
  bool stream;    // K and V read in memory order (units of <= FEW_ROWS rows of a call of >= STREAM_BYTES)
  bool bdot;      // bf16 scores by VDPBF16PS (dots_bdot): a bf16 call, the bf16 products on, avx512_bf16 here
  bool amx;       // and, where a unit has 2 to 16 rows and the CPU has AMX, on AMX tiles (dots_amx), either order
  const float* alibi;  // (H,) ALiBi slopes: score + slope[h] * (kv - q), or null
  const Prog* prog;    // a score_mod program run on the scaled scores (before the mask, as the forward), or null
  long Dp, Dvp;   // D, Dv rounded up to VW
  const void *q, *k, *v;
};

// per unit: the keys its rows may see [kmin, kmax), its first chunk, its chunk count and first item
struct Unit {
  int32_t kmin, kmax;
  int64_t c0, nc, item;
};

// rows [r0, r1) of unit (b, hk, rb); row r is query head hk * g + r / L, query row r % L
static inline void unit_rows(const Dec& s, long rb, long& r0, long& r1) {
  r0 = rb * s.rb, r1 = mn<long>(r0 + s.rb, s.g * s.L);
}

// scores sc[r * BN + j] = q_r . k_j of rows r < rows (fp32, qb, row stride ldq, zero beyond D) and keys j < n
// (K rows at kr, row stride ldk); lanes beyond n hold scores of key n - 1 (masked by the caller)
// The next tile's K and V rows (nk of them at pk / pv, row bytes kbytes / vbytes, strides in bytes) are prefetched
// into L2 one tile ahead, spread over the whole tile's work: its K rows while this tile is scored (VW rows per VW
// keys), its V rows while this tile's P.V runs (pv_block: each column block the same columns of the next tile's
// rows). Two streams the hardware prefetcher alone keeps too few lines in flight for; one burst of both (the
// first version) left the memory idle during the softmax and P.V.
struct Ahead {
  const char *pk, *pv;
  long nk, ldk, ldv, kbytes, vbytes;
};

static inline void prefetch_rows(const Ahead& a, long j0) {
  for (long j = j0; j < mn<long>(j0 + VW, a.nk); j++)
    for (long x = 0; x < a.kbytes; x += 64) __builtin_prefetch(a.pk + j * a.ldk + x, 0, 2);
}

// the next tile's V rows [j0, j1) (those it has), whole
static inline void prefetch_v(const Ahead& a, long j0, long j1) {
  for (long j = j0; j < mn<long>(j1, a.nk); j++)
    for (long x = 0; x < a.vbytes; x += 64) __builtin_prefetch(a.pv + j * a.ldv + x, 0, 2);
}

// the dot products of rows r < rows with the VW keys at kr + off[c] (lane c of the result)
template <int DT>
static inline void dots_block(long rows, long D, const float* qb, long ldq, const void* kr, const long* off,
                              float* sc) {
  const long Df = D / VW * VW;
  for (long r = 0; r < rows; r++) {
    const float* qr = qb + r * ldq;
    vf acc[VW];
#pragma GCC unroll 16
    for (int c = 0; c < VW; c++) acc[c] = splat(0.f);
    for (long d = 0; d < Df; d += VW) {
      const vf qv = load(qr + d);
#pragma GCC unroll 16
      for (int c = 0; c < VW; c++) acc[c] += qv * ld<DT>(kr, off[c] + d);
    }
    vf s = reduce_lanes(acc);
    for (long d = Df; d < D; d++)
      for (int c = 0; c < VW; c++) s[c] += qr[d] * ld1<DT>(kr, off[c] + d);
    store(sc + r * BN, s);
  }
}

// part[r][c + t] = the lanes of q_r . k_(c + t) (t < KP) for the RN rows at qb, K's rows at kc[t]
template <int RN, int KP, int DT>
static inline void dots_group(long Df, const float* qb, long ldq, const char* const* kc, vf (*part)[VW], int c) {
  vf a[RN][KP];
#pragma GCC unroll 8
  for (int r = 0; r < RN; r++)
#pragma GCC unroll 4
    for (int t = 0; t < KP; t++) a[r][t] = splat(0.f);
  for (long d = 0; d < Df; d += VW) {
    vf kv[KP];
#pragma GCC unroll 4
    for (int t = 0; t < KP; t++) kv[t] = ld<DT>(kc[t], d);
#pragma GCC unroll 8
    for (int r = 0; r < RN; r++) {
      const vf qv = load(qb + r * ldq + d);
#pragma GCC unroll 4
      for (int t = 0; t < KP; t++) a[r][t] += qv * kv[t];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RN; r++)
#pragma GCC unroll 4
    for (int t = 0; t < KP; t++) part[r][c + t] = a[r][t];
}

// The VW keys at kr + off[c] against R <= 8 rows, the keys' rows read through in turn, KP of them side by side
// (memory order: the hardware prefetcher follows it, and the next tile's rows stream in while this one is scored);
// per (row, key) the same sum in the same order as dots_block (lanes over d, then reduce_lanes). R rows against KP
// keys keep R * KP = 4 to 8 independent sums in registers: one sum per row for up to 4 rows, as first written, left
// each multiply-add waiting on the one before (one query row of MHA ran at a quarter of the FMA units' rate).
// On a 2-core AMD EPYC (Zen 3), K and V in L2 (benchmarks/decode_arith.cpp, resident), ns a key for 1 / 2 / 4 query
// rows: 24.5 / 30.8 / 55.8 -> 20.1 / 27.9 / 50.0.
template <int R, int DT>
static inline void dots_keys(long D, const float* qb, long ldq, const void* kr, const long* off, float* sc) {
  constexpr long esz = DT == AK_F32 ? 4 : 2;
  constexpr int KP = R <= 2 ? 4 : R <= 4 ? 2 : 1;
  const long Df = D / VW * VW;
  vf part[R][VW];
#pragma GCC unroll 16
  for (int c = 0; c < VW; c += KP) {
    const char* kc[KP];
#pragma GCC unroll 4
    for (int t = 0; t < KP; t++) kc[t] = (const char*)kr + off[c + t] * esz;
    dots_group<R, KP, DT>(Df, qb, ldq, kc, part, c);
  }
  for (int r = 0; r < R; r++) {
    vf s = reduce_lanes(part[r]);
    for (long d = Df; d < D; d++)
      for (int c = 0; c < VW; c++) s[c] += qb[r * ldq + d] * ld1<DT>(kr, off[c] + d);
    store(sc + r * BN, s);
  }
}

template <int DT>
static inline bool dots_few(long rows, long D, const float* qb, long ldq, const void* kr, const long* off,
                            float* sc) {
  switch (rows) {
    case 1: dots_keys<1, DT>(D, qb, ldq, kr, off, sc); return true;
    case 2: dots_keys<2, DT>(D, qb, ldq, kr, off, sc); return true;
    case 3: dots_keys<3, DT>(D, qb, ldq, kr, off, sc); return true;
    case 4: dots_keys<4, DT>(D, qb, ldq, kr, off, sc); return true;
    case 5: dots_keys<5, DT>(D, qb, ldq, kr, off, sc); return true;
    case 6: dots_keys<6, DT>(D, qb, ldq, kr, off, sc); return true;
    case 7: dots_keys<7, DT>(D, qb, ldq, kr, off, sc); return true;
    case 8: dots_keys<8, DT>(D, qb, ldq, kr, off, sc); return true;
    default: return false;
  }
}

#if AK_BDOT
// bf16 scores by avx512_bf16's VDPBF16PS (lane i of a 16-lane fp32 sum += q[2i] k[2i] + q[2i+1] k[2i+1], 32 values
// of d per instruction, no widening), where the CPU has it and the bf16 products are on (ak_set_bf16_dot): a bf16
// call's decode and few-rows backward. Against the widening order (dots_keys) it reads the same bytes, spends one
// instruction per 32 products where that spent two FMAs and a widening of the key shared by the rows, and sums in
// another order: each product is exact in fp32 (8-bit significands), the sums round in fp32 as before, in pairs;
// the instruction treats subnormal inputs as zero and flushes a subnormal sum (a product with a subnormal factor is
// below 2^-126 · |the other factor|: against a score's fp32 rounding, only where every other product is as small).
// The contract "bit for bit the fp32 kernel on the widened inputs" is the widening order's (bf16 products off).
// Measured (Intel Xeon with AMX, 2 threads; benchmarks/bf16_small.py, bf16 / fp32 through `auto`), a decode step
// over 128 keys, GQA 8 / 2, D = 64: see BENCHMARKS.md.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,f16c,avx512bf16")

// Whether the CPU has avx512_bf16 (CPUID leaf 7, subleaf 1, EAX bit 5; the AVX-512 build runs only where the OS keeps
// the vector state)
static bool bdot_cpu() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1);
  }();
  return ok;
}

// part[r][c + t] = the 16 lanes of q_r . k_(c + t) (t < KP): R rows of bf16 pairs at qh (row stride D2, zero past D),
// K's rows at kc[t] (D bf16 each; the last 32-block's tail loaded under a mask, zero)
template <int R, int KP>
static inline void bdot_group(long D, const uint16_t* qh, long D2, const uint16_t* const* kc, vf (*part)[VW],
                              int c) {
  __m512 a[R][KP];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int t = 0; t < KP; t++) a[r][t] = _mm512_setzero_ps();
  for (long d = 0; d < D; d += 32) {
    const __mmask32 m = D - d >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (D - d)) - 1);
    __m512bh kv[KP];
#pragma GCC unroll 4
    for (int t = 0; t < KP; t++) kv[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, kc[t] + d);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qh + r * D2 + d);
#pragma GCC unroll 4
      for (int t = 0; t < KP; t++) a[r][t] = _mm512_dpbf16_ps(a[r][t], qv, kv[t]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int t = 0; t < KP; t++) part[r][c + t] = (vf)a[r][t];
}

// the scores of R rows against the VW keys at k + off[c], into sc (row stride BN)
template <int R>
static inline void bdot_keys(long D, const uint16_t* qh, long D2, const uint16_t* k, const long* off, float* sc) {
  constexpr int KP = R <= 2 ? 4 : 2;
  vf part[R][VW];
#pragma GCC unroll 16
  for (int c = 0; c < VW; c += KP) {
    const uint16_t* kc[KP];
#pragma GCC unroll 4
    for (int t = 0; t < KP; t++) kc[t] = k + off[c + t];
    bdot_group<R, KP>(D, qh, D2, kc, part, c);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; r++) store(sc + r * BN, reduce_lanes(part[r]));
}

// The same scores register-blocked (as dots_block): per row, the VW keys' sums side by side over d, K's rows read
// from L1 once per row; no partial sums through memory (bdot_keys holds R x VW of them: more than the registers,
// spilled to the stack and read back for the reduction). The same sums in the same order per (row, key) as
// bdot_keys: the same bits. Where K and V sit in cache (below STREAM_BYTES); bdot_keys' memory order where they
// stream from memory.
static inline void bdot_block(long rows, long D, const uint16_t* qh, long D2, const uint16_t* k, const long* off,
                              float* sc) {
  const long Df = D / 32 * 32;
  const __mmask32 m = (__mmask32)((1u << (D - Df)) - 1);
  for (long r = 0; r < rows; r++) {
    const uint16_t* qr = qh + r * D2;
    __m512 a[VW];
#pragma GCC unroll 16
    for (int c = 0; c < VW; c++) a[c] = _mm512_setzero_ps();
    for (long d = 0; d < Df; d += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qr + d);
#pragma GCC unroll 16
      for (int c = 0; c < VW; c++) a[c] = _mm512_dpbf16_ps(a[c], qv, (__m512bh)_mm512_loadu_si512(k + off[c] + d));
    }
    if (Df < D) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qr + Df);
#pragma GCC unroll 16
      for (int c = 0; c < VW; c++)
        a[c] = _mm512_dpbf16_ps(a[c], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, k + off[c] + Df));
    }
    store(sc + r * BN, reduce_lanes((const vf*)a));
  }
}

constexpr long BDOT_Q = 8192;  // bf16 q values packed per tile call (64 rows of D = 128); more: the widening order



// sc[r * BN + j] = q_r . k_j as dots (rows r < rows, keys j < n; lanes past n: key n - 1) from bf16 K rows (stride
// ldk elements) and q rows: qpk (bf16, row stride round_up(D, 32), zero past D: packed once per call by the caller)
// or else qb (fp32 holding bf16 values, stride ldq, zero past D), packed back to bf16 (exact) here. false (nothing
// done): too many q values for the packing buffer
static bool dots_bdot(bool stream, long rows, long n, long D, const float* qb, long ldq, const uint16_t* qpk,
                      const uint16_t* k, long ldk, float* sc, const Ahead& ahead) {
  const long D2 = round_up(D, 32);
  if (rows * D2 > BDOT_Q) return false;
  alignas(64) uint16_t qbuf[BDOT_Q];  // (untouched when qpk is given)
  const uint16_t* qh = qpk ? qpk : qbuf;
  if (!qpk)
    for (long r = 0; r < rows; r++)
      for (long d = 0; d < D2; d += 32) {
        const float* q = qb + r * ldq + d;
        const __m512 lo = _mm512_loadu_ps(q);
        const __m512 hi = d + 16 < round_up(D, VW) ? _mm512_loadu_ps(q + 16) : _mm512_setzero_ps();
        _mm512_store_si512(qbuf + r * D2 + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
  for (long j0 = 0; j0 < n; j0 += VW) {
    prefetch_rows(ahead, j0);
    long off[VW];
    for (int c = 0; c < VW; c++) off[c] = mn<long>(j0 + c, n - 1) * ldk;
    if (!stream) {
      bdot_block(rows, D, qh, D2, k, off, sc + j0);
      continue;
    }
    long r = 0;
    for (; r + 4 <= rows; r += 4) bdot_keys<4>(D, qh + r * D2, D2, k, off, sc + r * BN + j0);
    switch (rows - r) {
      case 1: bdot_keys<1>(D, qh + r * D2, D2, k, off, sc + r * BN + j0); break;
      case 2: bdot_keys<2>(D, qh + r * D2, D2, k, off, sc + r * BN + j0); break;
      case 3: bdot_keys<3>(D, qh + r * D2, D2, k, off, sc + r * BN + j0); break;
      default: break;
    }
  }
  return true;
}
#pragma GCC pop_options
#endif

#if AK_BDOT
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,f16c,avx512bf16,amx-tile,amx-bf16")
// A unit's q rows (rows <= 16 of D bf16, each at q + roff[r]) as the B tile of S^T = K Q^T: pairs along d,
// qt[(d / 2) * 16 + r] = (q_r[d], q_r[d + 1]), D rounded up to 32, zero past D and past the rows (pairs16, as the
// forward's Q pairs)
static void amx_q_pairs(uint32_t* qt, const uint16_t* q, const long* roff, long rows, long D) {
  const uint16_t* r[16];
  for (long t = 0; t < rows; t++) r[t] = q + roff[t];
  for (long d = 0; d < D; d += 32) pairs16(qt, 16, r, rows, d, D);
}

// sc[r * BN + j] = q_r . k_j (rows <= 16, keys j < n; lanes past n hold the scores of zero keys: masked by the
// caller) on AMX tiles: per 16 keys, S^T (16 keys x 16 rows) = K (16 rows of D bf16, read in place where whole:
// 16 keys present and D % 32 == 0, else copied zero-padded into kpad) . the q pairs qt, fp32 sums of exact products
// as VDPBF16PS's (the tiles treat subnormal inputs as zero alike), then transposed into the rows' score lines (a
// GQA group's rows are one tile's columns: one tile product per 16 keys and 32 of d for all of them, where
// VDPBF16PS spends one instruction per row, key and 32 of d, at half the FMA's product rate on an Intel Xeon with
// AMX, benchmarks/bf16_dot_rate.c). The caller holds the tile configuration (TileScope).
static void dots_amx(long rows, long n, long D, const uint32_t* qt, const uint16_t* k, long ldk, float* sc,
                     uint16_t* kpad, float* cbuf) {
  const long D32 = round_up(D, 32);
  for (long kb = 0; kb < n; kb += 16) {
    const long nb = mn<long>(16, n - kb);
    const uint16_t* a = k + kb * ldk;
    long lda = ldk;
    if (nb < 16 || D32 != D) {
      pad_rows(kpad, a, ldk, nb, 16, D);
      a = kpad, lda = D32;
    }
    _tile_zero(0);
    for (long d = 0; d < D32; d += 32) {
      _tile_loadd(4, a + d, lda * 2);
      _tile_loadd(5, qt + (d / 2) * 16, 64);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, cbuf, 64);
    __m512i t[16];
    for (int j = 0; j < 16; j++) t[j] = _mm512_loadu_si512(cbuf + j * 16);
    transpose16(t);
    for (long r = 0; r < rows; r++) _mm512_storeu_si512(sc + r * BN + kb, t[r]);
  }
}
#pragma GCC pop_options
#endif

// Whether a call of dtype dt takes dots_bdot
static inline bool bdot_on(int dt) {
#if AK_BDOT
  return dt == AK_BF16 && ak_bf16_dot != 0 && bdot_cpu();
#else
  (void)dt;
  return false;
#endif
}

// kbuf: VW x Dp floats, for widening a bf16 / fp16 block of VW keys once when more than FEW_ROWS rows read it. A
// bf16 / fp16 key block read by 2 to FEW_ROWS rows takes the memory-order dot products in any call (dots_keys: each
// key vector widened once in a register and multiplied into every row there) rather than widened into kbuf and read
// back (a store and a load more per vector; one row read it widened in registers already): on a 2-core AMD EPYC
// (Zen 3, AVX2), decode of one query over 8 heads / 2 kv heads, D = 64, bf16 against fp32 through `auto`
// (`benchmarks/bf16_small.py --only decode`, BENCHMARKS.md) 1.08, 1.08 -> 1.04, 1.00 at 128 keys, 1.12, 1.21 ->
// 1.03, 1.03 at 2048. fp32 keeps the register-blocked order below STREAM_BYTES (nothing to widen).
// The same sums in the same order either way: the same bits.
// (qpk: with bdot, q's rows as bf16 already packed for dots_bdot, or null)
template <int DT>
static void dots(bool stream, long rows, long n, long D, const float* qb, long ldq, const void* kr, long ldk,
                 float* sc, const Ahead& ahead, float* kbuf, long Dp, bool bdot, const uint16_t* qpk = nullptr) {
#if AK_BDOT
  if (DT == AK_BF16 && bdot && dots_bdot(stream, rows, n, D, qb, ldq, qpk, (const uint16_t*)kr, ldk, sc, ahead))
    return;
#else
  (void)bdot, (void)qpk;
#endif
  for (long j0 = 0; j0 < n; j0 += VW) {
    prefetch_rows(ahead, j0);
    long off[VW];
    for (int c = 0; c < VW; c++) off[c] = mn<long>(j0 + c, n - 1) * ldk;
    if ((stream || DT != AK_F32) && dots_few<DT>(rows, D, qb, ldq, kr, off, sc + j0)) continue;
    if (DT != AK_F32 && rows > 1) {  // widen the VW keys once, then every row reads fp32
      const long Df = D / VW * VW;
      long boff[VW];
      for (int c = 0; c < VW; c++) {
        float* dst = kbuf + c * Dp;
        for (long d = 0; d < Df; d += VW) store(dst + d, ld<DT>(kr, off[c] + d));
        for (long d = Df; d < D; d++) dst[d] = ld1<DT>(kr, off[c] + d);
        boff[c] = c * Dp;
      }
      dots_block<AK_F32>(rows, D, qb, ldq, kbuf, boff, sc + j0);
    } else {
      dots_block<DT>(rows, D, qb, ldq, kr, off, sc + j0);
    }
  }
}

// acc (RR rows x NV vectors, row stride lda) += P (RR rows, stride BN; n keys) . V (n rows at vr, stride ldv);
// with `ahead`, the same columns of the next tile's V rows are prefetched, one row per key: the next tile's V
// streams in while this one is multiplied (its K is prefetched while this tile's keys are scored)
// key(j) for the n keys of a P.V block, j ascending; keys [0, min(n, ahead->nk)) first prefetch their twin row in the
// next tile (`span` bytes from column `col`, elements of `esz` bytes), the rest do not (the test out of the key
// loop: it cost as many instructions as the multiply-adds' broadcasts in a small call)
template <long esz, long span, class Key>
static inline void pv_keys_ahead(long n, long col, const Ahead* ahead, Key&& key) {
  const long np = ahead ? mn<long>(n, ahead->nk) : 0;
  const char* pf = ahead ? ahead->pv + col * esz : nullptr;
  const long pld = ahead ? ahead->ldv : 0;
  long j = 0;
  for (; j < np; j++) {
#pragma GCC unroll 4
    for (long x = 0; x < span; x += 64) __builtin_prefetch(pf + j * pld + x, 0, 2);
    key(j);
  }
  for (; j < n; j++) key(j);
}

// Lane indices of two vectors (x, y) taken as one of 2 VW: their even lanes, their odd lanes; and back (the first
// VW / the last VW lanes of the interleave of e and o)
static inline vi lanes_even() { vi r; for (int i = 0; i < VW; i++) r[i] = 2 * i; return r; }
static inline vi lanes_odd() { vi r; for (int i = 0; i < VW; i++) r[i] = 2 * i + 1; return r; }
static inline vi lanes_lo() { vi r; for (int i = 0; i < VW; i++) r[i] = (i % 2 ? VW : 0) + i / 2; return r; }
static inline vi lanes_hi() { vi r; for (int i = 0; i < VW; i++) r[i] = (i % 2 ? VW : 0) + VW / 2 + i / 2; return r; }

typedef uint32_t vu_u __attribute__((vector_size(VW * 4), aligned(2)));

// pv_block of a bf16 V, NV even: each 2 VW columns of a key's row are one load, as VW pairs; x << 16 widens the
// even columns, x & 0xffff0000 the odd ones (two plain integer ops, no widening shuffle: bf16's cost over fp32's in
// this loop, 1.5x its instructions, is what a small bf16 decode step paid). The accumulators are held split into
// even and odd columns through the key loop and interleaved back at the end: per (row, column) the same sums in the
// same order as the plain loop (the same bits)
template <int RR, int NV>
static inline void pv_block_bf16_pairs(long n, const float* P, const void* vr, long ldv, long col, float* acc,
                                       long lda, const Ahead* ahead) {
  constexpr int NP = NV / 2;
  const vi ev = lanes_even(), od = lanes_odd(), lo = lanes_lo(), hi = lanes_hi();
  vf e[RR][NP], o[RR][NP];
#pragma GCC unroll 4
  for (int r = 0; r < RR; r++)
#pragma GCC unroll 4
    for (int c = 0; c < NP; c++) {
      const vf x = load(acc + r * lda + col + 2 * c * VW), y = load(acc + r * lda + col + (2 * c + 1) * VW);
      e[r][c] = __builtin_shuffle(x, y, ev);
      o[r][c] = __builtin_shuffle(x, y, od);
    }
  const uint16_t* v16 = (const uint16_t*)vr + col;
  const vu himask = (uint32_t)0xffff0000u - (vu){};
  auto key = [&](long j) {
    vf be[NP], bo[NP];
#pragma GCC unroll 4
    for (int c = 0; c < NP; c++) {
      const vu w = *(const vu_u*)(v16 + j * ldv + 2 * c * VW);
      be[c] = (vf)(w << 16), bo[c] = (vf)(w & himask);
    }
#pragma GCC unroll 4
    for (int r = 0; r < RR; r++) {
      const vf p = splat(P[r * BN + j]);
#pragma GCC unroll 4
      for (int c = 0; c < NP; c++) e[r][c] += p * be[c], o[r][c] += p * bo[c];
    }
  };
  pv_keys_ahead<2, NV * VW * 2>(n, col, ahead, key);
#pragma GCC unroll 4
  for (int r = 0; r < RR; r++)
#pragma GCC unroll 4
    for (int c = 0; c < NP; c++) {
      store(acc + r * lda + col + 2 * c * VW, __builtin_shuffle(e[r][c], o[r][c], lo));
      store(acc + r * lda + col + (2 * c + 1) * VW, __builtin_shuffle(e[r][c], o[r][c], hi));
    }
}

template <int RR, int NV, int DT>
static inline void pv_block(long n, const float* P, const void* vr, long ldv, long col, float* acc, long lda,
                            const Ahead* ahead) {
  if constexpr (DT == AK_BF16 && NV % 2 == 0) {
    pv_block_bf16_pairs<RR, NV>(n, P, vr, ldv, col, acc, lda, ahead);
    return;
  }
  vf a[RR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < RR; r++)
#pragma GCC unroll 4
    for (int c = 0; c < NV; c++) a[r][c] = load(acc + r * lda + col + c * VW);
  constexpr long esz = DT == AK_F32 ? 4 : 2;
  auto key = [&](long j) {
    vf b[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; c++) b[c] = ld<DT>(vr, j * ldv + col + c * VW);
#pragma GCC unroll 4
    for (int r = 0; r < RR; r++) {
      const vf p = splat(P[r * BN + j]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; c++) a[r][c] += p * b[c];
    }
  };
  pv_keys_ahead<esz, NV * VW * esz>(n, col, ahead, key);
#pragma GCC unroll 4
  for (int r = 0; r < RR; r++)
#pragma GCC unroll 4
    for (int c = 0; c < NV; c++) store(acc + r * lda + col + c * VW, a[r][c]);
}

template <int RR, int DT>
static inline void pv_rows(long n, long N, const float* P, const void* vr, long ldv, float* acc, long lda,
                           const Ahead* ahead) {
  constexpr int NV = RR >= 4 ? 2 : 4;
  long col = 0;
  for (; col + NV * VW <= N; col += NV * VW) pv_block<RR, NV, DT>(n, P, vr, ldv, col, acc, lda, ahead);
  for (; col < N; col += VW) pv_block<RR, 1, DT>(n, P, vr, ldv, col, acc, lda, ahead);
}

// acc (RR rows, stride lda; N a multiple of VW) += P (RR rows, stride BN; n keys) . V, KJ keys at a time, V's
// rows read in memory order; per (row, column) the same sums in the same order as pv_block (acc += p_j v_j, j
// ascending). `ahead`: the next tile's V rows prefetched, KJ rows per KJ keys
template <int RR, int DT>
static void pv_keys(long n, long N, const float* P, const void* vr, long ldv, float* acc, long lda,
                    const Ahead* ahead) {
  constexpr int KJ = RR >= 4 ? 2 : 4;
  long j = 0;
  for (; j + KJ <= n; j += KJ) {
    if (ahead) prefetch_v(*ahead, j, j + KJ);
    vf p[RR][KJ];
#pragma GCC unroll 4
    for (int r = 0; r < RR; r++)
#pragma GCC unroll 4
      for (int t = 0; t < KJ; t++) p[r][t] = splat(P[r * BN + j + t]);
    const long o = j * ldv;
    for (long c = 0; c < N; c += VW) {
      vf v[KJ];
#pragma GCC unroll 4
      for (int t = 0; t < KJ; t++) v[t] = ld<DT>(vr, o + t * ldv + c);
#pragma GCC unroll 4
      for (int r = 0; r < RR; r++) {
        vf a = load(acc + r * lda + c);
#pragma GCC unroll 4
        for (int t = 0; t < KJ; t++) a += p[r][t] * v[t];
        store(acc + r * lda + c, a);
      }
    }
  }
  for (; j < n; j++) {
    if (ahead) prefetch_v(*ahead, j, j + 1);
    for (long c = 0; c < N; c += VW) {
      const vf v = ld<DT>(vr, j * ldv + c);
#pragma GCC unroll 4
      for (int r = 0; r < RR; r++) store(acc + r * lda + c, load(acc + r * lda + c) + splat(P[r * BN + j]) * v);
    }
  }
}

// RR rows of pv: in memory order (pv_keys) or register-blocked (pv_rows)
template <int RR, int DT>
static inline void pv_group(bool stream, long n, long N, const float* P, const void* vr, long ldv, float* acc,
                            long lda, const Ahead* ahead) {
  if (stream) pv_keys<RR, DT>(n, N, P, vr, ldv, acc, lda, ahead);
  else pv_rows<RR, DT>(n, N, P, vr, ldv, acc, lda, ahead);
}

// acc (rows x N, N a multiple of VW) += P (rows x n) . V (n x N), in groups of 4, 2, 1 rows; `ahead`: the next
// tile's V rows to prefetch (by the first group of rows only), or null
template <int DT>
static void pv(bool stream, long rows, long n, long N, const float* P, const void* vr, long ldv, float* acc,
               long lda, const Ahead* ahead) {
  long r = 0;
  for (; r + 4 <= rows; r += 4)
    pv_group<4, DT>(stream, n, N, P + r * BN, vr, ldv, acc + r * lda, lda, r ? nullptr : ahead);
  for (; r + 2 <= rows; r += 2)
    pv_group<2, DT>(stream, n, N, P + r * BN, vr, ldv, acc + r * lda, lda, r ? nullptr : ahead);
  for (; r < rows; r++) pv_group<1, DT>(stream, n, N, P + r * BN, vr, ldv, acc + r * lda, lda, r ? nullptr : ahead);
}

// One thread's buffers: q rows (fp32), scores / probabilities, a converted V tile (only when V cannot be
// read in place: Dv not a multiple of VW), a widened key block (bf16 / fp16, more than FEW_ROWS rows), the rows'
// intervals. Kept between calls (thread_local arena).
struct DecBufs {
  float *qb, *sc, *vt, *kb;
  uint16_t* qh;             // a bf16 call's q rows for dots_bdot (rb x round_up(D, 32)), packed once per item
  uint32_t* qt;             // or for dots_amx: their pairs along d (round_up(D, 32) / 2 x 16)
  uint16_t* kpad;           // dots_amx: 16 keys zero-padded (16 x round_up(D, 32))
  float* cbuf;              // dots_amx: a 16 x 16 score tile
  int32_t *lo, *hi, *regs;  // regs: the score_mod program's registers (regs x SL words), or none
};

static bool dec_bufs(const Dec& s, DecBufs& w) {
  const long nh = s.bdot && !s.amx ? s.rb * round_up(s.D, 32) / 2 : 0;  // (qh: bf16, two a float; or the tiles')
  const long na = s.amx ? round_up(s.D, 32) / 2 * 16 + 16 * round_up(s.D, 32) / 2 + 256 : 0;  // qt, kpad, cbuf
  const long nf = s.rb * s.Dp + s.rb * BN + nh + na + BN * s.Dvp + VW * s.Dp;
  const long nr = s.prog ? s.prog->regs * SL : 0;
  float* p = scratch<float>(5, nf + 2 * s.rb * s.nst + nr);
  if (!p) return false;
  w.qb = p, w.sc = p + s.rb * s.Dp, w.qh = (uint16_t*)(w.sc + s.rb * BN);
  w.qt = (uint32_t*)(w.sc + s.rb * BN + nh), w.kpad = (uint16_t*)(w.qt + round_up(s.D, 32) / 2 * 16);
  w.cbuf = (float*)(w.kpad + 16 * round_up(s.D, 32));
  w.vt = w.sc + s.rb * BN + nh + na, w.kb = w.vt + BN * s.Dvp;
  w.lo = (int32_t*)(w.kb + VW * s.Dp), w.hi = w.lo + s.rb * s.nst, w.regs = w.hi + s.rb * s.nst;
  return true;
}

// A row's scores of keys [j0, j0 + n) made final in place, before its mask: scaled, then ALiBi's bias or the
// score_mod's program (query index i of L, key indices j0 + lane; the same order of operations as the forward's
// tiles). The program runs on all BN lanes: those past n first take key n - 1's score (its kv index clamped to
// S - 1 by prog_run), so no lane holds a stale value from another tile
static inline void modded(const Dec& s, float* srow, long n, long b, long h, long i, long j0, int32_t* regs) {
  const vf scv = splat(s.scale);
  const long nv = round_up(n, VW);
  if (s.prog) {
    for (long j = 0; j < nv; j += VW) store(srow + j, load(srow + j) * scv);
    for (long j = n; j < BN; j++) srow[j] = srow[n - 1];
    std::memcpy(srow, prog_run(*s.prog, regs, srow, b, h, i, 0, s.L - 1, j0, 1, s.S - 1), BN * 4);
    return;
  }
  const vf sl = splat(s.alibi[h]);
  for (long j = 0; j < nv; j += VW) {  // the offset kv - q in integers first, as the forward and the reference
    const vi kq = splati((int32_t)(j0 + j - i)) + iota();
    store(srow + j, load(srow + j) * scv + sl * __builtin_convertvector(kq, vf));
  }
}

// Row r's stretches (w.lo / w.hi planes) clipped to the keys [a0, e0) of a tile: [sa[x], se[x]) for x < the count
// returned (the empty ones left out)
static inline long tile_stretches(const Dec& s, const DecBufs& w, long r, long a0, long e0, int32_t* sa, int32_t* se) {
  long ns = 0;
  for (long t = 0; t < s.nst; t++) {  // (stretch t of row r at t * rb + r: a unit of fewer rows leaves gaps)
    const int32_t a = (int32_t)mx2<long>(w.lo[t * s.rb + r], a0), e = (int32_t)mn<long>(w.hi[t * s.rb + r], e0);
    if (a < e) sa[ns] = a, se[ns] = e, ns++;
  }
  return ns;
}

// The union of the intervals [sa[t], se[t]) (t < ns, each non-empty) as disjoint runs [ra, re) in key order; their
// count (0 when ns is 0)
static inline long runs_of(const int32_t* sa, const int32_t* se, long ns, int32_t* ra, int32_t* re) {
  int32_t a[AK_MAX_STRETCHES], e[AK_MAX_STRETCHES];
  for (long t = 0; t < ns; t++) {  // sorted by start (insertion: ns <= AK_MAX_STRETCHES)
    long u = t;
    for (; u > 0 && a[u - 1] > sa[t]; u--) a[u] = a[u - 1], e[u] = e[u - 1];
    a[u] = sa[t], e[u] = se[t];
  }
  long m = 0;
  for (long t = 0; t < ns; t++) {
    if (m > 0 && a[t] <= re[m - 1]) {
      re[m - 1] = mx2(re[m - 1], e[t]);
    } else {
      ra[m] = a[t], re[m] = e[t], m++;
    }
  }
  return m;
}

// acc (rows x Dvp) += P . V over the tile's keys [j0, j0 + n) where some row does not see them all: each row over
// its own keys only — its stretches clipped to [t0, j0 + n) and merged into runs (a hidden key's value times its
// weight 0 would let a NaN / inf stored there into the row: 0 * inf). The same products in the same order, less
// those of weight 0. V's rows at vr (row stride ldv elements, of DT). Out of line: one tile at each end of a row's
// keys takes it, and the loop of every other tile keeps its code
template <int DT>
__attribute__((noinline)) static void pv_own(const Dec& s, const DecBufs& w, long rows, long j0, long n, long t0,
                                             const void* vr, long ldv, float* acc) {
  constexpr long esz = DT == AK_F32 ? 4 : 2;
  for (long r = 0; r < rows; r++) {
    int32_t sa[AK_MAX_STRETCHES], se[AK_MAX_STRETCHES], ra[AK_MAX_STRETCHES], re[AK_MAX_STRETCHES];
    const long m = runs_of(sa, se, tile_stretches(s, w, r, t0, j0 + n, sa, se), ra, re);
    for (long x = 0; x < m; x++) {
      const long o = ra[x] - j0;
      pv<DT>(s.stream, 1, re[x] - ra[x], s.Dvp, w.sc + r * BN + o, (const char*)vr + o * ldv * esz, ldv,
             acc + r * s.Dvp, s.Dvp, nullptr);
    }
  }
}

// One item: chunk c of unit u; leaves m, l (rows) and acc (rows x Dvp) at part.
template <int DT>
static void dec_item(const Dec& s, long u, const Unit& un, long c, float* part, DecBufs& w) {
  const long per = s.Hkv * s.nrb, b = u / per, hk = (u % per) / s.nrb, rb = u % s.nrb;
  long r0, r1;
  unit_rows(s, rb, r0, r1);
  const long rows = r1 - r0;
  float* m = part;
  float* l = part + s.rb;
  float* acc = part + 2 * s.rb;
  const long esz = DT == AK_F32 ? 4 : 2;
  // q rows, widened and zero-padded to Dp (a bf16 call's scores by VDPBF16PS: kept bf16, padded to 32 for
  // dots_bdot, packed once here rather than widened and packed back per tile); the rows' intervals
#if AK_BDOT
  const long D2 = round_up(s.D, 32);
  const bool tiles = DT == AK_BF16 && s.amx;  // the scores on AMX tiles (dots_amx; s.amx: units of <= 16 rows)
  const bool qpk = DT == AK_BF16 && s.bdot && !tiles && rows * D2 <= BDOT_Q;
  long roff[16];
#else
  const bool tiles = false, qpk = false;
#endif
  for (long r = 0; r < rows; r++) {
    const long h = hk * s.g + (r0 + r) / s.L, i = (r0 + r) % s.L;
    const char* qr = (const char*)s.q + (b * s.sq[0] + h * s.sq[1] + i * s.sq[2]) * esz;
#if AK_BDOT
    if (qpk) pad_rows(w.qh + r * D2, (const uint16_t*)qr, 0, 1, 1, s.D);  // (as dots_bdot reads it)
    if (tiles) roff[r] = (b * s.sq[0] + h * s.sq[1] + i * s.sq[2]);
#endif
    float* dst = w.qb + r * s.Dp;
    if (!qpk && !tiles) {
      for (long d = 0; d < s.D; d++) dst[d] = ld1<DT>(qr, d);
      fill(dst + s.D, dst + s.Dp, 0.f);
    }
    for (long t = 0; t < s.nst; t++) {  // stretch t of row r at w.lo / w.hi[t * rb + r]
      const long at = t * s.lst + b * s.lob + i;
      w.lo[t * s.rb + r] = mx2<int32_t>(s.lo[at], 0), w.hi[t * s.rb + r] = mn<int32_t>(s.hi[at], (int32_t)s.S);
    }
    m[r] = NEG_INF, l[r] = 0.f;
  }
#if AK_BDOT
  if (tiles) amx_q_pairs(w.qt, (const uint16_t*)s.q, roff, rows, s.D);
#endif
  fill(acc, acc + rows * s.Dvp, 0.f);
  const long ka = mx2<long>(c * s.chunk, un.kmin), kb = mn<long>((c + 1) * s.chunk, un.kmax);
  const char* kbase = (const char*)s.k + (b * s.sk[0] + hk * s.sk[1]) * esz;
  const char* vbase = (const char*)s.v + (b * s.sv[0] + hk * s.sv[1]) * esz;
  const bool v_in_place = s.Dvp == s.Dv;
  const vf scv = splat(s.scale), l2e = splat(LOG2E);
  const bool mod = s.prog || s.alibi;
  for (long j0 = ka / BN * BN; j0 < kb; j0 += BN) {
    const long n = mn<long>(BN, kb - j0);  // keys [j0, j0 + n); kb <= S
    const long t0 = mx2<long>(j0, ka);      // the first chunk's tile may start before ka
    bool any = false;
    for (long t = 0; t < s.nst && !any; t++)  // (stretch t of row r at t * rb + r: a unit of fewer rows leaves gaps)
      for (long r = t * s.rb; r < t * s.rb + rows; r++) any |= w.lo[r] < j0 + n && w.hi[r] > t0 && w.lo[r] < w.hi[r];
    if (!any) continue;
    const long nn = mn<long>(BN, kb - j0 - BN);  // keys of the next tile of this chunk
    const Ahead ahead{kbase + (j0 + BN) * s.sk[2] * esz, vbase + (j0 + BN) * s.sv[2] * esz, nn, s.sk[2] * esz,
                      s.sv[2] * esz, s.D * esz, s.Dv * esz};
#if AK_BDOT
    if (tiles) {
      for (long j = 0; j < n; j += VW) prefetch_rows(ahead, j);  // (the next tile's K rows, as dots would)
      dots_amx(rows, n, s.D, w.qt, (const uint16_t*)(kbase + j0 * s.sk[2] * esz), s.sk[2], w.sc, w.kpad, w.cbuf);
    } else
#endif
      dots<DT>(s.stream, rows, n, s.D, w.qb, s.Dp, kbase + j0 * s.sk[2] * esz, s.sk[2], w.sc, ahead, w.kb, s.Dp,
               s.bdot, qpk ? w.qh : nullptr);
    bool whole = true;  // every row sees every key of the tile: P . V runs over all rows at once
    for (long r = 0; r < rows; r++) {
      float* srow = w.sc + r * BN;
      // the row's stretches met by the tile, clipped to it: [sa[x], se[x]) for x < ns
      int32_t sa[AK_MAX_STRETCHES], se[AK_MAX_STRETCHES];
      const long ns = tile_stretches(s, w, r, t0, j0 + n, sa, se);
      whole = whole && ns == 1 && sa[0] == j0 && se[0] == j0 + n;
      if (ns == 0) {  // this row sees no key of the tile
        fill(srow, srow + n, 0.f);
        continue;
      }
      const int32_t a = sa[0], e = se[0];
      if (mod) modded(s, srow, n, b, hk * s.g + (r0 + r) / s.L, (r0 + r) % s.L, j0, w.regs);
      const bool full = ns == 1 && a == j0 && e == j0 + n;
      const vi av = splati(a), ev = splati(e);
      const long nv = round_up(n, VW);
      vf mxv = splat(NEG_INF);
      for (long j = 0; j < nv; j += VW) {
        vf x = mod ? load(srow + j) : load(srow + j) * scv;
        if (!full || j + VW > n) {
          const vi jj = splati((int32_t)(j0 + j)) + iota();
          vi in = (jj >= av) & (jj < ev);
          for (long t = 1; t < ns; t++) in |= (jj >= splati(sa[t])) & (jj < splati(se[t]));
          x = in ? x : splat(NEG_INF);
        }
        store(srow + j, x);
        mxv = x > mxv ? x : mxv;
      }
      const float mt = hmax(mxv), mold = m[r];
      const float mnew = mt > mold ? mt : mold;
      const float base = mnew == NEG_INF ? 0.f : mnew;
      const vf bv = splat(base);
      vf sum = splat(0.f);
      for (long j = 0; j < nv; j += VW) {
        const vf p = exp2v((load(srow + j) - bv) * l2e);
        store(srow + j, p);
        sum += p;
      }
      const float alpha = exp2s((mold - base) * LOG2E);
      l[r] = l[r] * alpha + hsum(sum);
      m[r] = mnew;
      if (alpha != 1.f) {
        float* ar = acc + r * s.Dvp;
        const vf alv = splat(alpha);
        for (long d = 0; d < s.Dvp; d += VW) store(ar + d, load(ar + d) * alv);
      }
    }
    const char* vr = vbase + j0 * s.sv[2] * esz;
    if (v_in_place && whole) {
      pv<DT>(s.stream, rows, n, s.Dvp, w.sc, vr, s.sv[2], acc, s.Dvp, &ahead);
    } else if (v_in_place) {  // a row that does not see every key of the tile reads only its own keys' values
      pv_own<DT>(s, w, rows, j0, n, t0, vr, s.sv[2], acc);
      prefetch_v(ahead, 0, ahead.nk);
    } else {  // Dv not a multiple of VW: this tile's V rows widened into a zero-padded buffer
      for (long j = 0; j < n; j++) {
        float* dst = w.vt + j * s.Dvp;
        for (long d = 0; d < s.Dv; d++) dst[d] = ld1<DT>(vr, j * s.sv[2] + d);
        fill(dst + s.Dv, dst + s.Dvp, 0.f);
      }
      prefetch_v(ahead, 0, ahead.nk);  // the next tile's V rows (read by this widening, not by pv)
      if (whole) pv<AK_F32>(s.stream, rows, n, s.Dvp, w.sc, w.vt, s.Dvp, acc, s.Dvp, nullptr);
      else pv_own<AK_F32>(s, w, rows, j0, n, t0, w.vt, s.Dvp, acc);
    }
  }
}

// out (B, H, L, Dv) contiguous, fp32 or (ort) of the input dtype DT, each row merged in fp32 and rounded once as
// it is written; out_r: null, or (fp32 out) the same rows rounded to DT beside it (contiguous); lse (B, H, L)
// contiguous fp32, or null
template <int DT>
static int decode_t(Dec& s, void* out, float* lse, bool ort, void* out_r) {
  const long units = s.B * s.Hkv * s.nrb;
  Unit* un = scratch<Unit>(4, units);
  if (!un) return AK_E_NOMEM;
  long items = 0, work = 0;
  for (long u = 0; u < units; u++) {
    const long per = s.Hkv * s.nrb, b = u / per, rb = u % s.nrb;
    long r0, r1;
    unit_rows(s, rb, r0, r1);
    int32_t a = (int32_t)s.S, e = 0;
    long keys = 0;  // the keys its stretches span (stretch by stretch: the work, where [a, e) may hold a gap)
    // its rows' query positions: all L of them once the unit spans a whole head, else r0 % L .. (r1 - 1) % L
    const long i0 = r1 - r0 >= s.L ? 0 : r0 % s.L, cnt = mn<long>(r1 - r0, s.L);
    for (long t = 0; t < s.nst; t++) {
      int32_t at0 = (int32_t)s.S, et = 0;
      for (long x = 0; x < cnt; x++) {
        const long i = (i0 + x) % s.L, at = t * s.lst + b * s.lob + i;
        const int32_t lo = mx2<int32_t>(s.lo[at], 0), hi = mn<int32_t>(s.hi[at], (int32_t)s.S);
        if (lo < hi) at0 = mn(at0, lo), et = mx2(et, hi);
      }
      if (at0 < et) a = mn(a, at0), e = mx2(e, et), keys += et - at0;
    }
    keys = mn<long>(keys, e > a ? e - a : 0);
    Unit& x = un[u];
    x.kmin = a, x.kmax = e, x.item = items;
    if (a < e) {
      x.c0 = a / s.chunk;
      x.nc = (e - 1) / s.chunk + 1 - x.c0;
    } else {
      x.c0 = 0, x.nc = 0;
    }
    items += x.nc;
    work += keys * (s.D + s.Dv) * (r1 - r0 + 3) / 4;
  }
  const long pstride = s.rb * (2 + s.Dvp);  // per item: m, l (rb each) and acc (rb x Dvp)
  float* part = scratch<float>(3, items * pstride);
  if (!part) return AK_E_NOMEM;
  // a small call runs on the calling thread (starting the team costs more than it saves)
  const int threads = work >= (1L << 17) ? s.threads : 1;
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
  {
#if AK_BDOT
    const TileScope tilecfg(s.amx);  // (dots_amx's tiles, this thread's, for this call)
#endif
    DecBufs w;
    const bool ok = dec_bufs(s, w);
    if (!ok) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(dynamic, 1)
    for (long it = 0; it < items; it++) {
      if (!ok) continue;
      // the unit of item it: the last unit whose first item is <= it (units without chunks skipped)
      long lo = 0, hi = units - 1;
      while (lo < hi) {
        const long mid = (lo + hi + 1) / 2;
        if (un[mid].item <= it) lo = mid;
        else hi = mid - 1;
      }
      while (un[lo].nc == 0 || it >= un[lo].item + un[lo].nc) lo++;
      dec_item<DT>(s, lo, un[lo], un[lo].c0 + (it - un[lo].item), part + it * pstride, w);
    }
    // merge each row's chunks in chunk order
#pragma omp for schedule(static)
    for (long u = 0; u < units; u++) {
      const long per = s.Hkv * s.nrb, b = u / per, hk = (u % per) / s.nrb, rb = u % s.nrb;
      long r0, r1;
      unit_rows(s, rb, r0, r1);
      const Unit& x = un[u];
      for (long r = 0; r < r1 - r0; r++) {
        const long h = hk * s.g + (r0 + r) / s.L, i = (r0 + r) % s.L;
        const long oo = ((b * s.H + h) * s.L + i) * s.Dv;
        if (ort && !ok) continue;  // (no row buffer: the call fails with AK_E_NOMEM)
        float* o = ort ? w.vt : (float*)out + oo;  // (ort: the row in fp32 in this thread's V buffer, >= Dv floats)
        float dummy;
        float* ls = lse ? lse + (b * s.H + h) * s.L + i : &dummy;
        float M = NEG_INF;
        for (long c = 0; c < x.nc; c++) {
          const float mc = part[(x.item + c) * pstride + r];
          M = mc > M ? mc : M;
        }
        // every chunk weighed, even one of weight 0: a NaN in its sum or output reaches the row, as in the forward
        const float base = M == NEG_INF ? 0.f : M;
        float lsum = 0.f;
        fill(o, o + s.Dv, 0.f);
        for (long c = 0; c < x.nc; c++) {
          const float* pc = part + (x.item + c) * pstride;
          const float wc = exp2s((pc[r] - base) * LOG2E);
          lsum += wc * pc[s.rb + r];
          const float* ac = pc + 2 * s.rb + r * s.Dvp;
          for (long d = 0; d < s.Dv; d++) o[d] += wc * ac[d];
        }
        if (lsum == 0.f) {  // no key (or every score -inf): out 0, lse -inf
          if (ort) zero_row(out, oo, s.Dv, DT);
          else fill(o, o + s.Dv, 0.f);
          if (out_r) zero_row(out_r, oo, s.Dv, DT);
          *ls = NEG_INF;
          continue;
        }
        const float inv = 1.f / lsum;
        for (long d = 0; d < s.Dv; d++) o[d] *= inv;
        if (ort) narrow_row(out, oo, o, s.Dv, DT);
        else if (out_r) narrow_row(out_r, oo, o, s.Dv, DT);
        *ls = M + std::log(lsum);
      }
    }
  }
  return failed ? AK_E_NOMEM : AK_OK;
}

// ---------------------------------------------------------------------------------------------------
// The backward of a few query rows (L <= FEW_BWD_L, the g * L rows of a kv head's query heads in one block of
// BM): the key-tile backward of attn_impl.h visits each (query head, query block) of a key tile apart — at L = 1
// one row each, every product a matrix-vector one, and K^T, V^T packed and dK, dV zeroed per key tile for it.
// Here the rows of a kv head form one unit, as in the decode: per key tile S = Q K^T and dP = dO V^T by the
// decode's dot products (K and V rows read in place, bf16 / fp16 widened per vector), P and dS per row, then
// dV = P^T dO and dK = dS^T Q as one product each over all the unit's rows, and the unit's dQ share dS K.
// Work: (unit, chunk of keys) items, the chunks (a multiple of BN keys) from S alone; an item writes dK and dV of
// its keys (each key is one item's; keys no row sees get 0) and leaves its rows' dQ share in scratch; the shares
// are added in chunk order at the end: the same bits on every run and at any thread count.
// Intervals only (no tile map), ALiBi's slopes or a score_mod's program whose tables take no gradient (the key-tile
// backward runs learnable tables: their gradients are summed item by item in its order).
// ---------------------------------------------------------------------------------------------------
constexpr long FEW_BWD_L = 16;

struct RowsBwd {
  const Shape* s;
  const void *q, *k, *v, *dout;
  const long* sdo;
  const float *out, *lse, *dlse;
  void *dk, *dv;
  int gdt;
  long g, rows, chunk, nc, Dp, Dvp, Dm;
  bool bdot;  // bf16 scores and dP by VDPBF16PS, as the decode forward's (Dec::bdot)
};

// one item: keys [c * chunk, (c + 1) * chunk) of unit u (batch b, kv head hk); its rows' dQ share at dqs
template <int DT>
static void rows_bwd_item(const RowsBwd& x, long u, long c, float* dqs, float* buf) {
  const Shape& s = *x.s;
  const long b = u / s.Hkv, hk = u % s.Hkv, rows = x.rows, Dp = x.Dp, Dvp = x.Dvp;
  const long esz = DT == AK_F32 ? 4 : 2;
  float* qb = buf;                   // rows x Dp: q rows, widened, zero-padded
  float* dob = qb + BM * Dp;         // rows x Dvp: dO rows
  float* p = dob + BM * Dvp;         // rows x BN: scores, then P (in place)
  float* dp = p + BM * BN;           // rows x BN: dP, then dS
  float* dka = dp + BM * BN;         // BN x Dp
  float* dva = dka + BN * Dp;        // BN x Dvp
  float* kp = dva + BN * Dvp;        // BN x Dp: K rows widened / padded (dQ's right-hand side)
  float* kb = kp + BN * Dp;          // VW x Dm: the dot products' widened key block (more than FEW_ROWS rows)
  float* lse = kb + VW * x.Dm;       // rows
  float* delta = lse + BM;           // rows
  int32_t* lo = (int32_t*)(delta + BM);
  int32_t* hi = lo + BM;
  float* sraw = (float*)(hi + BM);   // rows x BN: the scaled scores a score_mod's program reads (with a program)
  float* dsrow = sraw + BM * BN;     // SL: one row's dL/d(score) through the program
  float* G = dsrow + SL;             // regs x SL: the program's adjoints
  int32_t* regs = (int32_t*)(G + (s.prog ? s.prog->regs * SL : 0));  // regs x SL: its registers
  for (long r = 0; r < rows; r++) {
    const long h = hk * x.g + r / s.L, i = r % s.L, bh = b * s.H + h;
    widen_row(qb + r * Dp, x.q, b * s.sq[0] + h * s.sq[1] + i * s.sq[2], s.D, s.dt);
    fill(qb + r * Dp + s.D, qb + (r + 1) * Dp, 0.f);
    float* dr = dob + r * Dvp;
    widen_strided(dr, x.dout, b * x.sdo[0] + h * x.sdo[1] + i * x.sdo[2], s.Dv, x.sdo[3], s.dt);
    fill(dr + s.Dv, dr + Dvp, 0.f);
    delta[r] = delta_of(dr, x.out + (bh * s.L + i) * s.Dv, s.Dv, x.dlse ? x.dlse[bh * s.L + i] : 0.f);
    lse[r] = x.lse[bh * s.L + i];
    const long at = b * s.lob + i;
    lo[r] = mx2<int32_t>(s.lo[at], 0), hi[r] = mn<int32_t>(s.hi[at], (int32_t)s.S);
  }
  fill(dqs, dqs + rows * Dp, 0.f);
  const long ka = c * x.chunk, ke = mn<long>(s.S, ka + x.chunk);
  const char* kbase = (const char*)x.k + (b * s.sk[0] + hk * s.sk[1]) * esz;
  const char* vbase = (const char*)x.v + (b * s.sv[0] + hk * s.sv[1]) * esz;
  const Ahead none{nullptr, nullptr, 0, 0, 0, 0, 0};
  const vf scv = splat(s.scale), l2e = splat(LOG2E);
  const bool ab = s.alibi != nullptr;
  for (long j0 = ka; j0 < ke; j0 += BN) {
    const long n = mn<long>(BN, ke - j0);
    const long dko = ((b * s.Hkv + hk) * s.S + j0) * s.D, dvo = ((b * s.Hkv + hk) * s.S + j0) * s.Dv;
    bool any = false;
    for (long r = 0; r < rows && !any; r++) any = lo[r] < j0 + n && hi[r] > j0 && lo[r] < hi[r] && lse[r] != NEG_INF;
    if (!any) {  // no row sees these keys: their gradients are 0
      zero_row(x.dk, dko, n * s.D, x.gdt);
      zero_row(x.dv, dvo, n * s.Dv, x.gdt);
      continue;
    }
    const char* kr = kbase + j0 * s.sk[2] * esz;
    const char* vr = vbase + j0 * s.sv[2] * esz;
    dots<DT>(false, rows, n, s.D, qb, Dp, kr, s.sk[2], p, none, kb, x.Dm, x.bdot);
    dots<DT>(false, rows, n, s.Dv, dob, Dvp, vr, s.sv[2], dp, none, kb, x.Dm, x.bdot);
    for (long r = 0; r < rows; r++) {
      float* pr = p + r * BN;
      float* dsr = dp + r * BN;
      const int32_t a = mx2<int32_t>(lo[r], (int32_t)j0), e = mn<int32_t>(hi[r], (int32_t)(j0 + n));
      if (lse[r] == NEG_INF || a >= e) {  // this row sees no key of the tile (or none at all): P = dS = 0
        fill(pr, pr + BN, 0.f);
        fill(dsr, dsr + BN, 0.f);
        continue;
      }
      const long h = hk * x.g + r / s.L, i = r % s.L;
      const vf lv = splat(lse[r]), sl = splat(ab ? s.alibi[h] : 0.f), dl = splat(delta[r]);
      const vi av = splati(a), ev = splati(e), qi = splati((int32_t)i);
      float* raw = sraw + r * BN;
      if (s.prog) {  // scale, keep the scaled row for the backward through the program, run the program (lanes
        // past n hold key n - 1's score, their kv index clamped to S - 1 by prog_run: masked below)
        for (long j = 0; j < BN; j += VW) store(raw + j, load(pr + j) * scv);
        std::memcpy(pr, prog_run(*s.prog, regs, raw, b, h, i, 0, s.L - 1, j0, 1, s.S - 1), BN * 4);
      }
      for (long j = 0; j < BN; j += VW) {
        const vi jj = splati((int32_t)(j0 + j)) + iota();
        const vf xs = s.prog ? load(pr + j) : scored(load(pr + j), scv, ab, sl, jj - qi);
        const vf pv = (jj >= av) & (jj < ev) ? exp2v((xs - lv) * l2e) : splat(0.f);
        store(pr + j, pv);
        const vf dsv = pv * (load(dsr + j) - dl);
        store(dsr + j, pv == splat(0.f) ? splat(0.f) : dsv);  // where P is 0, dS is 0 (never 0 * garbage)
      }
      if (s.prog) {  // through the score_mod: dS = dS(after) * d(mod)/d(score) by the program's reverse mode over
        // the registers its run on this row left (no table takes a gradient here: rows_backward_fits)
        prog_grad(*s.prog, regs, G, dsr, dsrow, nullptr);
        for (long j = 0; j < BN; j += VW)  // where P is 0 the gradient is 0 (never 0 * inf from the program)
          store(dsr + j, load(pr + j) == splat(0.f) ? splat(0.f) : load(dsrow + j));
      }
    }
    // dV = P^T dO and dK = dS^T Q over the unit's rows (the softmax scale applied to dK once, as it is written)
    gemm<true>((int)n, (int)Dvp, (int)rows, p, 1, BN, dob, Dvp, dva, Dvp);
    gemm<true>((int)n, (int)Dp, (int)rows, dp, 1, BN, qb, Dp, dka, Dp);
    for (long j = 0; j < n; j++) {
      float* kj = dka + j * Dp;
      for (long d = 0; d < s.D; d++) kj[d] *= s.scale;
      narrow_row(x.dk, dko + j * s.D, kj, s.D, x.gdt);
      narrow_row(x.dv, dvo + j * s.Dv, dva + j * Dvp, s.Dv, x.gdt);
    }
    // dQ share += dS K (K rows in place where fp32 and D a multiple of VW; else widened / padded)
    const float* kf = (const float*)kr;
    long ldk = s.sk[2];
    if (DT != AK_F32 || Dp != s.D) {
      pack_rows(kp, x.k, b * s.sk[0] + hk * s.sk[1] + j0 * s.sk[2], s.sk[2], n, s.D, Dp, s.dt);
      kf = kp, ldk = Dp;
    }
    gemm((int)rows, (int)Dp, (int)n, dp, BN, 1, kf, ldk, dqs, Dp);
  }
}

static int rows_backward(const Shape& s, const void* q, const void* k, const void* v, const void* dout,
                         const long* sdo, const float* out, const float* lse, const float* dlse, void* dq, void* dk,
                         void* dv, bool rounded) {
  RowsBwd x;
  x.s = &s, x.q = q, x.k = k, x.v = v, x.dout = dout, x.sdo = sdo, x.out = out, x.lse = lse, x.dlse = dlse;
  x.dk = dk, x.dv = dv, x.gdt = rounded ? s.dt : AK_F32;
  x.bdot = bdot_on(s.dt);
  x.g = s.H / s.Hkv, x.rows = x.g * s.L;
  x.Dp = round_up(s.D, VW), x.Dvp = round_up(s.Dv, VW), x.Dm = mx2<long>(x.Dp, x.Dvp);
  // S keys in at most 64 chunks of at least 256 (a multiple of BN): from S alone, so the bits never depend on the
  // thread count
  x.chunk = mx2<long>(256, round_up((s.S + 63) / 64, BN));
  x.nc = (s.S + x.chunk - 1) / x.chunk;  // (S >= 1: rows_backward_fits)
  const long units = s.B * s.Hkv, items = units * x.nc, share = x.rows * x.Dp;
  float* part = scratch<float>(3, items * share);
  if (!part) return AK_E_NOMEM;
  const long nbuf = BM * x.Dp + BM * x.Dvp + 2 * BM * BN + 2 * BN * x.Dp + BN * x.Dvp + VW * x.Dm + 4 * BM +
                    (s.prog ? BM * BN + SL + 2 * s.prog->regs * SL : 0);
  // a small call runs on the calling thread (starting the team costs more than it saves)
  const long work = units * s.S * (s.D + s.Dv) * x.rows;
  const int threads = work >= (1L << 16) ? s.threads : 1;
  void (*const item)(const RowsBwd&, long, long, float*, float*) =
      s.dt == AK_BF16 ? rows_bwd_item<AK_BF16> : s.dt == AK_F16 ? rows_bwd_item<AK_F16> : rows_bwd_item<AK_F32>;
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
  {
    float* buf = scratch<float>(5, nbuf);
    if (!buf) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(dynamic, 1)
    for (long it = 0; it < items; it++)
      if (buf) item(x, it / x.nc, it % x.nc, part + it * share, buf);
    // dQ = scale * the chunks' shares, added in chunk order
#pragma omp for schedule(static)
    for (long u = 0; u < units; u++) {
      if (!buf) continue;
      const long b = u / s.Hkv, hk = u % s.Hkv;
      for (long r = 0; r < x.rows; r++) {
        const long h = hk * x.g + r / s.L, i = r % s.L;
        float* row = buf;  // (this thread's buffer: its items are done)
        fill(row, row + s.D, 0.f);
        for (long c = 0; c < x.nc; c++) {
          const float* sh = part + (u * x.nc + c) * share + r * x.Dp;
          for (long d = 0; d < s.D; d++) row[d] += sh[d];
        }
        for (long d = 0; d < s.D; d++) row[d] *= s.scale;
        narrow_row(dq, ((b * s.H + h) * s.L + i) * s.D, row, s.D, x.gdt);
      }
    }
  }
  return failed ? AK_E_NOMEM : AK_OK;
}

// whether a score_mod's program wants gradients into any of its tables
static bool prog_table_grads(const Prog& p) {
  for (long t = 0; p.tgrad && t < p.ntables && t < MAX_GRAD_TABLES; t++)
    if (p.tgrad[t]) return true;
  return false;
}

// whether rows_backward takes the call
static bool rows_backward_fits(const Shape& s) {
  return !s.tkind && !(s.prog && prog_table_grads(*s.prog)) && s.L >= 1 && s.L <= FEW_BWD_L && s.S >= 1 &&
         s.H % s.Hkv == 0 && (s.H / s.Hkv) * s.L <= BM;
}

int run_decode(const AkCall* c) {
  if (c->L < 1 || c->L > BM || c->H % c->Hkv != 0 || c->dtype < AK_F32 || c->dtype > AK_F16 ||
      (c->chunk != 0 && (c->chunk < 0 || c->chunk % BN != 0)) || c->nst < 0 || c->nst > AK_MAX_STRETCHES ||
      (c->out_r && (c->ort || c->dtype == AK_F32)))  // (ort: out itself in the input dtype; out_r: a rounded copy
                                                     // beside an fp32 out, bf16 / fp16 only)
    return AK_E_ARG;
  Dec s;
  s.B = c->B, s.H = c->H, s.Hkv = c->Hkv, s.L = c->L, s.S = c->S, s.D = c->D, s.Dv = c->Dv;
  s.g = s.H / s.Hkv;
  for (int i = 0; i < 3; i++) s.sq[i] = c->sq[i], s.sk[i] = c->sk[i], s.sv[i] = c->sv[i];
  s.lo = c->lo, s.hi = c->hi, s.lob = c->lob;
  s.nst = c->nst > 1 ? c->nst : 1, s.lst = c->lst;
  s.scale = (float)c->scale;
  s.threads = (int)(c->threads > 0 ? c->threads : 1);
  // S keys in at most 64 chunks of at least 512 (a multiple of BN): enough items for every thread, and partial
  // states (rows x Dv per chunk) a small fraction of the keys' bytes
  s.chunk = c->chunk ? c->chunk : mx2<long>(512, round_up((s.S + 63) / 64, BN));
  s.rb = mn<long>(s.g * s.L, BM);
  s.nrb = (s.g * s.L + s.rb - 1) / s.rb;
  s.Dp = round_up(s.D, VW), s.Dvp = round_up(s.Dv, VW);
  const long esz = c->dtype == AK_F32 ? 4 : 2;
  // the order: forced for every call (ak_decode_order), else the record's (this machine's calibration), else the rule
  const int order = ak_decode_order >= 0 ? 1 + ak_decode_order : c->order == 1 || c->order == 2 ? (int)c->order : 0;
  s.bdot = bdot_on(c->dtype);
  s.stream = s.rb <= FEW_ROWS && (order == 0 ? s.B * s.Hkv * s.S * (s.D + s.Dv) * esz >= STREAM_BYTES : order == 2);
  // the rule's memory order, learned per call shape instead (ak_order_choice: both orders give the same bits)
  int timed = 0;
  int64_t learn_key = -1;
  if (order == 0 && s.stream && ak_decode_learn.load(std::memory_order_relaxed)) {
    long cls = 0;
    for (long b = s.B * s.Hkv * s.S * (s.D + s.Dv) * esz; b > 1 && cls < 63; b >>= 1) cls++;
    // (the build's vector width and whether bf16 dot products run: a process may switch instruction set or them)
    learn_key = (((((int64_t)c->dtype * 256 + mn<long>(s.threads, 255)) * 16 + s.rb) * 64 + cls) * 32 + VW) * 2 +
                (s.bdot ? 1 : 0);
    s.stream = ak_order_choice(learn_key, &timed) == 1;
  }
#if AK_BDOT
  s.amx = s.bdot && s.rb >= 2 && s.rb <= 16 && amx_usable();
#else
  s.amx = false;
#endif
  s.q = c->q, s.k = c->k, s.v = c->v;
  s.alibi = c->pcode ? nullptr : c->alibi;
  Prog prog;
  s.prog = nullptr;
  if (c->pcode) {
    prog = Prog{c->pcode,   (long)c->pn, (long)c->pregs, (long)c->pout,    c->pconsts,
                c->ptables, c->ptshape,  c->perr,        nullptr, (long)c->pntables};
    s.prog = &prog;
  }
  const auto t0 = std::chrono::steady_clock::now();
  int rc;
  switch (c->dtype) {
    case AK_BF16: rc = decode_t<AK_BF16>(s, c->out, c->lse, c->ort != 0, c->out_r); break;
    case AK_F16: rc = decode_t<AK_F16>(s, c->out, c->lse, c->ort != 0, c->out_r); break;
    default: rc = decode_t<AK_F32>(s, c->out, c->lse, false, nullptr);
  }
  if (timed && rc == AK_OK)
    ak_order_sample(learn_key, s.stream ? 1 : 0,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return rc;
}

}  // namespace AK_NS
