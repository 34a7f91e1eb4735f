// How close can a long-cache decode step come to reading its K and V cache on this machine, in the decode entry's
// loop shapes and in plainer ones? Real dot products and P.V (the decode entry's dots_keys / pv_keys shapes:
// csrc/attn_decode.h), a trivial softmax, no masks or bookkeeping: a floor under what the decode entry can reach with
// these loops, against a tight read of the same K and V (BENCHMARKS.md, twenty-second session).
//
// K and V: HKV = 8 heads x S = 65 536 keys x D = 128 fp32 each (268 MB each, from memory). R query rows per kv head
// (R = 1: MHA's one query row; R = 4: a GQA group of 4). Work items (head, chunk of CH keys) over the OpenMP threads,
// schedule(dynamic, 1), as the decode entry hands out its (unit, chunk) items. Printed, medians of 5 interleaved
// repeats (ms), and each / "read":
//
//   read      one float of every 32 bytes of K and of V, both streams in one loop (decode_arith.cpp's read)
//   sum       K summed, then V, 64 floats an iteration (stream_overlap.cpp's read: slower, a reduction per 256 B)
//   tile+pf   per 64-key tile: scores (dots), softmax, P.V (pv), the next tile's K and V rows prefetched into L2
//             as this one is read (the decode entry's shape)
//   tile      the same, no prefetch
//   chunk     the chunk's K pass whole (scores of CH keys), one softmax, then its V pass whole; no prefetch
//   chunk+pvc the chunk's K pass, then P.V register-blocked over column blocks of each 64-key tile (no stores)
//   chunk+pf  "chunk" with each row's twin PF rows ahead prefetched
//
//   g++ -O3 -mavx2 -mfma -fopenmp benchmarks/decode_shapes.cpp -o /tmp/decode_shapes
//   OMP_NUM_THREADS=2 /tmp/decode_shapes [CH=1024] [PF=16]
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "decode_synth.h"

static const long D = 128, HKV = 8, S = 65536, BN = 64;
static long CH = 1024, PF = 16;

static inline void prefetch_row(const float* r) { prefetch_bytes(r, D * 4); }

// sc[r * lds + j] = q_r . k_j for n keys (a multiple of 8) at kb, KP keys side by side (dots_keys); pf: each key's
// twin pfd rows ahead prefetched
template <int R>
static void dots(const float* kb, long n, const float* q, float* sc, long lds, bool pf, long pfd) {
  constexpr int KP = R <= 2 ? 4 : R <= 4 ? 2 : 1;
  for (long g = 0; g < n; g += 8) {
    __m256 part[R][8];
    for (int t0 = 0; t0 < 8; t0 += KP) {
      const float* kr[KP];
      for (int t = 0; t < KP; t++) {
        kr[t] = kb + (g + t0 + t) * D;
        if (pf) prefetch_row(kr[t] + pfd * D);
      }
      __m256 a[R][KP];
      for (int r = 0; r < R; r++)
        for (int t = 0; t < KP; t++) a[r][t] = _mm256_setzero_ps();
      for (int d = 0; d < D; d += 8) {
        __m256 x[KP];
        for (int t = 0; t < KP; t++) x[t] = _mm256_loadu_ps(kr[t] + d);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
          const __m256 qv = _mm256_load_ps(q + r * D + d);
          for (int t = 0; t < KP; t++) a[r][t] = _mm256_fmadd_ps(qv, x[t], a[r][t]);
        }
      }
      for (int r = 0; r < R; r++)
        for (int t = 0; t < KP; t++) part[r][t0 + t] = a[r][t];
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(sc + r * lds + g, reduce8(part[r]));
  }
}

// a stand-in softmax: each row's max subtracted, scaled (the decode's exp and sums cost little beside the reads)
template <int R>
static void soft(float* sc, long n, long lds) {
  for (int r = 0; r < R; r++) {
    __m256 m = _mm256_set1_ps(-1e30f);
    for (long j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sc + r * lds + j));
    for (long j = 0; j < n; j += 8)
      _mm256_storeu_ps(sc + r * lds + j, _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(sc + r * lds + j), m),
                                                       _mm256_set1_ps(1e-3f)));
  }
}

// acc += P V over n keys at vb, KJ keys at a time, the accumulators loaded and stored around them (pv_keys)
template <int R>
static void pv_keys(const float* vb, long n, const float* p, long lds, float* acc, bool pf, long pfd) {
  constexpr int KJ = R >= 4 ? 2 : 4;
  for (long j = 0; j < n; j += KJ) {
    if (pf)
      for (int t = 0; t < KJ; t++) prefetch_row(vb + (j + t + pfd) * D);
    __m256 pr[R][KJ];
    for (int r = 0; r < R; r++)
      for (int t = 0; t < KJ; t++) pr[r][t] = _mm256_set1_ps(p[r * lds + j + t]);
    for (int c = 0; c < D; c += 8) {
      __m256 x[KJ];
      for (int t = 0; t < KJ; t++) x[t] = _mm256_loadu_ps(vb + (j + t) * D + c);
#pragma GCC unroll 8
      for (int r = 0; r < R; r++) {
        __m256 a = _mm256_load_ps(acc + r * D + c);
        for (int t = 0; t < KJ; t++) a = _mm256_fmadd_ps(pr[r][t], x[t], a);
        _mm256_store_ps(acc + r * D + c, a);
      }
    }
  }
}

// acc += P V over n keys, register-blocked: column blocks of NV vectors held in registers over all n keys
template <int R>
static void pv_cols(const float* vb, long n, const float* p, long lds, float* acc) {
  constexpr int NV = R == 1 ? 8 : R == 2 ? 4 : R <= 4 ? 2 : 1;
  for (int c0 = 0; c0 < D; c0 += NV * 8) {
    __m256 a[R][NV];
    for (int r = 0; r < R; r++)
      for (int c = 0; c < NV; c++) a[r][c] = _mm256_load_ps(acc + r * D + c0 + c * 8);
    for (long j = 0; j < n; j++) {
      __m256 x[NV];
      for (int c = 0; c < NV; c++) x[c] = _mm256_loadu_ps(vb + j * D + c0 + c * 8);
      for (int r = 0; r < R; r++) {
        const __m256 pp = _mm256_set1_ps(p[r * lds + j]);
        for (int c = 0; c < NV; c++) a[r][c] = _mm256_fmadd_ps(pp, x[c], a[r][c]);
      }
    }
    for (int r = 0; r < R; r++)
      for (int c = 0; c < NV; c++) _mm256_store_ps(acc + r * D + c0 + c * 8, a[r][c]);
  }
}

enum Shape { TILE_PF, TILE, CHUNK, CHUNK_PVC, CHUNK_PF };

template <int R, Shape M>
static double decode(const float* K, const float* V) {
  const auto t0 = std::chrono::steady_clock::now();
  const long per = S / CH, items = HKV * per;
  double sink = 0;
#pragma omp parallel for reduction(+ : sink) schedule(dynamic, 1)
  for (long it = 0; it < items; it++) {
    const long h = it / per, c = it % per;
    const float* kb = K + (h * S + c * CH) * D;
    const float* vb = V + (h * S + c * CH) * D;
    alignas(64) static thread_local float q[8 * D], acc[8 * D], sc[8 * 8192];
    for (int i = 0; i < R * D; i++) q[i] = 0.01f * (float)(i % 7), acc[i] = 0.f;
    if (M == TILE_PF || M == TILE) {
      for (long j0 = 0; j0 < CH; j0 += BN) {
        const bool nx = M == TILE_PF && j0 + BN < CH;
        dots<R>(kb + j0 * D, BN, q, sc, BN, nx, BN);
        soft<R>(sc, BN, BN);
        pv_keys<R>(vb + j0 * D, BN, sc, BN, acc, nx, BN);
      }
    } else {
      dots<R>(kb, CH, q, sc, CH, M == CHUNK_PF, PF);
      soft<R>(sc, CH, CH);
      if (M == CHUNK_PVC)
        for (long j0 = 0; j0 < CH; j0 += BN) pv_cols<R>(vb + j0 * D, BN, sc + j0, CH, acc);
      else
        pv_keys<R>(vb, CH, sc, CH, acc, M == CHUNK_PF, PF);
    }
    sink += acc[5] + acc[R * D - 1];
  }
  const auto t1 = std::chrono::steady_clock::now();
  if (sink == 1.2345) std::printf(" ");  // (the sums are used)
  return std::chrono::duration<double>(t1 - t0).count();
}

static double read(const float* K, const float* V) {
  const auto t0 = std::chrono::steady_clock::now();
  const long n = HKV * S * D;
  double s = 0;
#pragma omp parallel for reduction(+ : s)
  for (long i = 0; i < n; i += 8) s += K[i] + V[i];
  const auto t1 = std::chrono::steady_clock::now();
  if (s == 1.2345) std::printf(" ");
  return std::chrono::duration<double>(t1 - t0).count();
}

static double sum(const float* K, const float* V) { return sum_kv(K, V, HKV * S * D); }

template <int R>
static void line(const float* K, const float* V, int reps) {
  typedef double (*Fn)(const float*, const float*);
  const Fn fs[] = {read, sum, decode<R, TILE_PF>, decode<R, TILE>, decode<R, CHUNK>, decode<R, CHUNK_PVC>,
                   decode<R, CHUNK_PF>};
  const char* names[] = {"read", "sum", "tile+pf", "tile", "chunk", "chunk+pvc", "chunk+pf"};
  const int nf = 7;
  std::vector<std::vector<double>> t(nf);
  for (int r = 0; r < reps; r++)
    for (int i = 0; i < nf; i++) t[i].push_back(fs[i](K, V));
  std::vector<double> med(nf);
  for (int i = 0; i < nf; i++) {
    std::sort(t[i].begin(), t[i].end());
    med[i] = t[i][t[i].size() / 2];
  }
  std::printf("R = %d:", R);
  for (int i = 0; i < nf; i++) std::printf("  %s %.1f (%.2f)", names[i], med[i] * 1e3, med[i] / med[0]);
  std::printf("\n");
}

int main(int argc, char** argv) {
  if (argc > 1) CH = std::atol(argv[1]);
  if (argc > 2) PF = std::atol(argv[2]);
  const size_t n = HKV * S * D;
  float* K = (float*)std::aligned_alloc(64, n * 4);
  float* V = (float*)std::aligned_alloc(64, n * 4);
  for (size_t i = 0; i < n; i++) K[i] = V[i] = (float)(i % 7) * 0.1f;
  std::printf("%d threads; K and V %.0f MB each; chunks of %ld keys, prefetch %ld rows ahead (chunk+pf)\n",
              omp_get_max_threads(), n * 4 / 1e6, CH, PF);
  for (int rep = 0; rep < 2; rep++) {
    line<1>(K, V, 5);
    line<4>(K, V, 5);
  }
  std::free(K);
  std::free(V);
}
