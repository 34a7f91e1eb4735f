// The AVX-512 build (16 floats per vector); compiled only on x86-64, chosen at run time.
#if defined(__x86_64__) && defined(__GNUC__)
#include "attn_common.h"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,f16c")
#define AK_NS ak_avx512
#define AK_VW 16
#include "attn_impl.h"
#include "attn_decode.h"
#include "attn_entry.h"
#pragma GCC pop_options
#endif
