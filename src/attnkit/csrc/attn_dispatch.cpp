// The C ABI of attnkit's CPU kernel (loaded with ctypes by attnkit/backends/_native.py) and the
// run-time choice of instruction set. Also a (method-less) Python extension module, so that
// setuptools builds and installs it like any other.
#include <Python.h>

#include "attn_common.h"

#define AK_DECLARE(ns)                                                                                          \
  namespace ns {                                                                                                \
  void run_forward(const int64_t*, float, const float*, const float*, const float*, const int32_t*,            \
                   const int32_t*, const float*, float*, float*);                                               \
  int run_backward(const int64_t*, float, const float*, const float*, const float*, const int32_t*,           \
                    const int32_t*, const float*, const float*, const int64_t*, const float*, const float*,     \
                    const float*, float*, float*, float*);                                                      \
  void release_scratch();                                                                                       \
  }
AK_DECLARE(ak_base)
#if defined(__x86_64__) && defined(__GNUC__)
AK_DECLARE(ak_avx2)
AK_DECLARE(ak_avx512)
#endif

// 2: AVX-512, 1: AVX2 + FMA, 0: portable
static int best_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

static int isa_in_use = -1;

#define AK_API __attribute__((visibility("default")))

extern "C" {

// The instruction set this machine can run; ak_set_isa(lower) forces a lower one (tests).
AK_API int ak_best_isa() { return best_isa(); }

AK_API int ak_set_isa(int isa) {
  int best = best_isa();
  isa_in_use = isa < 0 || isa > best ? best : isa;
  return isa_in_use;
}

AK_API int ak_isa() {
  if (isa_in_use < 0) isa_in_use = best_isa();
  return isa_in_use;
}

AK_API int ak_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

// meta (int64): B, H, Hkv, L, S, D, Dv, q strides (batch, head, row), k strides, v strides, lo/hi batch
// stride (0 or L), threads. lo, hi: int32 (1 or B, L); alibi: (H,) slopes or null. Forward writes out
// (B, H, L, Dv), lse (B, H, L); backward reads out (contiguous), lse and dlse (or null) and writes dq, dk,
// dv (contiguous, fp32); it returns 1 when its scratch memory cannot be had.
AK_API void ak_forward(const int64_t* meta, float scale, const float* q, const float* k, const float* v,
                       const int32_t* lo, const int32_t* hi, const float* alibi, float* out, float* lse) {
  switch (ak_isa()) {
#if defined(__x86_64__) && defined(__GNUC__)
    case 2: ak_avx512::run_forward(meta, scale, q, k, v, lo, hi, alibi, out, lse); return;
    case 1: ak_avx2::run_forward(meta, scale, q, k, v, lo, hi, alibi, out, lse); return;
#endif
    default: ak_base::run_forward(meta, scale, q, k, v, lo, hi, alibi, out, lse);
  }
}

AK_API int ak_backward(const int64_t* meta, float scale, const float* q, const float* k, const float* v,
                        const int32_t* lo, const int32_t* hi, const float* alibi, const float* dout,
                        const int64_t* sdo, const float* out, const float* lse, const float* dlse, float* dq, float* dk,
                        float* dv) {
  switch (ak_isa()) {
#if defined(__x86_64__) && defined(__GNUC__)
    case 2: return ak_avx512::run_backward(meta, scale, q, k, v, lo, hi, alibi, dout, sdo, out, lse, dlse, dq, dk, dv);
    case 1: return ak_avx2::run_backward(meta, scale, q, k, v, lo, hi, alibi, dout, sdo, out, lse, dlse, dq, dk, dv);
#endif
    default: return ak_base::run_backward(meta, scale, q, k, v, lo, hi, alibi, dout, sdo, out, lse, dlse, dq, dk, dv);
  }
}

// Frees the scratch memory the backward keeps between calls (on the calling thread).
AK_API void ak_release_scratch() {
  ak_base::release_scratch();
#if defined(__x86_64__) && defined(__GNUC__)
  ak_avx2::release_scratch();
  ak_avx512::release_scratch();
#endif
}

}  // extern "C"

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "attnkit's CPU attention kernel (C ABI, loaded with ctypes).", -1, nullptr};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
