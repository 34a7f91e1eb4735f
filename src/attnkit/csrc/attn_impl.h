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
// Layout: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), fp32, last dimension contiguous,
// any other strides (given in elements). GQA: query head h reads kv head h / (H / Hkv), no copy.
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
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// register block of the micro-GEMM: R rows x NC vectors (AVX-512: 6 x 4 zmm = 24 accumulators)
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

// Scratch memory kept between calls (per calling thread, per slot): the backward's delta and lock flags
// (B*H*L floats); fresh pages cost a fault and a zeroing each. Grows to the largest call seen;
// ak_release_scratch() gives it back.
struct Arena {
  void* p = nullptr;
  size_t cap = 0;
  ~Arena() { free(p); }
};
static thread_local Arena arenas[2];  // slot 0: delta, slot 1: the dQ lock flags

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

struct Shape {
  long B, H, Hkv, L, S, D, Dv;
  long sq[3], sk[3], sv[3];  // strides (elements) of batch, head, row; the last dimension is contiguous
  const int32_t* lo;
  const int32_t* hi;
  long lob;  // batch stride of lo/hi (0: shared by the batch, or L)
  float scale;
  int threads;
  const float* alibi;  // (H,) ALiBi slopes: score + slope[h] * (kv - q), or null
};

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

// Q^T of a query block (D x BM), zero in the padding columns
static inline void pack_t(float* dst, const float* src, long stride, long m, long D) {
  for (long i = 0; i < m; i++) {
    const float* r = src + i * stride;
    for (long d = 0; d < D; d++) dst[d * BM + i] = r[d];
  }
  if (m < BM)
    for (long d = 0; d < D; d++) fill(dst + d * BM + m, dst + d * BM + BM, 0.f);
}

// rows (m x X) into an (m x Xp) buffer, zero-padded columns
static inline void pack_rows(float* dst, const float* src, long stride, long m, long X, long Xp) {
  for (long i = 0; i < m; i++) {
    std::memcpy(dst + i * Xp, src + i * stride, X * sizeof(float));
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

// ---------------------------------------------------------------------------------------------------
// forward: out (B, H, L, Dv) contiguous, lse (B, H, L) contiguous
// ---------------------------------------------------------------------------------------------------
static void forward(const Shape& s, const float* q, const float* k, const float* v, float* out, float* lse) {
  const long nq = (s.L + BM - 1) / BM, g = s.H / s.Hkv;
  const long Dvp = round_up(s.Dv, VW);
  const long items = s.B * s.H * nq;
  const bool v_in_place = Dvp == s.Dv, ab = s.alibi != nullptr;
#pragma omp parallel num_threads(s.threads) if (s.threads > 1 && items > 1)
  {
    Buf<float> qt(s.D * BM), st(BN * BM), vp(v_in_place ? 1 : BN * Dvp), acc(BM * Dvp), mrow(BM), lrow(BM);
    Buf<int32_t> lo(BM), hi(BM);
#pragma omp for schedule(dynamic, 1)
    for (long it = 0; it < items; it++) {
      const long qb = nq - 1 - it % nq, bh = it / nq, b = bh / s.H, h = bh % s.H, hk = h / g;
      const long i0 = qb * BM, m = mn<long>(BM, s.L - i0);
      float* o = out + ((b * s.H + h) * s.L + i0) * s.Dv;
      float* ls = lse + (b * s.H + h) * s.L + i0;
      const Block blk = block_of(s, b, i0, m);
      if (blk.kmin >= blk.kmax) {  // no row of this block sees a key
        fill(o, o + m * s.Dv, 0.f);
        fill(ls, ls + m, NEG_INF);
        continue;
      }
      block_edges(s, b, i0, m, lo.p, hi.p);
      Edges edges;
      edges_of(edges, lo.p, hi.p);
      pack_t(qt.p, q + b * s.sq[0] + h * s.sq[1] + i0 * s.sq[2], s.sq[2], m, s.D);
      fill(acc.p, acc.p + BM * Dvp, 0.f);
      fill(mrow.p, mrow.p + BM, NEG_INF);
      fill(lrow.p, lrow.p + BM, 0.f);
      const float* kb = k + b * s.sk[0] + hk * s.sk[1];
      const float* vb = v + b * s.sv[0] + hk * s.sv[1];
      for (long j0 = blk.kmin / BN * BN; j0 < blk.kmax; j0 += BN) {
        const long n = mn<long>(BN, s.S - j0);
        const bool full = n == BN && j0 >= blk.flo && j0 + n <= blk.fhi;
        if (!full && !tile_touched(lo.p, hi.p, m, j0, j0 + n)) continue;
        if (full) {
          gemm<true>(n, BM, s.D, kb + j0 * s.sk[2], s.sk[2], 1, qt.p, BM, st.p, BM);  // S^T = K Q^T
        } else {
          scores_trimmed(n, j0, (int)s.D, kb + j0 * s.sk[2], s.sk[2], qt.p, st.p, edges);
          mask_tile(st.p, n, j0, lo.p, hi.p);
        }
        // Scores and their running max stay in natural units, s = fl(q.k) * scale as every other path
        // rounds them (so lse = max + log(sum) matches a softmax recomputed from these scores to the
        // last bits: weights rebuilt as exp(s - lse) agree); only the exponent goes to base 2.
        const vf sc = splat(s.scale), l2e = splat(LOG2E), sl = splat(ab ? s.alibi[h] : 0.f);
        for (int cc = 0; cc < BM; cc += VW) {  // online softmax, VW queries at a time
          vf mx = splat(NEG_INF);
          const vi qi = splati((int32_t)(i0 + cc)) + iota();
          for (long j = 0; j < n; j++) {
            vf x = scored(load(st.p + j * BM + cc), sc, ab, sl, splati((int32_t)(j0 + j)) - qi);
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
          for (int r = 0; r < VW; r++) {
            const float a = alpha[r];
            if (a != 1.f) {
              float* ar = acc.p + (cc + r) * Dvp;
              vf av = splat(a);
              for (long d = 0; d < Dvp; d += VW) store(ar + d, load(ar + d) * av);
            }
          }
        }
        const float* vt = vb + j0 * s.sv[2];
        long ldv = s.sv[2];
        if (!v_in_place) {
          pack_rows(vp.p, vt, s.sv[2], n, s.Dv, Dvp);
          vt = vp.p, ldv = Dvp;
        }
        if (full)
          gemm(m, Dvp, n, st.p, 1, BM, vt, ldv, acc.p, Dvp);  // O += P V, P(i, j) = S^T[j][i]
        else
          by_keys_trimmed(m, n, j0, Dvp, st.p, vt, ldv, acc.p, Dvp, edges);
      }
      for (long i = 0; i < m; i++) {
        if (lrow.p[i] == 0.f) {
          fill(o + i * s.Dv, o + (i + 1) * s.Dv, 0.f);
          ls[i] = NEG_INF;
          continue;
        }
        const float inv = 1.f / lrow.p[i];
        for (long d = 0; d < s.Dv; d++) o[i * s.Dv + d] = acc.p[i * Dvp + d] * inv;
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
// the thread's own and added into dq under that query block's lock (a spin flag, held for the 64 x D
// add only), so no per-thread copy of dQ exists; work items are dealt so that threads work far apart.
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
static inline void mask_row(float* srow, int32_t lo, int32_t hi, long j0, long n) {
  vi lov = splati(lo), hiv = splati((int32_t)mn<long>(hi, j0 + n));
  for (int c = 0; c < BN; c += VW) {
    vi j = splati((int32_t)(j0 + c)) + iota();
    vi keep = (j >= lov) & (j < hiv);
    store(srow + c, keep ? load(srow + c) : splat(NEG_INF));
  }
}

static int backward(const Shape& s, const float* q, const float* k, const float* v, const float* dout,
                    const long* sdo, const float* out, const float* lse, const float* dlse, float* dq, float* dk,
                    float* dv) {
  const long nq = (s.L + BM - 1) / BM, nk = (s.S + BN - 1) / BN, g = s.H / s.Hkv;
  const long Dp = round_up(s.D, VW), Dvp = round_up(s.Dv, VW), Dq = round_up(s.D, 16);
  const long Bl = s.lob ? s.B : 1;
  Buf<Block> blocks(Bl * nq);
  for (long b = 0; b < Bl; b++)
    for (long qb = 0; qb < nq; qb++) blocks[b * nq + qb] = block_of(s, b, qb * BM, mn<long>(BM, s.L - qb * BM));
  const long items = s.B * s.Hkv * nk;
  const bool ab = s.alibi != nullptr;
  const long nblk = s.B * s.H * nq;
  const int T = s.threads > 1 ? s.threads : 1;
  const long sdl = sdo[3];  // dO's last-dim stride (1, or e.g. 0 for an expanded gradient)
  float* delta = scratch<float>(0, s.B * s.H * s.L);
  uint8_t* locks = scratch<uint8_t>(1, nblk);
  if (!delta || !locks) return 1;  // out of memory: the caller raises
  std::memset(locks, 0, (size_t)nblk);
#pragma omp parallel for schedule(dynamic, 16) num_threads(s.threads) if (s.threads > 1 && nblk > 1)
  for (long it = 0; it < nblk; it++) {  // delta = rowsum(dO * O) - dlse; dq = 0
    const long qb = it % nq, bh = it / nq, b = bh / s.H, h = bh % s.H;
    const long i0 = qb * BM, m = mn<long>(BM, s.L - i0);
    const float* ds = dout + b * sdo[0] + h * sdo[1] + i0 * sdo[2];
    const float* o = out + (bh * s.L + i0) * s.Dv;
    for (long i = 0; i < m; i++) {
      float acc = 0.f;
      for (long d = 0; d < s.Dv; d++) acc += ds[i * sdo[2] + d * sdl] * o[i * s.Dv + d];
      delta[bh * s.L + i0 + i] = acc - (dlse ? dlse[bh * s.L + i0 + i] : 0.f);
    }
    fill(dq + (bh * s.L + i0) * s.D, dq + (bh * s.L + i0 + m) * s.D, 0.f);
  }
#pragma omp parallel num_threads(s.threads) if (s.threads > 1 && items > 1)
  {
    int t = 0;
#ifdef _OPENMP
    t = omp_get_thread_num();
#endif
    Buf<float> kt(s.D * BN), vt(s.Dv * BN), kp(BN * Dp), qr(BM * Dp), dor(BM * Dvp), p(BM * BN), dp(BM * BN),
        dka(BN * Dp), dva(BN * Dvp), dqs(BM * Dq);
    Buf<int32_t> lo(BM), hi(BM);
    // item order: T interleaved sweeps, so that threads taking consecutive items work on key tiles far
    // apart (their query blocks, and so their dQ locks, rarely meet)
    const long per = (items + T - 1) / T;
#pragma omp for schedule(dynamic, 1)
    for (long it0 = 0; it0 < items; it0++) {
      const long it = (it0 % T) * per + it0 / T;
      if (it >= items) continue;
      const long kbk = it % nk, bh = it / nk, b = bh / s.Hkv, hk = bh % s.Hkv;
      const long j0 = kbk * BN, n = mn<long>(BN, s.S - j0);
      const float* kr = k + b * s.sk[0] + hk * s.sk[1] + j0 * s.sk[2];  // this tile's K rows (n x D)
      const float* vr = v + b * s.sv[0] + hk * s.sv[1] + j0 * s.sv[2];  // and V rows (n x Dv)
      float* dkr = dk + ((b * s.Hkv + hk) * s.S + j0) * s.D;
      float* dvr = dv + ((b * s.Hkv + hk) * s.S + j0) * s.Dv;
      fill(dka.p, dka.p + BN * Dp, 0.f);
      fill(dva.p, dva.p + BN * Dvp, 0.f);
      bool packed = false;
      const float* kb = kr;  // K rows as the right-hand side of dQ = dS K: in place unless D needs padding
      long ldk = s.sk[2];
      for (long h = hk * g; h < (hk + 1) * g; h++) {
        for (long qb = 0; qb < nq; qb++) {
          const Block& bl = blocks[(s.lob ? b : 0) * nq + qb];
          if (!(bl.kmin < j0 + n && bl.kmax > j0)) continue;
          const long i0 = qb * BM, m = mn<long>(BM, s.L - i0);
          block_edges(s, b, i0, m, lo.p, hi.p);
          const bool full = n == BN && j0 >= bl.flo && j0 + n <= bl.fhi;
          if (!full && !tile_touched(lo.p, hi.p, m, j0, j0 + n)) continue;
          if (!packed) {  // this tile's K^T and V^T (zero beyond n keys), and K rows padded if needed
            fill(kt.p, kt.p + s.D * BN, 0.f);
            fill(vt.p, vt.p + s.Dv * BN, 0.f);
            for (long j = 0; j < n; j++) {
              for (long d = 0; d < s.D; d++) kt[d * BN + j] = kr[j * s.sk[2] + d];
              for (long d = 0; d < s.Dv; d++) vt[d * BN + j] = vr[j * s.sv[2] + d];
            }
            if (Dp != s.D) {
              fill(kp.p, kp.p + BN * Dp, 0.f);
              pack_rows(kp.p, kr, s.sk[2], n, s.D, Dp);
              kb = kp.p, ldk = Dp;
            }
            packed = true;
          }
          const long bh2 = b * s.H + h;
          const float* qs = q + b * s.sq[0] + h * s.sq[1] + i0 * s.sq[2];
          const float* ds = dout + b * sdo[0] + h * sdo[1] + i0 * sdo[2];
          const float* lr = lse + bh2 * s.L + i0;
          const float* dr = delta + bh2 * s.L + i0;
          const float* q_rows = qs;  // Q rows (m x D): the left side of S, the right side of dK = dS^T Q
          long ldq = s.sq[2];
          if (Dp != s.D) {
            pack_rows(qr.p, qs, s.sq[2], m, s.D, Dp);
            q_rows = qr.p, ldq = Dp;
          }
          const float* do_rows = ds;
          long lddo = sdo[2];
          if (Dvp != s.Dv || sdl != 1) {
            for (long i = 0; i < m; i++) {
              for (long d = 0; d < s.Dv; d++) dor[i * Dvp + d] = ds[i * sdo[2] + d * sdl];
              fill(dor.p + i * Dvp + s.Dv, dor.p + (i + 1) * Dvp, 0.f);
            }
            do_rows = dor.p, lddo = Dvp;
          }
          // P = exp(scale Q K^T (+ ALiBi) - lse), masked; a row that sees nothing (lse = -inf) is 0
          if (full)
            gemm<true>(m, BN, s.D, q_rows, ldq, 1, kt.p, BN, p.p, BN);
          else
            rows_trimmed(m, j0, n, (int)s.D, q_rows, ldq, kt.p, p.p, lo.p, hi.p);
          const vf sc = splat(s.scale), l2e = splat(LOG2E);
          const float slope = ab ? s.alibi[h] : 0.f;
          for (long i = 0; i < m; i++) {
            float* pr = p.p + i * BN;
            if (lr[i] == NEG_INF) {
              fill(pr, pr + BN, 0.f);
              continue;
            }
            if (!full) mask_row(pr, lo[i], hi[i], j0, n);
            const vf lv = splat(lr[i]), sl = splat(slope);
            const vi qi = splati((int32_t)(i0 + i));
            for (int c = 0; c < BN; c += VW) {
              vf x = scored(load(pr + c), sc, ab, sl, splati((int32_t)(j0 + c)) + iota() - qi);
              store(pr + c, exp2v((x - lv) * l2e));
            }
          }
          // dV += P^T dO
          if (full) {
            gemm(n, Dvp, m, p.p, 1, BN, do_rows, lddo, dva.p, Dvp);
          } else {
            by_queries_trimmed(n, m, j0, Dvp, p.p, do_rows, lddo, dva.p, Dvp, lo.p, hi.p);
          }
          // dP = dO V^T ; dS = P * (dP - delta)   (where P is 0, dS is 0: never 0 * garbage)
          if (full)
            gemm<true>(m, BN, s.Dv, do_rows, lddo, 1, vt.p, BN, dp.p, BN);
          else
            rows_trimmed(m, j0, n, (int)s.Dv, do_rows, lddo, vt.p, dp.p, lo.p, hi.p);
          for (long i = 0; i < m; i++) {
            const vf dv2 = splat(dr[i]);
            for (int c = 0; c < BN; c += VW) {
              vf pv = load(p.p + i * BN + c);
              vf dsv = pv * (load(dp.p + i * BN + c) - dv2);
              store(dp.p + i * BN + c, full ? dsv : (pv == splat(0.f) ? splat(0.f) : dsv));
            }
          }
          // dK += dS^T Q ; dQ += dS K   (the softmax scale applied once, at the end)
          const long blk = bh2 * nq + qb;
          float* dqb = dqs.p;  // this pair's share of dQ, added into dq under the block's lock below
          const long lddq = Dq;
          fill(dqb, dqb + m * Dq, 0.f);
          if (full) {
            gemm(n, Dp, m, dp.p, 1, BN, q_rows, ldq, dka.p, Dp);
            gemm(m, Dp, n, dp.p, BN, 1, kb, ldk, dqb, lddq);
          } else {
            by_queries_trimmed(n, m, j0, Dp, dp.p, q_rows, ldq, dka.p, Dp, lo.p, hi.p);
            for (long i = 0; i < m; i += R) {
              const long rows = mn<long>(R, m - i);
              long ka, kb2;
              row_keys(lo.p, hi.p, i, rows, j0, n, ka, kb2);
              if (kb2 > ka)
                gemm((int)rows, (int)Dp, (int)(kb2 - ka), dp.p + i * BN + ka, BN, 1, kb + ka * ldk, ldk,
                     dqb + i * lddq, lddq);
            }
          }
          float* dst = dq + (bh2 * s.L + i0) * s.D;
          while (__atomic_test_and_set(&locks[blk], __ATOMIC_ACQUIRE)) {
          }
          for (long i = 0; i < m; i++)
            for (long d = 0; d < s.D; d++) dst[i * s.D + d] += dqb[i * lddq + d];
          __atomic_clear(&locks[blk], __ATOMIC_RELEASE);
        }
      }
      for (long j = 0; j < n; j++) {
        for (long d = 0; d < s.D; d++) dkr[j * s.D + d] = dka[j * Dp + d] * s.scale;
        std::memcpy(dvr + j * s.Dv, &dva[j * Dvp], s.Dv * sizeof(float));
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
  }
  return 0;
}

}  // namespace AK_NS
