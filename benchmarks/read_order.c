// How the order of reading a K tile costs read bandwidth: the decode entry's profile (BENCHMARKS.md, "Small calls at
// SDPA's pace, the decode's memory profile", 2026-11-26). K and V of 64 MiB each, one thread, summed with AVX2:
// whole (K then V), in alternating 32 KB / 512 KB tiles row by row, in the decode's scoring order (8 key rows at a
// time, 8 floats of each in turn: column by column), and that order with the next tile prefetched row by row 1, 2
// or 4 tiles ahead. GB/s = bytes of K and V over the time; three rounds (this machine is shared: compare within one).
//
//     gcc -O2 -mavx2 -mfma -o /tmp/read_order benchmarks/read_order.c && /tmp/read_order
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static __m256 sum_block(const float* p, long n, __m256 a){ for(long i=0;i<n;i+=32){ a=_mm256_add_ps(a,_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p+i),_mm256_loadu_ps(p+i+8)),_mm256_add_ps(_mm256_loadu_ps(p+i+16),_mm256_loadu_ps(p+i+24))));} return a;}
// column-major within 8-row blocks (as dots)
static __m256 sum_cm(const float* p, long rows, __m256 a){ for(long r=0;r<rows;r+=8) for(long d=0;d<128;d+=8) for(int c=0;c<8;c++) a=_mm256_add_ps(a,_mm256_loadu_ps(p+(r+c)*128+d)); return a;}
static __m256 sum_cm_pf(const float* p, long rows, __m256 a, long dist){ for(long r=0;r<rows;r+=8){ for(long x=0;x<8*128;x+=16) __builtin_prefetch(p+dist+r*128+x,0,2); for(long d=0;d<128;d+=8) for(int c=0;c<8;c++) a=_mm256_add_ps(a,_mm256_loadu_ps(p+(r+c)*128+d));} return a;}
static __m256 sum_rm_pf(const float* p, long n, __m256 a, long dist){ for(long i=0;i<n;i+=32){ if((i&15)==0) __builtin_prefetch(p+dist+i,0,2); a=_mm256_add_ps(a,_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p+i),_mm256_loadu_ps(p+i+8)),_mm256_add_ps(_mm256_loadu_ps(p+i+16),_mm256_loadu_ps(p+i+24))));} return a;}
int main(){
  long n=64L<<20>>2; float*K=aligned_alloc(64,n*4),*V=aligned_alloc(64,n*4);
  for(long i=0;i<n;i++){K[i]=i&7;V[i]=i&3;}
  long tiles[]={0, 8192, 131072, 8192, 8192, 8192, 8192};
  const char* names[]={"K then V","alt 32KB","alt 512KB","alt 32KB col-major K","cm pf 1 tile","cm pf 2 tiles", "cm pf 4 tiles"};
  for(int rep=0;rep<3;rep++) for(int m=0;m<7;m++){
    __m256 a=_mm256_setzero_ps(); double t=now();
    if(m==0){a=sum_block(K,n,a);a=sum_block(V,n,a);}
    else { long T=tiles[m]; for(long i=0;i<n;i+=T){ if(m==3) a=sum_cm(K+i,T/128,a); else if(m>=4){ long dd=T*(m==4?1:m==5?2:4); if(i+dd>=n) dd=0; a=sum_cm_pf(K+i,T/128,a,dd); a=sum_rm_pf(V+i,T,a,dd);} else a=sum_block(K+i,T,a); if(m<4) a=sum_block(V+i,T,a);} }
    t=now()-t; float o[8]; _mm256_storeu_ps(o,a);
    printf("%-22s %.2f ms %.1f GB/s (%g)\n",names[m],t*1e3,2*n*4/t/1e9,o[0]);
  }
}
