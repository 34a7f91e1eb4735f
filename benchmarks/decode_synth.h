// Shared by the synthetic long-cache decode benchmarks (stream_overlap.cpp, decode_shapes.cpp): the 8-key lane
// reduction of the decode entry's dot products, a row's prefetch into L2, and the 256-byte-reduction read of K and V.
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>

// lane c: the sum of a[c]'s lanes (csrc/attn_decode.h's reduce_lanes at AVX2)
static inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// the `bytes` bytes at r, line by line, into L2 (the decode entry's prefetch)
static inline void prefetch_bytes(const void* r, long bytes) {
  for (long x = 0; x < bytes; x += 64) __builtin_prefetch((const char*)r + x, 0, 2);
}

// K summed, then V (n floats each), each split over the threads, 64 floats an iteration with a reduction per
// iteration (what `k.sum(), v.sum()` does); seconds
static double sum_kv(const float* K, const float* V, long n) {
  const auto t0 = std::chrono::steady_clock::now();
  double sink = 0;
  for (const float* X : {K, V}) {
#pragma omp parallel for reduction(+ : sink) schedule(static)
    for (long i = 0; i < n; i += 64) {
      __m256 a = _mm256_setzero_ps();
      for (int j = 0; j < 64; j += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(X + i + j));
      float t[8];
      _mm256_storeu_ps(t, a);
      sink += t[0];
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  if (sink == 1.2345) std::printf(" ");  // (the sums are used)
  return std::chrono::duration<double>(t1 - t0).count();
}
