// attnkit's CPU attention kernel: block-sparse FlashAttention (FA2) forward and backward.
//
// This header is compiled once per instruction set (attn_avx512.cpp, attn_avx2.cpp, attn_base.cpp),
// each inside its own namespace with AK_VW floats per vector; attn_dispatch.cpp picks one at run
// time. The arithmetic is written with GCC/Clang vector extensions, so one source serves every target.
//
// Masks come as per-row key intervals: query row i of batch b sees keys [lo[b, i], hi[b, i]).
// Causal, sliding window, chunked, document, padding, prefix-LM and their intersections are all
// such intervals, so a tile is
//   skipped   when no row's interval meets it,
//   full      when it lies inside every row's interval (no mask work at all),
//   partial   otherwise: two comparisons per score against the row's edges.
//
// Layout: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), last dimension contiguous, any other strides
// (given in elements); fp32, bf16 or fp16 (Shape::dt: all three alike, and dO in the backward). A bf16 / fp16
// input is widened to fp32 tile by tile as it is packed (attn_widen.h), never converted whole: the math is
// fp32 throughout, outputs are fp32 or, where the caller asks, rounded once to the input dtype as they are written
// (attn_widen.h's narrow_row: no fp32 copy of a bf16 / fp16 output, no conversion pass). GQA: query head h
// reads kv head h / (H / Hkv), no copy.
// Scores, statistics and lse in natural units, fp32 (exponentials computed as exp2 of x * log2(e)); a row
// that sees no key gets out = 0 and lse = -inf.

// Every helper below is static (or in an anonymous-linkage template) and no std:: template is
// instantiated here: each instruction set's copy must stay its own — a shared COMDAT (std::fill,
// std::vector) compiled for AVX-512 could be picked by the linker for the portable path too.
#include "attn_common.h"

#ifndef AK_VW
#error "AK_VW (floats per vector) must be defined"
#endif

namespace AK_NS {

constexpr int VW = AK_VW;
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_u __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef int32_t vi_u __attribute__((vector_size(VW * 4), aligned(4)));

constexpr int BM = 64;  // query rows per block
constexpr int BN = 64;  // keys per tile (a multiple of every VW)
static_assert(BN == BM, "pack_t transposes query blocks and the backward's key tiles alike (leading dim BM)");
// packed K / V tiles a forward thread keeps: at least TC_MIN, and every tile of a kv head where they fit in
// TC_BYTES (a causal block reads all the tiles below it: each is then widened about once per thread and head)
constexpr long TC_MIN = 8, TC_BYTES = 4L << 20;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// register block of the micro-GEMM: R rows x NC vectors (AVX-512: 4 x 4 zmm = 16 accumulators)
#if AK_VW >= 16
constexpr int R = 4, NC = 4;  // 16 accumulators + 4 rows of B: FMA-bound, and 64 rows split evenly
#elif AK_VW >= 8
constexpr int R = 4, NC = 2;
#else
constexpr int R = 4, NC = 2;
#endif

static inline vf load(const float* p) { return *(const vf_u*)p; }
static inline void store(float* p, vf x) { *(vf_u*)p = x; }
// x - 0.0, not x + 0.0: subtracting +0 is exact for every x (-0.0 included), so the compiler drops it and
// emits one broadcast; adding +0 cannot be dropped (-0.0 + 0.0 = +0.0) and cost an add per broadcast
static inline vf splat(float x) { return x - (vf){}; }
static inline vi splati(int32_t x) { return x - (vi){}; }

static inline vi iota() {
  vi r;
  for (int i = 0; i < VW; i++) r[i] = i;
  return r;
}

static inline float hmax(vf x) {
  float m = x[0];
  for (int i = 1; i < VW; i++) m = x[i] > m ? x[i] : m;
  return m;
}
static inline float hsum(vf x) {
  float s = 0.f;
  for (int i = 0; i < VW; i++) s += x[i];
  return s;
}

// 2^x for x <= 0 (scores minus the row max); x < -126 (and -inf) gives exactly 0.
// n = round(x), f = x - n in [-0.5, 0.5], 2^f by its Taylor series to degree 7 (error < 1e-8
// relative), 2^n added to the exponent bits.
static inline vf exp2v(vf x) {
  vi dead = x < splat(-126.0f);
  x = dead ? splat(-126.0f) : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf r = (x + magic) - magic;
  vf f = x - r;
  vi n = __builtin_convertvector(r, vi);
  vf p = splat(1.5252733804059841e-05f);
  p = p * f + splat(1.5403530393381609e-04f);
  p = p * f + splat(1.3333558146428443e-03f);
  p = p * f + splat(9.6181291076284772e-03f);
  p = p * f + splat(5.5504108664821580e-02f);
  p = p * f + splat(2.4022650695910071e-01f);
  p = p * f + splat(6.9314718055994531e-01f);
  p = p * f + splat(1.0f);
  vi bits = (vi)p + (n << 23);
  vf out = (vf)bits;
  return dead ? splat(0.0f) : out;
}

static inline float exp2s(float x) { return x == NEG_INF ? 0.f : std::exp2(x); }

// C[M x N] (+)= A[M x K] . B[K x N]; A(i, k) = A[i*sai + k*sak] (any layout: its elements are
// broadcast), B rows contiguous with stride ldb, N a multiple of VW.
template <int RR, int NV, bool ZERO>
static inline void mk(int K, const float* __restrict A, long sai, long sak, const float* __restrict B, long ldb,
                      float* __restrict C, long ldc) {
  vf acc[RR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < RR; r++)
#pragma GCC unroll 8
    for (int c = 0; c < NV; c++) acc[r][c] = ZERO ? splat(0.f) : load(C + r * ldc + c * VW);
  for (int k = 0; k < K; k++) {
    vf b[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; c++) b[c] = load(B + k * ldb + c * VW);
#pragma GCC unroll 8
    for (int r = 0; r < RR; r++) {
      vf a = splat(A[r * sai + k * sak]);
#pragma GCC unroll 8
      for (int c = 0; c < NV; c++) acc[r][c] += a * b[c];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RR; r++)
#pragma GCC unroll 8
    for (int c = 0; c < NV; c++) store(C + r * ldc + c * VW, acc[r][c]);
}

template <int NV, bool ZERO>
static inline void gemm_cols(int M, int K, const float* A, long sai, long sak, const float* B, long ldb, float* C,
                             long ldc) {
  int i = 0;
#if AK_VW == 8
  // AVX2 (16 ymm registers): 6 rows x 2 vectors = 12 independent accumulators (4 x 2 left 8, two FMA units at 4
  // cycles of latency each need 8 in flight: no slack for the loads)
  if (NV == 2)
    for (; i + 6 <= M; i += 6) mk<6, NV, ZERO>(K, A + i * sai, sai, sak, B, ldb, C + i * ldc, ldc);
#endif
  for (; i + R <= M; i += R) mk<R, NV, ZERO>(K, A + i * sai, sai, sak, B, ldb, C + i * ldc, ldc);
  for (; i < M; i++) mk<1, NV, ZERO>(K, A + i * sai, sai, sak, B, ldb, C + i * ldc, ldc);
}

// ZERO: C = A . B (C's old values are not read)
template <bool ZERO = false>
static void gemm(int M, int N, int K, const float* A, long sai, long sak, const float* B, long ldb, float* C,
                 long ldc) {
  int n0 = 0;
  for (; n0 + NC * VW <= N; n0 += NC * VW) gemm_cols<NC, ZERO>(M, K, A, sai, sak, B + n0, ldb, C + n0, ldc);
  int left = (N - n0) / VW;
  // NC <= 4 everywhere: at most three vectors are left
  if (left == 3) gemm_cols<3, ZERO>(M, K, A, sai, sak, B + n0, ldb, C + n0, ldc);
  else if (left == 2) gemm_cols<2, ZERO>(M, K, A, sai, sak, B + n0, ldb, C + n0, ldc);
  else if (left == 1) gemm_cols<1, ZERO>(M, K, A, sai, sak, B + n0, ldb, C + n0, ldc);
}

static inline long round_up(long x, long m) { return (x + m - 1) / m * m; }
template <class T>
static inline T mn(T a, T b) { return a < b ? a : b; }
template <class T>
static inline T mx2(T a, T b) { return a < b ? b : a; }
static inline void fill(float* a, float* e, float x) {
  for (; a < e; a++) *a = x;
}

// Scratch memory kept between calls (per calling thread, per slot): the backward's delta, dQ turns and key-tile
// ranges (B*H*L floats, B*H*L/64 ints); fresh pages cost a fault and a zeroing each. Grows to the largest call seen;
// ak_release_scratch() gives it back.
struct Arena {
  void* p = nullptr;
  size_t cap = 0;
  ~Arena() { free(p); }
};
// slot 0: delta, slot 1: the dQ turns, slot 2: the key-tile ranges (backward); slot 3: decode's partial states,
// slot 4: its units (calling thread), slot 5: each decode thread's buffers (attn_decode.h)
static thread_local Arena arenas[6];

template <class T>
static T* scratch(int slot, long n) {
  Arena& a = arenas[slot];
  size_t want = (size_t)(n > 0 ? n : 1) * sizeof(T);
  if (want > a.cap) {
    free(a.p);
    a.p = malloc(want);
    a.cap = a.p ? want : 0;
  }
  return (T*)a.p;
}

void release_scratch() {
  for (Arena& a : arenas) {
    free(a.p);
    a.p = nullptr, a.cap = 0;
  }
}

// a zeroed scratch array of n elements, freed at scope exit
template <class T>
struct Buf {
  T* p;
  explicit Buf(long n) : p((T*)calloc(n > 0 ? n : 1, sizeof(T))) {}
  ~Buf() { free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  T& operator[](long i) { return p[i]; }
  T* data() { return p; }
};

#include "attn_prog.h"
#include "attn_widen.h"

struct Shape {
  long B, H, Hkv, L, S, D, Dv;
  long sq[3], sk[3], sv[3];  // strides (elements) of batch, head, row; the last dimension is contiguous
  const int32_t* lo;
  const int32_t* hi;
  long lob;  // batch stride of lo/hi (0: shared by the batch, or L)
  float scale;
  int threads;
  const float* alibi;  // (H,) ALiBi slopes: score + slope[h] * (kv - q), or null
  // the tile map (null: intervals only; see AkCall): kinds, bit-mask index, bit masks, batch / head strides
  const int8_t* tkind;
  const int32_t* tidx;
  const uint32_t* tbits;
  long tkb, tkh;
  const Prog* prog;  // a score_mod program run on the scaled scores (attn_prog.h), or null
  int dt;            // element type of q, k, v (and the backward's dO): AK_F32, AK_BF16 or AK_F16
  bool bdot;         // the forward multiplies bf16 on AMX tiles (attn_amx.h): a bf16 call, AMX here
};

enum { T_EMPTY = 0, T_PARTIAL = 1, T_FULL = 2 };

// A tile of the map: its kind and, for a partial tile, its bit mask (2 planes of BM words); kind full and no
// bits without a map (the intervals decide).
struct TileMask {
  int kind;
  const uint32_t* bits;
};

static inline TileMask tile_mask(const Shape& s, long b, long h, long qb, long kb, long nk) {
  if (!s.tkind) return {T_FULL, nullptr};
  const long t = b * s.tkb + h * s.tkh + qb * nk + kb;
  const int kind = s.tkind[t];
  return {kind, kind == T_PARTIAL ? s.tbits + (long)s.tidx[t] * 2 * BM : nullptr};
}

// scores fl(q.k) * scale (+ ALiBi's slope * (kv - q), the offset taken in integers first, as the reference
// rounds it) of VW (query, key) pairs whose offsets are `kv_minus_q`
static inline vf scored(vf dot, vf sc, bool ab, vf sl, vi kv_minus_q) {
  vf x = dot * sc;
  if (ab) x += sl * __builtin_convertvector(kv_minus_q, vf);
  return x;
}

// Per query block: the smallest lo and largest hi of its live rows (the keys it may touch) and
// the largest lo and smallest hi of all rows (tiles inside [flo, fhi) need no mask).
struct Block {
  int32_t kmin, kmax, flo, fhi;
};

static Block block_of(const Shape& s, long b, long i0, long m) {
  const int32_t* lo = s.lo + b * s.lob + i0;
  const int32_t* hi = s.hi + b * s.lob + i0;
  Block r{(int32_t)s.S, 0, 0, (int32_t)s.S};
  for (long i = 0; i < m; i++) {
    int32_t a = mx2<int32_t>(lo[i], 0), e = mn<int32_t>(hi[i], (int32_t)s.S);
    r.flo = mx2(r.flo, a);
    r.fhi = mn(r.fhi, e);
    if (a < e) {
      r.kmin = mn(r.kmin, a);
      r.kmax = mx2(r.kmax, e);
    }
  }
  if (m < BM) r.fhi = 0;  // a short block: its padding columns are always masked
  return r;
}

static inline bool tile_touched(const int32_t* lo, const int32_t* hi, long m, long j0, long j1) {
  for (long i = 0; i < m; i++)
    if (lo[i] < j1 && hi[i] > j0 && lo[i] < hi[i]) return true;
  return false;
}

// The kernel works on transposed score tiles, S^T = K Q^T (keys x queries, BN x BM): K and V are read
// in place (their elements are broadcast), only the query block is transposed (once per block), and the
// softmax statistics of BM queries are vectors, so no horizontal reduction is ever needed.
//
// edges of the BM queries of a block (padding columns: lo = 1, hi = 0, never visible)
static void block_edges(const Shape& s, long b, long i0, long m, int32_t* lo, int32_t* hi) {
  const int32_t* l = s.lo + b * s.lob + i0;
  const int32_t* h = s.hi + b * s.lob + i0;
  for (long i = 0; i < BM; i++) {
    lo[i] = i < m ? l[i] : 1;
    hi[i] = i < m ? h[i] : 0;
  }
}

// S^T rows j < n (key j0 + j): -inf where query i does not see the key
static inline void mask_tile(float* st, long n, long j0, const int32_t* lo, const int32_t* hi) {
  for (int c = 0; c < BM; c += VW) {
    vi lov = *(const vi_u*)(lo + c), hiv = *(const vi_u*)(hi + c);
    for (long j = 0; j < n; j++) {
      vi jj = splati((int32_t)(j0 + j));
      vi keep = (jj >= lov) & (jj < hiv);
      store(st + j * BM + c, keep ? load(st + j * BM + c) : splat(NEG_INF));
    }
  }
}

// S^T rows j < n of a partial tile of the map: -inf where the tile's bit for (query, key j) is clear
static inline void mask_bits_t(float* st, long n, const uint32_t* bits) {
  for (int c = 0; c < BM; c += VW) {
    const vi w0 = *(const vi_u*)(bits + c), w1 = *(const vi_u*)(bits + BM + c);
    for (long j = 0; j < n; j++) {
      const vi keep = (((j < 32 ? w0 : w1) >> (int)(j & 31)) & 1) != 0;
      store(st + j * BM + c, keep ? load(st + j * BM + c) : splat(NEG_INF));
    }
  }
}

// row i (BN keys) of a partial tile of the map, row layout: -inf (or `fill`) where the tile's bit is clear
static inline void mask_bits_row(float* srow, const uint32_t* bits, long i, float fill = NEG_INF) {
  const int32_t w[2] = {(int32_t)bits[i], (int32_t)bits[BM + i]};
  for (int c = 0; c < BN; c += VW) {
    const vi keep = ((splati(w[c >> 5]) >> (iota() + (c & 31))) & 1) != 0;
    store(srow + c, keep ? load(srow + c) : splat(fill));
  }
}

// Q^T of a query block (D x BM) from the rows at src + off (type dt), zero in the padding columns
#if AK_VW == 8 && AK_X86_INTRIN
// the 8 x 8 block r (rows) transposed in registers: r[c] holds what was column c
static inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// 8 elements of type dt at src + off, widened
static inline __m256 load8(const void* src, long off, int dt) {
  return dt == AK_F32 ? _mm256_loadu_ps((const float*)src + off)
                      : (__m256)(dt == AK_BF16 ? ld<AK_BF16>(src, off) : ld<AK_F16>(src, off));
}
#endif

static inline void pack_t(float* dst, const void* src, long off, long stride, long m, long D, int dt) {
  long i0 = 0;
#if AK_VW == 8 && AK_X86_INTRIN
  // 8 rows at a time: 8 x 8 blocks widened, transposed in registers, stored as whole vectors (the scalar
  // transpose below — and bf16's widening through a stack row — was up to a tenth of a short call's forward)
  const long D8 = D / 8 * 8;
  for (; i0 + 8 <= m; i0 += 8) {
    for (long d = 0; d < D8; d += 8) {
      __m256 r[8];
      for (int t = 0; t < 8; t++) r[t] = load8(src, off + (i0 + t) * stride + d, dt);
      transpose8(r);
      for (int c = 0; c < 8; c++) _mm256_storeu_ps(dst + (d + c) * BM + i0, r[c]);
    }
    for (long d = D8; d < D; d++)
      for (long t = 0; t < 8; t++) dst[d * BM + i0 + t] = widen1(src, off + (i0 + t) * stride + d, dt);
  }
#endif
  for (long i = i0; i < m; i++) {
    if (dt == AK_F32) {
      const float* r = (const float*)src + off + i * stride;
      for (long d = 0; d < D; d++) dst[d * BM + i] = r[d];
    } else {  // the row widened a vector at a time (widen_row), then transposed: no per-element conversion
      float row[256];
      for (long d0 = 0; d0 < D; d0 += 256) {
        const long n = mn<long>(256, D - d0);
        widen_row(row, src, off + i * stride + d0, n, dt);
        for (long d = 0; d < n; d++) dst[(d0 + d) * BM + i] = row[d];
      }
    }
  }
  if (m < BM)
    for (long d = 0; d < D; d++) fill(dst + d * BM + m, dst + d * BM + BM, 0.f);
}

// rows (m x X) at src + off (type dt, row stride `stride`) into an (m x Xp) fp32 buffer, zero-padded columns
static inline void pack_rows(float* dst, const void* src, long off, long stride, long m, long X, long Xp, int dt) {
  for (long i = 0; i < m; i++) {
    widen_row(dst + i * Xp, src, off + i * stride, X, dt);
    if (Xp > X) fill(dst + i * Xp + X, dst + (i + 1) * Xp, 0.f);
  }
}


// ---- partial tiles: compute only what some query sees (a band's corners are never multiplied) ----
//
// A tile's layout is S^T (keys x queries). `Edges` holds, per vector of VW queries, the smallest lo
// and largest hi of its live queries, and the block's own lo/hi per query.
struct Edges {
  int32_t vlo[BM / VW], vhi[BM / VW];
  const int32_t* lo;
  const int32_t* hi;
};

static inline void edges_of(Edges& e, const int32_t* lo, const int32_t* hi) {
  e.lo = lo, e.hi = hi;
  for (int v = 0; v < BM / VW; v++) {
    int32_t a = std::numeric_limits<int32_t>::max(), b = std::numeric_limits<int32_t>::min();
    for (int i = v * VW; i < (v + 1) * VW; i++)
      if (lo[i] < hi[i]) a = mn(a, lo[i]), b = mx2(b, hi[i]);
    e.vlo[v] = a, e.vhi[v] = b;
  }
}

// the query vectors [v0, v1) that see any of keys [ja, jb) (v0 == v1: none)
static inline void vectors_seeing(const Edges& e, long ja, long jb, int& v0, int& v1) {
  v0 = BM / VW, v1 = 0;
  for (int v = 0; v < BM / VW; v++)
    if (e.vlo[v] < jb && e.vhi[v] > ja) v0 = mn(v0, v), v1 = v + 1;
  if (v1 <= v0) v0 = v1 = 0;
}

// keys [ka, kb) of a tile (tile-relative) that any of rows [i, i + r) sees
static inline void row_keys(const int32_t* lo, const int32_t* hi, long i, long r, long j0, long n, long& ka,
                            long& kb) {
  long a = j0 + n, b = j0;
  for (long x = i; x < i + r; x++)
    if (lo[x] < hi[x]) a = mn<long>(a, lo[x]), b = mx2<long>(b, hi[x]);
  ka = mx2<long>(a, j0) - j0, kb = mn<long>(b, j0 + n) - j0;
  if (kb < ka) kb = ka;
}

// S^T (n x BM) = Kr (n x K, rows in place) . Bt (K x BM), each group of R keys only over the query vectors
// that see them; the entries left out are garbage, and invisible (mask_tile sets them to -inf)
static void scores_trimmed(long n, long j0, int K, const float* Kr, long ldk, const float* Bt, float* st,
                           const Edges& e) {
  for (long r0 = 0; r0 < n; r0 += R) {
    const int rows = (int)mn<long>(R, n - r0);
    int v0, v1;
    vectors_seeing(e, j0 + r0, j0 + r0 + rows, v0, v1);
    if (v1 > v0)
      gemm<true>(rows, (v1 - v0) * VW, K, Kr + r0 * ldk, ldk, 1, Bt + v0 * VW, BM, st + r0 * BM + v0 * VW, BM);
  }
}

// C (m x N) += P (m x n, P(i, j) = pt[j * BM + i]) . B (n x N, rows ldb), each group of R queries over the
// keys it sees only (P is exactly 0 elsewhere)
static void by_keys_trimmed(long m, long n, long j0, long N, const float* pt, const float* B, long ldb, float* C,
                            long ldc, const Edges& e) {
  for (long i = 0; i < m; i += R) {
    const long rows = mn<long>(R, m - i);
    long ka, kb;
    row_keys(e.lo, e.hi, i, rows, j0, n, ka, kb);
    if (kb > ka) gemm((int)rows, (int)N, (int)(kb - ka), pt + ka * BM + i, 1, BM, B + ka * ldb, ldb, C + i * ldc, ldc);
  }
}

#include "attn_amx.h"

// whether elements off .. off + n of p (type dt) hold an inf or NaN (its exponent bits all set)
static inline bool row_nonfinite(const void* p, long off, long n, int dt) {
  const uint32_t e = ak_exp_bits(dt);
  int bad = 0;
  if (dt == AK_F32) {
    const uint32_t* u = (const uint32_t*)p + off;
    for (long d = 0; d < n; d++) bad |= (u[d] & e) == e;
  } else {
    const uint16_t* u = (const uint16_t*)p + off;
    for (long d = 0; d < n; d++) bad |= (u[d] & e) == e;
  }
  return bad != 0;
}

// A partial tile of the map: the weight of a key the mask hides is 0, and 0 * inf is NaN in O += P V, so where a
// value row of the tile (n rows of vb at voff, ldv apart, type vdt) holds an inf or NaN the tile is multiplied here
// instead, each row only over the keys it sees (the tile's bit and the row's interval), as the formula, which never
// reads a hidden value; returns whether it did (false: no such row, the caller's product). P^T at pt[j * BM + i];
// acc(i, d) at acc[i * si + d * sd].
static bool pv_nonfinite_tile(long m, long n, long j0, const float* pt, const void* vb, long voff, long ldv,
                              int vdt, long Dv, float* acc, long si, long sd, const uint32_t* bits,
                              const int32_t* lo, const int32_t* hi) {
  bool any = false;
  for (long j = 0; j < n && !any; j++) any = row_nonfinite(vb, voff + j * ldv, Dv, vdt);
  if (!any) return false;
  for (long i = 0; i < m; i++)
    for (long j = 0; j < n; j++) {
      if (!(((bits[(j < 32 ? 0 : BM) + i]) >> (j & 31)) & 1u) || j0 + j < lo[i] || j0 + j >= hi[i]) continue;
      const float p = pt[j * BM + i];
      for (long d = 0; d < Dv; d++) acc[i * si + d * sd] += p * widen1(vb, voff + j * ldv + d, vdt);
    }
  return true;
}

// ---------------------------------------------------------------------------------------------------
// forward: out (B, H, L, Dv) contiguous fp32 (or null), out_r the same rounded to the input dtype (or null),
// lse (B, H, L) contiguous
// ---------------------------------------------------------------------------------------------------
static void forward(const Shape& s, const void* q, const void* k, const void* v, float* out, float* lse,
                    void* out_r) {
  const long nq = (s.L + BM - 1) / BM, nk = (s.S + BN - 1) / BN, g = s.H / s.Hkv;
  const long Dvp = round_up(s.Dv, VW);
  const long items = s.B * s.H * nq;
  // fp32 K and V are read in place (V unless Dv needs padding); bf16 / fp16 tiles are widened into buffers
  // (AMX: K is read in place (a short last tile copied), V^T packed into the V slots, O kept transposed)
  const bool bd = AK_BDOT && s.bdot;
  const bool k_in_place = s.dt == AK_F32 || bd, v_in_place = Dvp == s.Dv && s.dt == AK_F32,
             ab = s.alibi != nullptr;
#pragma omp parallel num_threads(s.threads) if (s.threads > 1 && items > 1)
  {
    // packed (widened / padded) K and V tiles, tc of them kept by tile number: the next query block of a
    // thread mostly reads the same tiles again (a window's), so each is widened about once, not once per block
    const long tile_bytes = BN * ((k_in_place ? 0 : s.D) + (v_in_place ? 0 : Dvp)) * 4;
    // (never more slots than key tiles: a short call's buffers are calloc'd, zeroed, per call and thread — eight
    // slots for one tile of bf16 K / V at D = 64 zeroed 263 KB a thread)
    const long tc = mn<long>(nk, mx2<long>(TC_MIN, TC_BYTES / mx2<long>(tile_bytes, 1)));
    // slots spaced by a cache line more than a tile and V's 2 KB off K's: packed tiles at page-aligned offsets
    // from each other (and from the score / accumulator buffers) made the GEMMs' loads alias the stores 4 KB apart
    const long ks = BN * s.D + 16, vs = BN * Dvp + 16;
    Buf<float> qt(bd ? 1 : s.D * BM), st(BN * BM), kp(k_in_place ? 1 : tc * ks), vp(v_in_place ? 1 : tc * vs + 512),
        acc(BM * Dvp), mrow(BM), lrow(BM);
    const long D32 = round_up(s.D, 32);  // (AMX: the scores' depth, zero past D)
    Buf<uint32_t> qtb(bd ? D32 / 2 * BM : 1), pb(bd ? BN / 2 * BM : 1);  // Q^T and P as bf16 pairs
    Buf<uint16_t> kpad(bd ? BN * D32 : 1);  // a key tile of fewer than BN keys or D % 32 != 0, zero-padded
    Buf<float> orow(bd ? BM * Dvp : 1);  // (AMX: the block's O rows, from O^T)
#if AK_BDOT
    const TileScope tiles(bd);
#endif
    Buf<long> tag(tc);
    for (long t = 0; t < tc; t++) tag[t] = -1;
    Buf<int32_t> lo(BM), hi(BM), regs(s.prog ? s.prog->regs * SL : 1);
#pragma omp for schedule(dynamic, 1)
    for (long it = 0; it < items; it++) {
      const long qb = nq - 1 - it % nq, bh = it / nq, b = bh / s.H, h = bh % s.H, hk = h / g;
      const long i0 = qb * BM, m = mn<long>(BM, s.L - i0);
      // the query columns worked on: m rounded up to a vector (a block of a few rows — a short call's, the last
      // block of a long one — computed all BM columns' scores and softmax: L = 1 did 8x the work at AVX2)
      const long mc = round_up(m, VW);
      const long oo = ((b * s.H + h) * s.L + i0) * s.Dv;  // this block's first output element
      float* o = out ? out + oo : nullptr;
      float* ls = lse + (b * s.H + h) * s.L + i0;
      const Block blk = block_of(s, b, i0, m);
      if (blk.kmin >= blk.kmax) {  // no row of this block sees a key
        if (o) fill(o, o + m * s.Dv, 0.f);
        if (out_r) zero_row(out_r, oo, m * s.Dv, s.dt);
        fill(ls, ls + m, NEG_INF);
        continue;
      }
      block_edges(s, b, i0, m, lo.p, hi.p);
      Edges edges;
      edges_of(edges, lo.p, hi.p);
      const long qoff = b * s.sq[0] + h * s.sq[1] + i0 * s.sq[2];
#if AK_BDOT
      if (bd) pack_q_pairs(qtb.p, q, qoff, s.sq[2], m, s.D);
      else
#endif
        pack_t(qt.p, q, qoff, s.sq[2], m, s.D, s.dt);
      fill(acc.p, acc.p + BM * Dvp, 0.f);
      fill(mrow.p, mrow.p + BM, NEG_INF);
      fill(lrow.p, lrow.p + BM, 0.f);
      const long koff = b * s.sk[0] + hk * s.sk[1], voff = b * s.sv[0] + hk * s.sv[1];
      for (long j0 = blk.kmin / BN * BN; j0 < blk.kmax; j0 += BN) {
        const long n = mn<long>(BN, s.S - j0);
        const TileMask tm = tile_mask(s, b, h, qb, j0 / BN, nk);
        if (tm.kind == T_EMPTY) continue;
        const bool full = !tm.bits && n == BN && j0 >= blk.flo && j0 + n <= blk.fhi;
        if (!full && !tile_touched(lo.p, hi.p, m, j0, j0 + n)) continue;
        const float* kt = (const float*)k + koff + j0 * s.sk[2];  // this tile's K rows (n x D)
        long ldk = s.sk[2];
        const long slot = (j0 / BN) % tc, tile = (b * s.Hkv + hk) * nk + j0 / BN;
        const bool packed = tag[slot] == tile;
        tag[slot] = (k_in_place && v_in_place) ? -1 : tile;
        if (!k_in_place) {
          if (!packed) pack_rows(kp.p + slot * ks, k, koff + j0 * s.sk[2], s.sk[2], n, s.D, s.D, s.dt);
          kt = kp.p + slot * ks, ldk = s.D;
        }
#if AK_BDOT
        if (bd) {  // S^T = K Q^T on tiles, every BN x BM score (a partial tile masked below), K in place
          const uint16_t* kb16 = (const uint16_t*)k + koff + j0 * s.sk[2];
          long ldk16 = s.sk[2];
          if (n < BN || D32 != s.D) {
            pad_rows(kpad.p, kb16, s.sk[2], n, BN, s.D);
            kb16 = kpad.p, ldk16 = D32;
          }
          scores_amx(kb16, ldk16, qtb.p, D32, st.p);
        } else
#endif
        if (full)
          gemm<true>(n, (int)mc, s.D, kt, ldk, 1, qt.p, BM, st.p, BM);  // S^T = K Q^T
        else
          scores_trimmed(n, j0, (int)s.D, kt, ldk, qt.p, st.p, edges);
        if (s.prog) {  // scale, then the score_mod's program on each key's BM queries (before any mask)
          const vf scv = splat(s.scale);
          for (long j = 0; j < n; j++) {
            float* row = st.p + j * BM;
            for (int c = 0; c < BM; c += VW) store(row + c, load(row + c) * scv);
            std::memcpy(row, prog_run(*s.prog, regs.p, row, b, h, i0, 1, s.L - 1, j0 + j, 0, s.S - 1), BM * 4);
          }
        }
        if (!full) {
          mask_tile(st.p, n, j0, lo.p, hi.p);
          if (tm.bits) mask_bits_t(st.p, n, tm.bits);
        }
        // Scores and their running max stay in natural units, s = fl(q.k) * scale as every other path
        // rounds them (so lse = max + log(sum) matches a softmax recomputed from these scores to the
        // last bits: weights rebuilt as exp(s - lse) agree); only the exponent goes to base 2.
        const vf sc = splat(s.scale), l2e = splat(LOG2E), sl = splat(ab ? s.alibi[h] : 0.f);
        for (int cc = 0; cc < mc; cc += VW) {  // online softmax, VW queries at a time
          vf mx = splat(NEG_INF);
          const vi qi = splati((int32_t)(i0 + cc)) + iota();
          for (long j = 0; j < n; j++) {
            vf x = s.prog ? load(st.p + j * BM + cc) : scored(load(st.p + j * BM + cc), sc, ab, sl, splati((int32_t)(j0 + j)) - qi);
            store(st.p + j * BM + cc, x);
            mx = x > mx ? x : mx;
          }
          vf mold = load(mrow.p + cc);
          vf mnew = mx > mold ? mx : mold;
          vf base = mnew == splat(NEG_INF) ? splat(0.f) : mnew;  // a column with nothing yet: P = 0
          vf alpha = exp2v((mold - base) * l2e);
          vf sum = splat(0.f);
          for (long j = 0; j < n; j++) {
            vf p = exp2v((load(st.p + j * BM + cc) - base) * l2e);
            store(st.p + j * BM + cc, p);
            sum += p;
          }
          store(lrow.p + cc, load(lrow.p + cc) * alpha + sum);
          store(mrow.p + cc, mnew);
          if (bd) {  // O^T: one vector of VW queries per row of Dv
            for (long d = 0; d < Dvp; d++) store(acc.p + d * BM + cc, load(acc.p + d * BM + cc) * alpha);
            continue;
          }
          for (int r = 0; r < VW; r++) {
            const float a = alpha[r];
            if (a != 1.f) {
              float* ar = acc.p + (cc + r) * Dvp;
              vf av = splat(a);
              for (long d = 0; d < Dvp; d += VW) store(ar + d, load(ar + d) * av);
            }
          }
        }
#if AK_BDOT
        if (bd) {  // O^T += V^T P^T on tiles: P rounded once, V^T packed once per slot
          uint16_t* vtp = (uint16_t*)(vp.p + 512 + slot * vs);
          if (!packed) pack_v_t(vtp, Dvp, v, voff + j0 * s.sv[2], s.sv[2], n, s.Dv);  // (kept for the next block)
          if (tm.bits && pv_nonfinite_tile(m, n, j0, st.p, v, voff + j0 * s.sv[2], s.sv[2], s.dt, s.Dv, acc.p, 1,
                                           BM, tm.bits, lo.p, hi.p))  // (O^T: acc(i, d) at d * BM + i)
            continue;
          pack_p_pairs(pb.p, st.p, n, mc);
          pv_amx(vtp, Dvp, pb.p, acc.p);
          continue;
        }
#endif
        const float* vt = (const float*)v + voff + j0 * s.sv[2];
        long ldv = s.sv[2];
        if (!v_in_place) {
          if (!packed) pack_rows(vp.p + 512 + slot * vs, v, voff + j0 * s.sv[2], s.sv[2], n, s.Dv, Dvp, s.dt);
          vt = vp.p + 512 + slot * vs, ldv = Dvp;
        }
        if (tm.bits && pv_nonfinite_tile(m, n, j0, st.p, vt, 0, ldv, AK_F32, s.Dv, acc.p, Dvp, 1, tm.bits, lo.p,
                                         hi.p))
          continue;
        if (full)
          gemm(m, Dvp, n, st.p, 1, BM, vt, ldv, acc.p, Dvp);  // O += P V, P(i, j) = S^T[j][i]
        else
          by_keys_trimmed(m, n, j0, Dvp, st.p, vt, ldv, acc.p, Dvp, edges);
      }
#if AK_BDOT
      if (bd) rows_of_ot(acc.p, Dvp, mc, orow.p);  // (O^T: the block's rows, transposed back)
#endif
      for (long i = 0; i < m; i++) {
        if (lrow.p[i] == 0.f) {
          if (o) fill(o + i * s.Dv, o + (i + 1) * s.Dv, 0.f);
          if (out_r) zero_row(out_r, oo + i * s.Dv, s.Dv, s.dt);
          ls[i] = NEG_INF;
          continue;
        }
        const float inv = 1.f / lrow.p[i];
        float* ar = (bd ? orow.p : acc.p) + i * Dvp;
        for (long d = 0; d < s.Dv; d++) ar[d] *= inv;
        if (o) std::memcpy(o + i * s.Dv, ar, s.Dv * sizeof(float));
        if (out_r) narrow_row(out_r, oo + i * s.Dv, ar, s.Dv, s.dt);  // rounded once, from the fp32 row
        ls[i] = mrow.p[i] + std::log(lrow.p[i]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// backward (FA2): one work item per (batch, kv head, key tile); the g query heads of the kv head and
// every query block that sees the tile are visited inside, so dK and dV are written once, by one
// thread. The backward works on score tiles in row layout, S = Q K^T (queries x keys): Q, dO, K and V
// rows are read in place and only the item's own K^T and V^T (D x 64 each) are packed, so it needs no
// copy of the sequence. dQ: each (key tile, query block) pair's share is computed into a small tile of
// the thread's own and added into dq when it is that key tile's turn at the block (key tiles add in
// increasing order: wait_turn), so dQ is summed in one fixed order and the backward gives the same bits on
// every run and at every thread count, with no per-thread copy of dQ.
// dO's rows may have any stride (an expanded gradient: packed per pair, never copied whole).
// out: the forward's output (B, H, L, Dv) contiguous; dlse: a gradient into lse (B, H, L) or null;
// lse in natural-log units (B, H, L). Writes dq (B, H, L, D), dk, dv, contiguous.
// ---------------------------------------------------------------------------------------------------

// queries [ia, ib) of a block that see any of keys [ja, jb)
static inline void key_rows(const int32_t* lo, const int32_t* hi, long m, long ja, long jb, long& ia, long& ib) {
  ia = m, ib = 0;
  for (long x = 0; x < m; x++)
    if (lo[x] < jb && hi[x] > ja && lo[x] < hi[x]) ia = mn(ia, x), ib = x + 1;
  if (ib < ia) ib = ia;
}

// C (n x N) += P^T (n x m; P(i, j) = P[i * BN + j]) . B (m x N rows, ldb): each group of R keys only over
// the queries that see it (P is exactly 0 elsewhere)
static void by_queries_trimmed(long n, long m, long j0, long N, const float* P, const float* B, long ldb,
                               float* C, long ldc, const int32_t* lo, const int32_t* hi) {
  for (long r0 = 0; r0 < n; r0 += R) {
    const long rows = mn<long>(R, n - r0);
    long ia, ib;
    key_rows(lo, hi, m, j0 + r0, j0 + r0 + rows, ia, ib);
    if (ib > ia)
      gemm((int)rows, (int)N, (int)(ib - ia), P + ia * BN + r0, 1, BN, B + ia * ldb, ldb, C + r0 * ldc, ldc);
  }
}

// S (m x BN) = A (m x K rows, in place) . Bt (K x BN), each group of R rows only over the key vectors its
// rows see (the entries left out are garbage: the caller masks them)
static void rows_trimmed(long m, long j0, long n, int K, const float* A, long lda, const float* Bt, float* S,
                         const int32_t* lo, const int32_t* hi) {
  for (long i = 0; i < m; i += R) {
    const int rows = (int)mn<long>(R, m - i);
    long ka, kb;
    row_keys(lo, hi, i, rows, j0, n, ka, kb);
    const long v0 = ka / VW, v1 = (kb + VW - 1) / VW;
    if (v1 > v0)
      gemm<true>(rows, (int)((v1 - v0) * VW), K, A + i * lda, lda, 1, Bt + v0 * VW, BN, S + i * BN + v0 * VW,
                 BN);
  }
}

// row i of S (BN keys): -inf outside [lo, hi) and beyond n keys
static inline void mask_row(float* srow, int32_t lo, int32_t hi, long j0, long n, float fill = NEG_INF) {
  vi lov = splati(lo), hiv = splati((int32_t)mn<long>(hi, j0 + n));
  for (int c = 0; c < BN; c += VW) {
    vi j = splati((int32_t)(j0 + c)) + iota();
    vi keep = (j >= lov) & (j < hiv);
    store(srow + c, keep ? load(srow + c) : splat(fill));
  }
}

// The backward's steps, one function each; `backward` below strings them together.

// delta of one row: rowsum(dO * O) - dlse, summed in order (every backward path alike: the same bits)
static inline float delta_of(const float* dor, const float* o, long Dv, float dlse) {
  float acc = 0.f;
  for (long d = 0; d < Dv; d++) acc += dor[d] * o[d];
  return acc - dlse;
}

// delta = rowsum(dO * O) - dlse for every row, and dq = 0 (dQ shares are added into it in key-tile order)
static void prepare_rows(const Shape& s, const void* dout, const long* sdo, const float* out, const float* dlse,
                         float* delta, float* dq) {
  const long nq = (s.L + BM - 1) / BM, nblk = s.B * s.H * nq, sdl = sdo[3];
#pragma omp parallel num_threads(s.threads) if (s.threads > 1 && nblk > 1)
  {
    Buf<float> row(s.Dv);  // a dO row in fp32: every dtype and stride then takes the same sum (the same bits)
#pragma omp for schedule(dynamic, 16)
    for (long it = 0; it < nblk; it++) {
      const long qb = it % nq, bh = it / nq, b = bh / s.H, h = bh % s.H;
      const long i0 = qb * BM, m = mn<long>(BM, s.L - i0);
      const long ds = b * sdo[0] + h * sdo[1] + i0 * sdo[2];
      const float* o = out + (bh * s.L + i0) * s.Dv;
      for (long i = 0; i < m; i++) {
        widen_strided(row.p, dout, ds + i * sdo[2], s.Dv, sdl, s.dt);
        delta[bh * s.L + i0 + i] = delta_of(row.p, o + i * s.Dv, s.Dv, dlse ? dlse[bh * s.L + i0 + i] : 0.f);
      }
      fill(dq + (bh * s.L + i0) * s.D, dq + (bh * s.L + i0 + m) * s.D, 0.f);
    }
  }
}

// Per (batch, query head, query block): the key tiles [t0, t1) that may meet it (from the intervals, or from
// the tile map's first and last non-empty tile). These are the tiles that take turns adding into its dQ.
struct TileRange {
  int32_t t0, t1;
};

static void key_tile_ranges(const Shape& s, TileRange* r) {
  const long nq = (s.L + BM - 1) / BM, nk = (s.S + BN - 1) / BN;
  for (long b = 0; b < s.B; b++) {
    for (long qb = 0; qb < nq; qb++) {
      const Block bl = block_of(s, s.lob ? b : 0, qb * BM, mn<long>(BM, s.L - qb * BM));
      const int32_t a = bl.kmin < bl.kmax ? bl.kmin / BN : 0, e = bl.kmin < bl.kmax ? (bl.kmax + BN - 1) / BN : 0;
      for (long h = 0; h < s.H; h++) {
        TileRange x{a, e};
        if (s.tkind && a < e) {
          const int8_t* kr = s.tkind + b * s.tkb + h * s.tkh + qb * nk;
          int32_t f = e, l = a - 1;
          for (int32_t t = a; t < e; t++)
            if (kr[t] != T_EMPTY) f = mn(f, t), l = t;
          x = f <= l ? TileRange{f, l + 1} : TileRange{0, 0};
        }
        r[(b * s.H + h) * nq + qb] = x;
      }
    }
  }
}

// Waits until it is key tile `kt`'s turn to add into a query block's dQ (every earlier tile of the block's range
// has added, or passed), so dQ is summed in one fixed order whatever the threads do: the backward is
// bitwise reproducible, at any thread count. No deadlock: items are taken in increasing key-tile order, so the
// earliest unfinished one never waits.
static inline void wait_turn(const int32_t* turn, int32_t kt) {
  for (int spins = 0; __atomic_load_n(turn, __ATOMIC_ACQUIRE) != kt; spins++) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (spins > 256) sched_yield(), spins = 0;  // the tile we wait for may be on a descheduled thread
  }
}

// One thread's buffers for key-tile items.
struct BwdBufs {
  Buf<float> kt, vt, kp, qr, dor, p, dp, dka, dva, dqs, sraw, grads, dsrow, row;
  Buf<int32_t> lo, hi, regs;
  GradAcc acc;  // this thread's share of the gradients into the score_mod's learnable tables (one item's)
  BwdBufs(long D, long Dv, long Dp, long Dvp, long Dq, const Prog* prog)
      : kt(D * BN), vt(Dv * BN), kp(BN * Dp), qr(BM * Dp), dor(BM * Dvp), p(BM * BN), dp(BM * BN), dka(BN * Dp),
        dva(BN * Dvp), dqs(BM * Dq), sraw(prog ? BM * BN : 1), grads(prog ? prog->regs * SL : 1), dsrow(SL),
        row(Dvp), lo(BM), hi(BM), regs(prog ? prog->regs * SL : 1) {
    for (long t = 0; prog && prog->tgrad && t < MAX_GRAD_TABLES; t++) {
      const int64_t* sh = prog->tshape + 5 * t;
      if (t >= prog->ntables || !prog->tgrad[t]) continue;
      long n = 1;
      for (long d = 0; d < sh[0]; d++) n *= sh[1 + d];
      acc.buf[t] = (float*)calloc(n, sizeof(float));
      acc.lo[t] = n, acc.hi[t] = 0;
      acc.nt = t + 1;
    }
  }
  ~BwdBufs() {
    for (float* b : acc.buf) free(b);
  }
  BwdBufs(const BwdBufs&) = delete;
  BwdBufs& operator=(const BwdBufs&) = delete;
  // adds this item's share into the tables' gradients (the caller holds the item's turn) and clears it
  void flush(const Prog& p) {
    for (long t = 0; t < acc.nt; t++) {
      if (!acc.buf[t] || acc.hi[t] <= acc.lo[t]) continue;
      float* dst = p.tgrad[t];
      for (long i = acc.lo[t]; i < acc.hi[t]; i++) dst[i] += acc.buf[t][i], acc.buf[t][i] = 0.f;
      const int64_t* sh = p.tshape + 5 * t;
      long n = 1;
      for (long d = 0; d < sh[0]; d++) n *= sh[1 + d];
      acc.lo[t] = n, acc.hi[t] = 0;
    }
  }
};

// P (m x BN, row layout) = exp(scale Q K^T (+ ALiBi) - lse), masked; a row that sees nothing (lse = -inf) is 0
static void probabilities(const Shape& s, long b, long h, long i0, long m, long j0, long n, bool full,
                          const TileMask& tm, const float* q_rows, long ldq, const float* kt, const float* lr,
                          BwdBufs& w) {
  if (!q_rows) {  // (the scores are in w.p already: AMX tiles)
  } else if (full)
    gemm<true>(m, BN, s.D, q_rows, ldq, 1, kt, BN, w.p.p, BN);
  else
    rows_trimmed(m, j0, n, (int)s.D, q_rows, ldq, kt, w.p.p, w.lo.p, w.hi.p);
  const vf sc = splat(s.scale), l2e = splat(LOG2E);
  const bool ab = s.alibi != nullptr;
  const vf sl = splat(ab ? s.alibi[h] : 0.f);
  for (long i = 0; i < m; i++) {
    float* pr = w.p.p + i * BN;
    if (lr[i] == NEG_INF) {
      fill(pr, pr + BN, 0.f);
      continue;
    }
    if (s.prog) {  // scale, keep the scaled row for the backward through the program, run the program
      float* raw = w.sraw.p + i * BN;
      for (int c = 0; c < BN; c += VW) store(raw + c, load(pr + c) * sc);
      std::memcpy(pr, prog_run(*s.prog, w.regs.p, raw, b, h, i0 + i, 0, s.L - 1, j0, 1, s.S - 1), BN * 4);
    }
    if (!full) mask_row(pr, w.lo[i], w.hi[i], j0, n);
    if (tm.bits) mask_bits_row(pr, tm.bits, i);
    const vf lv = splat(lr[i]);
    const vi qi = splati((int32_t)(i0 + i));
    for (int c = 0; c < BN; c += VW) {
      vf x = s.prog ? load(pr + c) : scored(load(pr + c), sc, ab, sl, splati((int32_t)(j0 + c)) + iota() - qi);
      store(pr + c, exp2v((x - lv) * l2e));
    }
  }
}

// dP = dO V^T, then dS = P * (dP - delta) into w.dp (where P is 0, dS is 0: never 0 * garbage). Where the mask hides
// the key, dS is 0 too — the formula's where(mask, s, -inf) passes no gradient there, whatever P holds: in a row whose
// lse lr[i] is NaN or +inf, P is NaN at every key, so the mask (the row's interval, the tile's bits) is applied to its
// dS as to its scores, with 0 (elsewhere P is exactly 0 there already)
static void score_grads(const Shape& s, long b, long h, long i0, long m, long j0, long n, bool full,
                        const TileMask& tm, const float* do_rows, long lddo, const float* vt, const float* dr,
                        const float* lr, BwdBufs& w) {
  if (!do_rows) {  // (dP is in w.dp already: AMX tiles)
  } else if (full)
    gemm<true>(m, BN, s.Dv, do_rows, lddo, 1, vt, BN, w.dp.p, BN);
  else
    rows_trimmed(m, j0, n, (int)s.Dv, do_rows, lddo, vt, w.dp.p, w.lo.p, w.hi.p);
  for (long i = 0; i < m; i++) {
    const vf dv2 = splat(dr[i]);
    for (int c = 0; c < BN; c += VW) {
      vf pv = load(w.p.p + i * BN + c);
      vf dsv = pv * (load(w.dp.p + i * BN + c) - dv2);
      store(w.dp.p + i * BN + c, full ? dsv : (pv == splat(0.f) ? splat(0.f) : dsv));
    }
    if (s.prog) {  // through the score_mod: dS = dS(after) * d(mod)/d(score), by the program's reverse mode
      float* dsr = w.dp.p + i * BN;
      prog_run(*s.prog, w.regs.p, w.sraw.p + i * BN, b, h, i0 + i, 0, s.L - 1, j0, 1, s.S - 1);
      prog_grad(*s.prog, w.regs.p, w.grads.p, dsr, w.dsrow.p, w.acc.nt ? &w.acc : nullptr);
      for (int c = 0; c < BN; c += VW)  // where P is 0 the gradient is 0 (never 0 * inf from the program)
        store(dsr + c, load(w.p.p + i * BN + c) == splat(0.f) ? splat(0.f) : load(w.dsrow.p + c));
    }
    if (!full && !(lr[i] < std::numeric_limits<float>::infinity())) {
      mask_row(w.dp.p + i * BN, w.lo[i], w.hi[i], j0, n, 0.f);
      if (tm.bits) mask_bits_row(w.dp.p + i * BN, tm.bits, i, 0.f);
    }
  }
}

// This (key tile, query block) pair's share of dQ (m x Dq) = dS K, unscaled
static void dq_share(long m, long j0, long n, long Dp, bool full, const float* kb, long ldk, BwdBufs& w) {
  const long Dq = round_up(Dp, 16);
  float* dqb = w.dqs.p;
  fill(dqb, dqb + m * Dq, 0.f);
  if (full) {
    gemm(m, Dp, n, w.dp.p, BN, 1, kb, ldk, dqb, Dq);
    return;
  }
  for (long i = 0; i < m; i += R) {
    const long rows = mn<long>(R, m - i);
    long ka, kb2;
    row_keys(w.lo.p, w.hi.p, i, rows, j0, n, ka, kb2);
    if (kb2 > ka)
      gemm((int)rows, (int)Dp, (int)(kb2 - ka), w.dp.p + i * BN + ka, BN, 1, kb + ka * ldk, ldk, dqb + i * Dq, Dq);
  }
}

// One work item: key tile kbk of kv head hk in batch b, visiting its g query heads and every query block of
// their ranges; dK and dV of the tile are written once, here.
static void key_tile_item(const Shape& s, long b, long hk, long kbk, const void* q, const void* k, const void* v,
                          const void* dout, const long* sdo, const float* lse, const float* delta,
                          const TileRange* ranges, int32_t* turns, float* dq, void* dk, void* dv, int gdt,
                          BwdBufs& w, AmxBwd& x, bool amx) {
  (void)x, (void)amx;  // (the builds without AMX tiles)
  const long nq = (s.L + BM - 1) / BM, nk = (s.S + BN - 1) / BN, g = s.H / s.Hkv;
  const long Dp = round_up(s.D, VW), Dvp = round_up(s.Dv, VW), Dq = round_up(Dp, 16);
  const long sdl = sdo[3];  // dO's last-dim stride (1, or e.g. 0 for an expanded gradient)
  const long j0 = kbk * BN, n = mn<long>(BN, s.S - j0);
  const long kro = b * s.sk[0] + hk * s.sk[1] + j0 * s.sk[2];  // this tile's K rows (n x D)
  const long vro = b * s.sv[0] + hk * s.sv[1] + j0 * s.sv[2];  // and V rows (n x Dv)
  const bool f32 = s.dt == AK_F32;  // fp32 rows are read in place where no padding is needed; others widened
  fill(w.dka.p, w.dka.p + BN * Dp, 0.f);
  fill(w.dva.p, w.dva.p + BN * Dvp, 0.f);
  bool packed = false;
  const float* kb = (const float*)k + kro;  // K rows, the right-hand side of dQ = dS K: in place if fp32, unpadded
  long ldk = s.sk[2];
  for (long h = hk * g; h < (hk + 1) * g; h++) {
    const long bh2 = b * s.H + h;
    for (long qb = 0; qb < nq; qb++) {
      const TileRange rg = ranges[bh2 * nq + qb];
      if (kbk < rg.t0 || kbk >= rg.t1) continue;  // never meets this block: not in its turn order
      const long i0 = qb * BM, m = mn<long>(BM, s.L - i0);
      const Block& bl = block_of(s, s.lob ? b : 0, i0, m);
      const TileMask tm = tile_mask(s, b, h, qb, kbk, nk);
      block_edges(s, b, i0, m, w.lo.p, w.hi.p);
      const bool full = !tm.bits && n == BN && j0 >= bl.flo && j0 + n <= bl.fhi;
      const bool meets = tm.kind != T_EMPTY && (full || tile_touched(w.lo.p, w.hi.p, m, j0, j0 + n));
#if AK_BDOT
      if (meets && amx) {  // the five products on bf16 tiles (attn_amx.h); P, dS rounded to bf16 where multiplied
        // (S's and dP's depths D32, Dv32: D and Dv rounded up to 32, the operands zero past them)
        const long D32 = round_up(s.D, 32), Dv32 = round_up(s.Dv, 32);
        if (!packed) {  // this tile's K^T and V^T as pairs along D (S, dP) and K as pairs of keys (dQ)
          pack_q_pairs(x.ktp.p, k, kro, s.sk[2], n, s.D);
          pack_q_pairs(x.vtp.p, v, vro, s.sv[2], n, s.Dv);
          rows16(x.k16.p, s.D, k, kro, s.sk[2], 1, n, s.D);
          row_pairs(x.kp.p, x.k16.p, s.D, s.D);
          packed = true;
        }
        rows16(x.q16.p, D32, q, b * s.sq[0] + h * s.sq[1] + i0 * s.sq[2], s.sq[2], 1, m, s.D);
        rows16(x.do16.p, Dv32, dout, b * sdo[0] + h * sdo[1] + i0 * sdo[2], sdo[2], sdl, m, s.Dv);
        amx_gemm<true>(BM, BN, D32, x.q16.p, D32, x.ktp.p, BN, w.p.p, BN);  // S = Q K^T
        probabilities(s, b, h, i0, m, j0, n, full, tm, nullptr, 0, nullptr, lse + bh2 * s.L + i0, w);
        amx_gemm<true>(BM, BN, Dv32, x.do16.p, Dv32, x.vtp.p, BN, w.dp.p, BN);  // dP = dO V^T
        row_pairs(x.dop.p, x.do16.p, Dv32, s.Dv);
        t_bf16(x.pt.p, w.p.p, m);
        amx_gemm<false>(BN, s.Dv, BM, x.pt.p, BM, x.dop.p, s.Dv, w.dva.p, Dvp);  // dV += P^T dO
        score_grads(s, b, h, i0, m, j0, n, full, tm, nullptr, 0, nullptr, delta + bh2 * s.L + i0,
                    lse + bh2 * s.L + i0, w);
        row_pairs(x.qp.p, x.q16.p, D32, s.D);
        t_bf16(x.pt.p, w.dp.p, m);
        amx_gemm<false>(BN, s.D, BM, x.pt.p, BM, x.qp.p, s.D, w.dka.p, Dp);  // dK += dS^T Q (scaled at the end)
        rows_bf16(x.ds.p, w.dp.p, m);
        amx_gemm<true>(BM, s.D, BN, x.ds.p, BN, x.kp.p, s.D, w.dqs.p, Dq);  // dQ's share = dS K
      } else
#endif
      if (meets) {
        if (!packed) {  // this tile's K^T and V^T (zero beyond n keys; pack_t: BN == BM), K rows padded if needed
          if (Dp != s.D || !f32) {  // K rows widened / padded once (dQ's right-hand side)
            fill(w.kp.p, w.kp.p + BN * Dp, 0.f);
            pack_rows(w.kp.p, k, kro, s.sk[2], n, s.D, Dp, s.dt);
            kb = w.kp.p, ldk = Dp;
          }
          pack_t(w.kt.p, k, kro, s.sk[2], n, s.D, s.dt);
          pack_t(w.vt.p, v, vro, s.sv[2], n, s.Dv, s.dt);
          packed = true;
        }
        const long qs = b * s.sq[0] + h * s.sq[1] + i0 * s.sq[2];
        const long ds = b * sdo[0] + h * sdo[1] + i0 * sdo[2];
        const float* q_rows = (const float*)q + qs;  // Q rows (m x D): the left side of S, the right of dK = dS^T Q
        long ldq = s.sq[2];
        if (Dp != s.D || !f32) {
          pack_rows(w.qr.p, q, qs, s.sq[2], m, s.D, Dp, s.dt);
          q_rows = w.qr.p, ldq = Dp;
        }
        const float* do_rows = (const float*)dout + ds;
        long lddo = sdo[2];
        if (Dvp != s.Dv || sdl != 1 || !f32) {
          for (long i = 0; i < m; i++) {
            widen_strided(w.dor.p + i * Dvp, dout, ds + i * sdo[2], s.Dv, sdl, s.dt);
            fill(w.dor.p + i * Dvp + s.Dv, w.dor.p + (i + 1) * Dvp, 0.f);
          }
          do_rows = w.dor.p, lddo = Dvp;
        }
        probabilities(s, b, h, i0, m, j0, n, full, tm, q_rows, ldq, w.kt.p, lse + bh2 * s.L + i0, w);
        // dV += P^T dO
        if (full)
          gemm(n, Dvp, m, w.p.p, 1, BN, do_rows, lddo, w.dva.p, Dvp);
        else
          by_queries_trimmed(n, m, j0, Dvp, w.p.p, do_rows, lddo, w.dva.p, Dvp, w.lo.p, w.hi.p);
        score_grads(s, b, h, i0, m, j0, n, full, tm, do_rows, lddo, w.vt.p, delta + bh2 * s.L + i0,
                    lse + bh2 * s.L + i0, w);
        // dK += dS^T Q (the softmax scale applied once, at the end)
        if (full)
          gemm(n, Dp, m, w.dp.p, 1, BN, q_rows, ldq, w.dka.p, Dp);
        else
          by_queries_trimmed(n, m, j0, Dp, w.dp.p, q_rows, ldq, w.dka.p, Dp, w.lo.p, w.hi.p);
        dq_share(m, j0, n, Dp, full, kb, ldk, w);
      }
      int32_t* turn = turns + bh2 * nq + qb;
      wait_turn(turn, (int32_t)kbk);
      if (meets) {
        float* dst = dq + (bh2 * s.L + i0) * s.D;
        for (long i = 0; i < m; i++)
          for (long d = 0; d < s.D; d++) dst[i * s.D + d] += w.dqs[i * Dq + d];
      }
      __atomic_store_n(turn, (int32_t)kbk + 1, __ATOMIC_RELEASE);
    }
  }
  const long dko = ((b * s.Hkv + hk) * s.S + j0) * s.D, dvo = ((b * s.Hkv + hk) * s.S + j0) * s.Dv;
  for (long j = 0; j < n; j++) {  // dK scaled in fp32, then written (rounded once where gdt is bf16 / fp16)
    float* kr = w.dka.p + j * Dp;
    for (long d = 0; d < s.D; d++) kr[d] *= s.scale;
    narrow_row(dk, dko + j * s.D, kr, s.D, gdt);
    narrow_row(dv, dvo + j * s.Dv, w.dva.p + j * Dvp, s.Dv, gdt);
  }
}

static int backward(const Shape& s, const void* q, const void* k, const void* v, const void* dout,
                    const long* sdo, const float* out, const float* lse, const float* dlse, void* dq_out, void* dk,
                    void* dv, bool rounded) {
  const long nq = (s.L + BM - 1) / BM, nk = (s.S + BN - 1) / BN;
  const long Dp = round_up(s.D, VW), Dvp = round_up(s.Dv, VW), Dq = round_up(Dp, 16);
  const long nblk = s.B * s.H * nq, chains = s.B * s.Hkv, items = chains * nk;
  // bf16 products on AMX tiles (attn_amx.h): as the forward's where D and Dv are multiples of 16 (the column counts
  // of dK, dQ and dV; S's and dP's depths zero-padded to multiples of 32)
  const bool amx = AK_BDOT && s.bdot && s.D % 16 == 0 && s.Dv % 16 == 0;
  float* delta = scratch<float>(0, s.B * s.H * s.L);
  int32_t* turns = scratch<int32_t>(1, nblk);
  TileRange* ranges = scratch<TileRange>(2, nblk);
  // dQ is summed in fp32: in dq itself, or (rounded grads) in a buffer of this call's, rounded into dq at the end
  const int gdt = rounded ? s.dt : AK_F32;
  float* dqa = gdt == AK_F32 ? (float*)dq_out : (float*)malloc((size_t)s.B * s.H * s.L * s.D * sizeof(float));
  if (!delta || !turns || !ranges || !dqa) {
    if (gdt != AK_F32) free(dqa);
    return AK_E_NOMEM;  // the caller raises
  }
  float* dq = dqa;
  key_tile_ranges(s, ranges);
  for (long i = 0; i < nblk; i++) turns[i] = ranges[i].t0;
  prepare_rows(s, dout, sdo, out, dlse, delta, dq);
  int32_t item_turn = 0;
#pragma omp parallel num_threads(s.threads) if (s.threads > 1 && items > 1)
  {
    BwdBufs w(s.D, s.Dv, Dp, Dvp, Dq, s.prog);
    AmxBwd x(amx, s.D, s.Dv);
#if AK_BDOT
    const TileScope tiles(amx);
#endif
    // items in key-tile-major order: consecutive items are other (batch, kv head) chains, whose dQ turns are
    // independent, and within a chain the key tiles are taken in increasing order (see wait_turn)
#pragma omp for schedule(dynamic, 1)
    for (long it = 0; it < items; it++) {
      const long kbk = it / chains, bh = it % chains;
      key_tile_item(s, bh / s.Hkv, bh % s.Hkv, kbk, q, k, v, dout, sdo, lse, delta, ranges, turns, dq, dk, dv, gdt,
                    w, x, amx);
      if (w.acc.nt) {  // the tables' gradients are summed item by item, in item order: the same bits every run
        wait_turn(&item_turn, (int32_t)it);
        w.flush(*s.prog);
        __atomic_store_n(&item_turn, (int32_t)it + 1, __ATOMIC_RELEASE);
      }
    }
  }
  // dQ = scale * the sum of the pairs' shares
#pragma omp parallel for schedule(static) num_threads(s.threads) if (s.threads > 1 && nblk > 1)
  for (long it = 0; it < nblk; it++) {
    const long qb = it % nq, bh = it / nq;
    const long i0 = qb * BM, m = mn<long>(BM, s.L - i0);
    float* dst = dq + (bh * s.L + i0) * s.D;
    for (long e = 0; e < m * s.D; e++) dst[e] *= s.scale;
    if (gdt != AK_F32) narrow_row(dq_out, (bh * s.L + i0) * s.D, dst, m * s.D, gdt);
  }
  if (gdt != AK_F32) free(dqa);
  return AK_OK;
}

}  // namespace AK_NS
