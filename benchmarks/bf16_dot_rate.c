// How many bf16 products a cycle avx512_bf16's VDPBF16PS gives against fp32 FMAs on this CPU: each instruction run
// on 4 to 24 independent accumulators (zmm registers; the chains' count shows the latency, the plateau the rate).
//
//     gcc -O2 -o /tmp/bf16_dot_rate benchmarks/bf16_dot_rate.c && /tmp/bf16_dot_rate
//
// (x86-64 with AVX-512 and avx512_bf16 only, GCC or Clang; the instructions are written in assembly.)
// Why it is here: a bf16 decode step's products are cheaper than fp32's only if VDPBF16PS gives more products a
// cycle than the FMAs do; on the Intel Xeon with AMX of the thirty-first session it gave half (BENCHMARKS.md).
#pragma GCC target("avx512f")  // (the clobber list names zmm16-31)
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void report(const char* what, int chains, int products, double s) {
  printf("%-32s %2d chains: %.3f ns an instruction, %.1f products a ns\n", what, chains, s * 1e9,
         products / (s * 1e9));
}

int main(void) {
  const long N = 20000000;
  __asm__ volatile("vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31" ::: "xmm30", "xmm31");
  for (int round = 0; round < 2; round++) {
    {
      const double t0 = now();
      for (long n = 0; n < N; n++) __asm__ volatile("vdpbf16ps %%zmm31, %%zmm30, %%zmm0\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm1\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm2\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm3" ::: "xmm0", "xmm1", "xmm2", "xmm3");
      report("VDPBF16PS (32 bf16 products)", 4, 32, (now() - t0) / N / 4);
    }
    {
      const double t0 = now();
      for (long n = 0; n < N; n++) __asm__ volatile("vdpbf16ps %%zmm31, %%zmm30, %%zmm0\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm1\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm2\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm3\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm4\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm5\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm6\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm7" ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
      report("VDPBF16PS (32 bf16 products)", 8, 32, (now() - t0) / N / 8);
    }
    {
      const double t0 = now();
      for (long n = 0; n < N; n++) __asm__ volatile("vdpbf16ps %%zmm31, %%zmm30, %%zmm0\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm1\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm2\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm3\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm4\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm5\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm6\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm7\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm8\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm9\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm10\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm11\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm12\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm13\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm14\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm15" ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
      report("VDPBF16PS (32 bf16 products)", 16, 32, (now() - t0) / N / 16);
    }
    {
      const double t0 = now();
      for (long n = 0; n < N; n++) __asm__ volatile("vdpbf16ps %%zmm31, %%zmm30, %%zmm0\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm1\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm2\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm3\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm4\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm5\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm6\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm7\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm8\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm9\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm10\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm11\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm12\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm13\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm14\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm15\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm16\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm17\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm18\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm19\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm20\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm21\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm22\n\tvdpbf16ps %%zmm31, %%zmm30, %%zmm23" ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23");
      report("VDPBF16PS (32 bf16 products)", 24, 32, (now() - t0) / N / 24);
    }
    {
      const double t0 = now();
      for (long n = 0; n < N; n++) __asm__ volatile("vfmadd231ps %%zmm31, %%zmm30, %%zmm0\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm1\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm2\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm3" ::: "xmm0", "xmm1", "xmm2", "xmm3");
      report("VFMADD231PS (16 fp32 products)", 4, 16, (now() - t0) / N / 4);
    }
    {
      const double t0 = now();
      for (long n = 0; n < N; n++) __asm__ volatile("vfmadd231ps %%zmm31, %%zmm30, %%zmm0\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm1\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm2\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm3\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm4\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm5\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm6\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm7" ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
      report("VFMADD231PS (16 fp32 products)", 8, 16, (now() - t0) / N / 8);
    }
    {
      const double t0 = now();
      for (long n = 0; n < N; n++) __asm__ volatile("vfmadd231ps %%zmm31, %%zmm30, %%zmm0\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm1\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm2\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm3\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm4\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm5\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm6\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm7\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm8\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm9\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm10\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm11\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm12\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm13\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm14\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm15" ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
      report("VFMADD231PS (16 fp32 products)", 16, 16, (now() - t0) / N / 16);
    }
    {
      const double t0 = now();
      for (long n = 0; n < N; n++) __asm__ volatile("vfmadd231ps %%zmm31, %%zmm30, %%zmm0\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm1\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm2\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm3\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm4\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm5\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm6\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm7\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm8\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm9\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm10\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm11\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm12\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm13\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm14\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm15\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm16\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm17\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm18\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm19\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm20\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm21\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm22\n\tvfmadd231ps %%zmm31, %%zmm30, %%zmm23" ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23");
      report("VFMADD231PS (16 fp32 products)", 24, 16, (now() - t0) / N / 24);
    }
  }
  return 0;
}
