// The C ABI of attnkit's CPU kernel (loaded with ctypes by attnkit/backends/_native.py) and the
// run-time choice of instruction set. Also a (method-less) Python extension module, so that
// setuptools builds and installs it like any other.
#include <Python.h>

#include "attn_common.h"

#define AK_DECLARE(ns)                                                                                          \
  namespace ns {                                                                                                \
  int run_forward(const AkCall*);                                                                                \
  int run_backward(const AkCall*);                                                                               \
  int run_decode(const AkCall*);                                                                                 \
  void release_scratch();                                                                                       \
  }
AK_DECLARE(ak_base)
#if defined(__x86_64__) && defined(__GNUC__)
AK_DECLARE(ak_avx2)
AK_DECLARE(ak_avx512)
#endif

// 2: AVX-512, 1: AVX2 + FMA + F16C, 0: portable
static int best_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 1;
#endif
  return 0;
}

static int isa_in_use = -1;
int ak_decode_order = -1;

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

// The decode's read order: -1 per call (the default), 0 register-blocked, 1 memory order; returns the new setting
AK_API int ak_set_decode_order(int order) {
  ak_decode_order = order < -1 || order > 1 ? -1 : order;
  return ak_decode_order;
}

AK_API int ak_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

static bool abi_ok(const AkCall* c) { return c && c->size == (int64_t)sizeof(AkCall) && c->version == AK_ABI_VERSION; }

// The size and version of the call record this build expects (the caller checks them once at load).
AK_API int64_t ak_abi_size() { return (int64_t)sizeof(AkCall); }
AK_API int64_t ak_abi_version() { return AK_ABI_VERSION; }

// Forward: writes c->out, c->lse. Backward: writes c->dq, c->dk, c->dv (contiguous, fp32); deterministic (dQ
// shares are added in key-tile order). Both return AK_OK, AK_E_NOMEM (scratch memory) or AK_E_ABI (a record of
// another size or version).
AK_API int ak_forward(const AkCall* c) {
  if (!abi_ok(c)) return AK_E_ABI;
  switch (ak_isa()) {
#if defined(__x86_64__) && defined(__GNUC__)
    case 2: return ak_avx512::run_forward(c);
    case 1: return ak_avx2::run_forward(c);
#endif
    default: return ak_base::run_forward(c);
  }
}

AK_API int ak_backward(const AkCall* c) {
  if (!abi_ok(c)) return AK_E_ABI;
  switch (ak_isa()) {
#if defined(__x86_64__) && defined(__GNUC__)
    case 2: return ak_avx512::run_backward(c);
    case 1: return ak_avx2::run_backward(c);
#endif
    default: return ak_base::run_backward(c);
  }
}

// Decode: L <= 64 query rows per head against a cache (split-K over threads, GQA heads packed; attn_decode.h).
// Reads q, k, v of c->dtype, lo / hi; writes c->out (B, H, L, Dv), c->lse (B, H, L; or null: not written), fp32
// contiguous. The same bits
// at any thread count. Returns AK_OK, AK_E_NOMEM, AK_E_ABI, or AK_E_ARG (L outside 1..64, H not a multiple of
// Hkv, an unknown dtype, a chunk that is not a positive multiple of 64).
AK_API int ak_decode(const AkCall* c) {
  if (!abi_ok(c)) return AK_E_ABI;
  switch (ak_isa()) {
#if defined(__x86_64__) && defined(__GNUC__)
    case 2: return ak_avx512::run_decode(c);
    case 1: return ak_avx2::run_decode(c);
#endif
    default: return ak_base::run_decode(c);
  }
}

// Whether any row of a (n0, n1, n2, ·) array (element strides s0, s1, s2) has a zero first element (+0 or -0): the
// cheap check that torch's fused CPU kernel may have hidden a NaN / inf (it writes an all-zero row there). dtype: 0
// fp32, 1 bf16, 2 fp16 (the bits are compared: no float arithmetic, any NaN counts as nonzero). A plain loop: the
// caller's output is small where this check costs anything (one element per row).
AK_API int ak_zero_first(const void* p, int dtype, int64_t n0, int64_t n1, int64_t n2, int64_t s0, int64_t s1,
                         int64_t s2) {
  for (int64_t a = 0; a < n0; ++a)
    for (int64_t b = 0; b < n1; ++b) {
      const int64_t base = a * s0 + b * s1;
      if (dtype == 0) {
        const uint32_t* x = static_cast<const uint32_t*>(p) + base;
        for (int64_t i = 0; i < n2; ++i)
          if ((x[i * s2] & 0x7fffffffu) == 0) return 1;
      } else {
        const uint16_t* x = static_cast<const uint16_t*>(p) + base;
        for (int64_t i = 0; i < n2; ++i)
          if ((x[i * s2] & 0x7fffu) == 0) return 1;
      }
    }
  return 0;
}

// Frees the scratch memory the backward and the decode keep between calls (on the calling thread; each decode
// worker thread keeps its own small buffers, a few tens of KB).
AK_API void ak_release_scratch() {
  ak_base::release_scratch();
#if defined(__x86_64__) && defined(__GNUC__)
  ak_avx2::release_scratch();
  ak_avx512::release_scratch();
#endif
}

}  // extern "C"

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "attnkit's CPU attention kernel (C ABI, loaded with ctypes).", -1, nullptr,
                                    nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
