// Can this machine overlap a decode step's arithmetic with reading its K and V cache? A synthetic kernel with the
// decode entry's access pattern and no attention in it, against reading K and V once (BENCHMARKS.md, seventeenth
// session, "Long-cache GQA decode").
//
// K and V: Hkv = 8 heads x S = 65 536 keys x D = 128 fp32 each (268 MB each, from memory). Work items are (head,
// chunk of 1024 keys), handed to the OpenMP threads one at a time as the decode entry hands out its (unit, chunk)
// items (schedule(dynamic, 1)); per tile of 64 keys, the tile's 64 K rows are read in turn, then its 64 V rows
// (memory order), each row's next-tile twin prefetched into L2 as it is read (the decode entry's prefetch: one tile
// ahead). Each loaded 8-float vector takes F fused multiply-adds into F register accumulators (no stores): F = 4 is
// the multiply-adds a GQA group of 4 query rows spends on each of its K and V vectors (q . k for 4 rows, then p v
// for 4 rows). Printed, best of 5 (ms):
//
//   read             K summed, then V summed, each split over the threads (what `k.sum(), v.sum()` does)
//   F = 1, 2, 4, 8   the synthetic kernel over K and V from memory
//   ... in L3        the same number of keys over a 1024-key cache (8 MB: in L3), 64 calls: the arithmetic alone
//
// If "F = 4" is near "read" while "F = 4 in L3" is well below it, the machine overlaps that much arithmetic with the
// reads, and a decode step slower than its read is slow by its own inner structure, not by the hardware.
//
// Then the same multiply-adds (four query rows) in the decode entry's loop shapes (csrc/attn_decode.h), one pass or
// both replaced:
//   "dots"   each K tile scored as the decode's dots_keys does: 4 rows x 2 keys of partial sums over D (the q rows
//            loaded from L1 with each K vector), their lanes reduced per 8 keys (hadd) into a 4 x 64 score tile;
//   "pv"     each V tile multiplied as its pv_keys does: 2 keys at a time, the 4 rows' output accumulators loaded
//            and stored around each pair of multiply-adds (4 x D floats in L1).
// Neither adds multiply-adds (the dot products add their lanes' reduction, P.V a scaling of each p); a pass in
// these shapes loads and stores more per multiply-add.
//
//   g++ -O3 -mavx2 -mfma -fopenmp benchmarks/stream_overlap.cpp -o /tmp/stream_overlap   (-O3, as the kernel)
//   OMP_NUM_THREADS=2 /tmp/stream_overlap
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "decode_synth.h"

static const long D = 128, HKV = 8, S = 65536, CHUNK = 1024, BN = 64;

template <int F>
static inline void row(const float* r, __m256* acc, const __m256* q) {
  for (int d = 0; d < D; d += 8) {
    const __m256 x = _mm256_loadu_ps(r + d);
#pragma GCC unroll 8
    for (int i = 0; i < F; i++) acc[i] = _mm256_fmadd_ps(x, q[i], acc[i]);
  }
}

static inline void prefetch_row(const float* r) { prefetch_bytes(r, D * 4); }

// a K tile (64 rows at kb) scored as dots_keys<4> does: sc[r][j] = q_r . k_j; the next tile's rows prefetched (next)
static void dots_tile(const float* kb, bool next, const float (*q)[D], float (*sc)[BN]) {
  for (long g = 0; g < BN; g += 8) {
    __m256 part[4][8];
    for (int t = 0; t < 8; t += 2) {
      const float* k0 = kb + (g + t) * D;
      const float* k1 = k0 + D;
      if (next) prefetch_row(k0 + BN * D), prefetch_row(k1 + BN * D);
      __m256 a[4][2];
      for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
      for (int d = 0; d < D; d += 8) {
        const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
          const __m256 qv = _mm256_load_ps(&q[r][d]);
          a[r][0] = _mm256_fmadd_ps(qv, x0, a[r][0]), a[r][1] = _mm256_fmadd_ps(qv, x1, a[r][1]);
        }
      }
      for (int r = 0; r < 4; r++) part[r][t] = a[r][0], part[r][t + 1] = a[r][1];
    }
    for (int r = 0; r < 4; r++) _mm256_store_ps(&sc[r][g], reduce8(part[r]));
  }
}

// a V tile (64 rows at vb) multiplied as pv_keys<4> does: acc[r] += sum_j p[r][j] v_j, 2 keys at a time
static void pv_tile(const float* vb, bool next, const float (*p)[BN], float (*acc)[D]) {
  for (long j = 0; j < BN; j += 2) {
    const float* v0 = vb + j * D;
    const float* v1 = v0 + D;
    if (next) prefetch_row(v0 + BN * D), prefetch_row(v1 + BN * D);
    __m256 pr[4][2];
    for (int r = 0; r < 4; r++)
      pr[r][0] = _mm256_set1_ps(p[r][j] * 1e-3f), pr[r][1] = _mm256_set1_ps(p[r][j + 1] * 1e-3f);
    for (int c = 0; c < D; c += 8) {
      const __m256 x0 = _mm256_loadu_ps(v0 + c), x1 = _mm256_loadu_ps(v1 + c);
#pragma GCC unroll 4
      for (int r = 0; r < 4; r++) {
        __m256 a = _mm256_load_ps(&acc[r][c]);
        a = _mm256_fmadd_ps(pr[r][0], x0, a), a = _mm256_fmadd_ps(pr[r][1], x1, a);
        _mm256_store_ps(&acc[r][c], a);
      }
    }
  }
}

// the synthetic kernel over the first s keys of each head (K and V: HKV x s x D), seconds. MODE: 0 register FMAs
// on both passes (F per vector), 1 the K pass as "dots", 2 the V pass as "pv", 3 both (F = 4 then)
template <int F, int MODE = 0>
static double synthetic(const float* K, const float* V, long s) {
  const auto t0 = std::chrono::steady_clock::now();
  const long per = s / CHUNK, items = HKV * per;
  double sink = 0;
#pragma omp parallel for reduction(+ : sink) schedule(dynamic, 1)
  for (long it = 0; it < items; it++) {
    const long h = it / per, c = it % per;
    const float* kb = K + (h * s + c * CHUNK) * D;
    const float* vb = V + (h * s + c * CHUNK) * D;
    __m256 acc[8], q[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps(), q[i] = _mm256_set1_ps(0.5f + i);
    alignas(64) float qr[4][D], sc[4][BN], out[4][D];
    for (int r = 0; r < 4; r++)
      for (int d = 0; d < D; d++) qr[r][d] = 0.01f * (float)(r + d % 5), out[r][d] = 0.f;
    for (int r = 0; r < 4; r++)
      for (int j = 0; j < BN; j++) sc[r][j] = 0.001f * (float)j;
    for (long j0 = 0; j0 < CHUNK; j0 += BN) {
      const bool next = j0 + BN < CHUNK;
      if (MODE & 1) {  // the K pass, then the V pass, in every mode
        dots_tile(kb + j0 * D, next, qr, sc);
      } else {
        for (long j = j0; j < j0 + BN; j++) {
          if (next) prefetch_row(kb + (j + BN) * D);
          row<F>(kb + j * D, acc, q);
        }
      }
      if (MODE & 2) {
        pv_tile(vb + j0 * D, next, sc, out);
      } else {
        for (long j = j0; j < j0 + BN; j++) {
          if (next) prefetch_row(vb + (j + BN) * D);
          row<F>(vb + j * D, acc, q);
        }
      }
    }
    __m256 a = acc[0];
    for (int i = 1; i < 8; i++) a = _mm256_add_ps(a, acc[i]);
    float t[8];
    _mm256_storeu_ps(t, a);
    sink += t[0] + sc[1][3] + out[2][5];
  }
  const auto t1 = std::chrono::steady_clock::now();
  if (sink == 1.2345) std::printf(" ");  // (the sums are used)
  return std::chrono::duration<double>(t1 - t0).count();
}

static double read(const float* K, const float* V) { return sum_kv(K, V, HKV * S * D); }

template <class Fn>
static double best_ms(Fn f) {
  std::vector<double> t;
  for (int r = 0; r < 5; r++) t.push_back(f());
  return *std::min_element(t.begin(), t.end()) * 1e3;
}

template <int F, int MODE = 0>
static void line(const float* K, const float* V) {
  const double mem = best_ms([&] { return synthetic<F, MODE>(K, V, S); });
  const double l3 = best_ms([&] {
    double t = 0;
    for (int i = 0; i < S / 1024; i++) t += synthetic<F, MODE>(K, V, 1024);
    return t;
  });
  static const char* names[] = {"", ", K pass as dots", ", V pass as pv", ", dots and pv"};
  std::printf("F = %d%s: %.2f ms from memory, %.2f ms in L3\n", F, names[MODE], mem, l3);
}

int main() {
  const size_t n = HKV * S * D;
  float* K = (float*)std::aligned_alloc(64, n * 4);
  float* V = (float*)std::aligned_alloc(64, n * 4);
  for (size_t i = 0; i < n; i++) K[i] = V[i] = (float)(i % 7) * 0.1f;
  std::printf("%d threads; K and V %.0f MB each\n", omp_get_max_threads(), n * 4 / 1e6);
  for (int rep = 0; rep < 2; rep++) {
    std::printf("read: %.2f ms\n", best_ms([&] { return read(K, V); }));
    line<1>(K, V);
    line<2>(K, V);
    line<4>(K, V);
    line<8>(K, V);
    line<4, 1>(K, V);
    line<4, 2>(K, V);
    line<4, 3>(K, V);
  }
  std::free(K);
  std::free(V);
}
