// How many bf16 products a nanosecond avx512_bf16's VDPBF16PS gives against fp32 FMAs on this CPU: each instruction
// run on 4 to 24 independent accumulators (zmm registers; the chains' count shows the latency, the plateau the rate).
//
//     gcc -O2 -o /tmp/bf16_dot_rate benchmarks/bf16_dot_rate.c && /tmp/bf16_dot_rate
//
// (x86-64 with AVX-512 and avx512_bf16 only, GCC or Clang; the instructions are written in assembly.)
// Why it is here: a bf16 decode step's products are cheaper than fp32's only if VDPBF16PS gives more products a
// nanosecond than the FMAs do; on the Intel Xeon with AMX of the thirty-first session it gave half (BENCHMARKS.md).
#pragma GCC target("avx512f")  // (the clobber list names zmm16-23)
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

// one instruction into accumulator i (zmm i) from zmm30 and zmm31
#define DP(i) "vdpbf16ps %%zmm31, %%zmm30, %%zmm" #i "\n\t"
#define FMA(i) "vfmadd231ps %%zmm31, %%zmm30, %%zmm" #i "\n\t"
#define X4(f) f(0) f(1) f(2) f(3)
#define X8(f) X4(f) f(4) f(5) f(6) f(7)
#define X16(f) X8(f) f(8) f(9) f(10) f(11) f(12) f(13) f(14) f(15)
#define X24(f) X16(f) f(16) f(17) f(18) f(19) f(20) f(21) f(22) f(23)
#define CLOBBERS                                                                                                  \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", \
      "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23"
// N rounds of `chains` instructions, each round one asm block
#define TIME(what, products, chains, block)                                 \
  do {                                                                      \
    const double t0 = now();                                                \
    for (long n = 0; n < N; n++) __asm__ volatile(block ::: CLOBBERS);      \
    report(what, chains, products, (now() - t0) / N / chains);              \
  } while (0)

int main(void) {
  const long N = 20000000;
  const char* dp = "VDPBF16PS (32 bf16 products)";
  const char* fma = "VFMADD231PS (16 fp32 products)";
  __asm__ volatile("vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31" ::: "xmm30", "xmm31");
  for (int round = 0; round < 2; round++) {
    TIME(dp, 32, 4, X4(DP));
    TIME(dp, 32, 8, X8(DP));
    TIME(dp, 32, 16, X16(DP));
    TIME(dp, 32, 24, X24(DP));
    TIME(fma, 16, 4, X4(FMA));
    TIME(fma, 16, 8, X8(FMA));
    TIME(fma, 16, 16, X16(FMA));
    TIME(fma, 16, 24, X24(FMA));
  }
  return 0;
}
