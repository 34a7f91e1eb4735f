// The C ABI of attnkit's CPU kernel (loaded with ctypes by attnkit/backends/_native.py) and the
// run-time choice of instruction set. Also a Python extension module (setuptools builds and installs it like any
// other) whose functions are the per-call hot path of a replayed call: `stepper` (a prepared call signature whose
// per-call work — checks, strides, pointers, outputs, the record — runs in C), `step` (write a call record's
// per-call slots and run an entry, the GIL released: the Python stepper's), `suspect_rows`, `dense_tiles` (a bool
// mask's tile map) and `tile_rows` (a tile map's row intervals), each a vectorcall taking Python ints, a fraction of
// a ctypes call's argument conversion (about 0.2 µs an argument).
#include <Python.h>
#include <structmember.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "attn_common.h"

#define AK_DECLARE(ns)                                                                                          \
  namespace ns {                                                                                                \
  int run_forward(const AkCall*);                                                                                \
  int run_backward(const AkCall*);                                                                               \
  int run_decode(const AkCall*);                                                                                 \
  bool amx_available();                                                                                          \
  bool vdot_available();                                                                                         \
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
std::atomic<int> ak_decode_learn{1};

// The decode's read order learned per call shape (attn_common.h, ak_order_choice): per key, the calls seen, the
// timings of each order (count, fastest) and, once three of each are in, the choice. Under a mutex: calls from
// several Python threads (the GIL released) may meet here; a call of this kind reads at least 8 MB.
namespace {
struct OrderLearn {
  int calls = 0;
  int n[2] = {0, 0};
  double best[2] = {0.0, 0.0};
  int choice = -1;
};
constexpr int LEARN_SAMPLES = 3;  // (with two, one shape of four chose differently in one run of two on a busy machine)
// allocated once and never freed: a kernel call on a thread still running at exit must not meet a destroyed map
std::mutex& learn_mu = *new std::mutex;
std::unordered_map<int64_t, OrderLearn>& learned = *new std::unordered_map<int64_t, OrderLearn>;
}  // namespace

int ak_order_choice(int64_t key, int* timed) {
  std::lock_guard<std::mutex> lock(learn_mu);
  OrderLearn& l = learned[key];
  *timed = 0;
  if (l.choice >= 0) return l.choice;
  const int call = l.calls++;
  if (call == 0) return 0;  // the shape's first call: its warm-up (scratch, first touches), not timed
  *timed = 1;
  return l.n[0] > l.n[1] ? 1 : l.n[1] > l.n[0] ? 0 : (call & 1);  // the order with fewer timings, else in turn
}

void ak_order_sample(int64_t key, int order, double seconds) {
  std::lock_guard<std::mutex> lock(learn_mu);
  OrderLearn& l = learned[key];
  if (l.choice >= 0 || order < 0 || order > 1) return;
  if (l.n[order] == 0 || seconds < l.best[order]) l.best[order] = seconds;
  l.n[order]++;
  if (l.n[0] >= LEARN_SAMPLES && l.n[1] >= LEARN_SAMPLES) l.choice = l.best[1] < l.best[0] ? 1 : 0;
}
int ak_bf16_dot = 1;

// ak_suspect_rows' loop, by element width (outside the C-linkage block: a template). T: uint32_t (fp32) or uint16_t
// (bf16 / fp16); `inf`: the +inf bits of the magnitude (a NaN's magnitude is larger). The whole-row scan of a row
// with unit stride is a loop the compiler vectorizes (SDPA's outputs: rows contiguous, heads and rows strided):
// fp32 compares each value with itself (x != x only for NaN), bf16 / fp16 compare the magnitude bits as int16
// (they fit: <= 0x7fff).
template <typename T>
static int suspect_rows_of(const T* x, uint32_t inf, int64_t n0, int64_t n1, int64_t n2, int64_t n3, int64_t s0,
                           int64_t s1, int64_t s2, int64_t s3, bool whole) {
  constexpr bool f32 = sizeof(T) == 4;
  constexpr uint32_t abs_bits = f32 ? 0x7fffffffu : 0x7fffu;
  for (int64_t a = 0; a < n0; ++a)
    for (int64_t b = 0; b < n1; ++b)
      for (int64_t i = 0; i < n2; ++i) {
        const T* row = x + a * s0 + b * s1 + i * s2;
        const uint32_t m = row[0] & abs_bits;
        if (m == 0 || m > inf) return 1;
        if (!whole) continue;
        int nan = 0;
        if (s3 == 1 && f32) {  // (SDPA's outputs)
          const float* r = reinterpret_cast<const float*>(row);
          for (int64_t d = 1; d < n3; ++d) nan |= r[d] != r[d];
        } else if (s3 == 1) {
          const int16_t* r = reinterpret_cast<const int16_t*>(row);
          const int16_t lim = (int16_t)inf;
          for (int64_t d = 1; d < n3; ++d) nan |= (int16_t)(r[d] & 0x7fff) > lim;
        } else {
          for (int64_t d = 1; d < n3; ++d) nan |= (row[d * s3] & abs_bits) > inf;
        }
        if (nan) return 1;
      }
  return 0;
}

// One row of a tile's keys (`r`: the row's first key in the tile; n <= 64 of them exist), as the tile's 64-bit word:
// bit j set where key j's byte is nonzero (attend). `st`: the keys' element stride (0: one value broadcast over the row). A row with unit
// stride reads whole 16-byte chunks with SSE2 (every x86-64 CPU has it) and only the bytes that exist.
static inline uint64_t mask_row_word(const uint8_t* r, int64_t st, int n) {
  if (st == 0) return r[0] ? (n == 64 ? ~0ull : ((1ull << n) - 1)) : 0ull;
  uint64_t w = 0;
  int j = 0;
#if defined(__SSE2__)
  if (st == 1) {
    const __m128i zero = _mm_setzero_si128();
    for (; j + 16 <= n; j += 16) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + j));
      const uint32_t unset = (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(x, zero));
      w |= (uint64_t)(~unset & 0xffffu) << j;
    }
  }
#endif
  for (; j < n; ++j) w |= (uint64_t)(r[j * st] != 0) << j;
  return w;
}

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

// The decode's read order for every call: -1 as each call's record says (the default), 0 register-blocked, 1 memory
// order; returns the new setting
AK_API int ak_set_decode_order(int order) {
  ak_decode_order = order < -1 || order > 1 ? -1 : order;
  return ak_decode_order;
}

// The decode's read order learned where the rule would read in memory order (attn_common.h): 1 on (the default),
// 0 the rule itself, -1 only asks; returns the setting. ak_decode_learned(): how many call shapes have chosen, and
// of them how many memory order, as choices * 1024 + memory (tests, benchmarks); ak_decode_learn_reset() forgets all.
AK_API int ak_set_decode_learn(int on) {
  if (on == 0 || on == 1) ak_decode_learn.store(on, std::memory_order_relaxed);
  return ak_decode_learn.load(std::memory_order_relaxed);
}

AK_API int ak_decode_learned() {
  std::lock_guard<std::mutex> lock(learn_mu);
  int chosen = 0, memory = 0;
  for (const auto& kv : learned)
    if (kv.second.choice >= 0) chosen++, memory += kv.second.choice;
  return chosen * 1024 + memory;
}

AK_API void ak_decode_learn_reset() {
  std::lock_guard<std::mutex> lock(learn_mu);
  learned.clear();
}

// The forward's bf16 products on AMX tiles: 1 on (where the CPU has AMX and the AVX-512 build runs), 0 off; returns
// the new setting
AK_API int ak_set_bf16_dot(int on) {
  ak_bf16_dot = on != 0;
  return ak_bf16_dot;
}

AK_API int ak_bf16_dot_get() { return ak_bf16_dot; }

// Whether a bf16 forward would use them now: the setting, the instruction set in use, the CPU and the OS
AK_API int ak_bf16_dot_active() {
#if defined(__x86_64__) && defined(__GNUC__)
  return ak_bf16_dot && ak_isa() == 2 && ak_avx512::amx_available();
#else
  return 0;
#endif
}

// Whether a bf16 decode (and the few-rows backward) takes its scores by avx512_bf16's vector dot products now
// (attn_decode.h, dots_bdot): the same setting, the AVX-512 build in use, a CPU with avx512_bf16 (AMX or not)
AK_API int ak_bf16_vdot_active() {
#if defined(__x86_64__) && defined(__GNUC__)
  return ak_bf16_dot && ak_isa() == 2 && ak_avx512::vdot_available();
#else
  return 0;
#endif
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

// Whether any row of a (n0, n1, n2, n3) array (element strides s0..s3) has a first element that is zero (+0 or -0)
// or NaN, or (`whole`) a NaN anywhere: the cheap check that torch's fused CPU kernel may have hidden a NaN / inf (it
// writes an all-zero row there), let an inf in a key the mask hides reach a row (a NaN row the formula does not
// have), or read a NaN / inf value at a key the mask hides (0 · NaN: NaN in that value's columns only, hence the
// whole row under a mask). dtype: 0 fp32, 1 bf16, 2 fp16 (zero is all bits but the sign clear, NaN an all-ones
// exponent with a nonzero fraction). Plain loops: the caller's output is small where this check costs anything (a
// decode step's, where it is read whole).
AK_API int ak_suspect_rows(const void* p, int dtype, int64_t n0, int64_t n1, int64_t n2, int64_t n3, int64_t s0,
                           int64_t s1, int64_t s2, int64_t s3, int whole) {
  if (dtype == 0)
    return suspect_rows_of(static_cast<const uint32_t*>(p), ak_exp_bits(AK_F32), n0, n1, n2, n3, s0, s1, s2, s3,
                           whole);
  return suspect_rows_of(static_cast<const uint16_t*>(p), ak_exp_bits(dtype), n0, n1, n2, n3, s0, s1,
                         s2, s3, whole);
}

// The compiled kernel's tile map of a bool mask (one byte a point, nonzero = attend) read off its values: the mask
// has sizes (TB, TH, Lm, Sm), Lm in {1, L} and Sm in {1, S} (a size-1 dim broadcast over the call's L rows / S keys),
// element strides m0..m3 (the caller passes 0 for a broadcast dim). Writes kinds int8 (TB, TH, nq, nk): 0 empty,
// 1 partial, 2 full (only the rows and keys that exist decide a ragged edge tile), index int32 of the same shape (a
// partial tile's place in bits, in (b, h, qb, kb) order; -1 elsewhere) and, for the first `cap` partial tiles,
// their bits uint32 (cap, 2, 64): word [p][0][r] holds keys 0..31 of the tile's row r, [p][1][r] keys 32..63 (bit j
// = key j; keys past S and rows past L clear). Returns P, the number of partial tiles (P > cap: the caller brings
// room for P and asks again). One pass over the mask's bytes.
AK_API int64_t ak_dense_tiles(const uint8_t* m, int64_t TB, int64_t TH, int64_t L, int64_t S, int64_t m0, int64_t m1,
                              int64_t m2, int64_t m3, int8_t* kinds, int32_t* index, uint32_t* bits, int64_t cap) {
  const int64_t nq = (L + 63) / 64, nk = (S + 63) / 64;
  int64_t P = 0, t = 0;
  uint64_t w[64];
  for (int64_t b = 0; b < TB; ++b)
    for (int64_t h = 0; h < TH; ++h)
      for (int64_t qb = 0; qb < nq; ++qb) {
        const int rows = (int)std::min<int64_t>(64, L - qb * 64);
        for (int64_t kb = 0; kb < nk; ++kb, ++t) {
          const int n = (int)std::min<int64_t>(64, S - kb * 64);
          const uint64_t all = n == 64 ? ~0ull : ((1ull << n) - 1);
          const uint8_t* base = m + b * m0 + h * m1 + qb * 64 * m2 + kb * 64 * m3;
          bool full = true, empty = true;
          for (int r = 0; r < rows; ++r) {
            w[r] = (m2 == 0 && r) ? w[0] : mask_row_word(base + r * m2, m3, n);
            full &= w[r] == all;
            empty &= w[r] == 0;
          }
          kinds[t] = empty ? 0 : full ? 2 : 1;
          index[t] = (empty || full) ? -1 : (int32_t)P;
          if (empty || full) continue;
          if (P < cap) {
            uint32_t* lo = bits + P * 128;
            for (int r = 0; r < 64; ++r) {
              const uint64_t x = r < rows ? w[r] : 0;
              lo[r] = (uint32_t)x;
              lo[64 + r] = (uint32_t)(x >> 32);
            }
          }
          ++P;
        }
      }
  return P;
}

// The row intervals of a tile map (kinds / index / bits as ak_dense_tiles writes them, batch dim TB, one head): for
// each batch row b and query row i < L, the keys it sees, from its full tiles (every key of the tile that exists)
// and its partial tiles' bits. Where every row sees one stretch [lo, hi) (the count of keys it sees equals hi - lo),
// writes lo / hi int32 (TB, L) (a row that sees nothing: 0, 0) and returns 1; else 0 (lo / hi then hold nothing
// meaningful). Empty tiles cost one read of their kind.
AK_API int ak_tile_rows(const int8_t* kinds, const int32_t* index, const uint32_t* bits, int64_t TB, int64_t L,
                        int64_t S, int32_t* lo, int32_t* hi) {
  const int64_t nq = (L + 63) / 64, nk = (S + 63) / 64;
  int64_t rlo[64], rhi[64], cnt[64];
  for (int64_t b = 0; b < TB; ++b)
    for (int64_t qb = 0; qb < nq; ++qb) {
      const int rows = (int)std::min<int64_t>(64, L - qb * 64);
      for (int r = 0; r < rows; ++r) rlo[r] = INT64_MAX, rhi[r] = 0, cnt[r] = 0;
      const int64_t t0 = (b * nq + qb) * nk;
      for (int64_t kb = 0; kb < nk; ++kb) {
        const int kind = kinds[t0 + kb];
        if (kind == 0) continue;
        const int64_t a = kb * 64, e = std::min<int64_t>(S, a + 64);
        if (kind == 2) {
          for (int r = 0; r < rows; ++r) {
            rlo[r] = std::min(rlo[r], a), rhi[r] = std::max(rhi[r], e), cnt[r] += e - a;
          }
          continue;
        }
        const uint32_t* w = bits + (int64_t)index[t0 + kb] * 128;
        for (int r = 0; r < rows; ++r) {
          const uint64_t x = (uint64_t)w[r] | ((uint64_t)w[64 + r] << 32);
          if (!x) continue;
          rlo[r] = std::min<int64_t>(rlo[r], a + __builtin_ctzll(x));
          rhi[r] = std::max<int64_t>(rhi[r], a + 64 - __builtin_clzll(x));
          cnt[r] += __builtin_popcountll(x);
        }
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t i = b * L + qb * 64 + r;
        if (cnt[r] == 0) {
          lo[i] = hi[i] = 0;
          continue;
        }
        if (rhi[r] - rlo[r] != cnt[r]) return 0;
        lo[i] = (int32_t)rlo[r], hi[i] = (int32_t)rhi[r];
      }
    }
  return 1;
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

// the Python ints args[0 .. n) as int64 (false: a Python error is set)
static bool int64s(PyObject* const* args, Py_ssize_t n, int64_t* v) {
  for (Py_ssize_t i = 0; i < n; i++) {
    v[i] = PyLong_AsLongLong(args[i]);
    if (v[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// exactly n Python ints args[0 .. n) as int64 into v, else a TypeError naming the call's `usage` (false)
static bool n_ints(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t n, int64_t* v, const char* usage) {
  if (nargs != n) {
    PyErr_Format(PyExc_TypeError, "%s: %zd ints", usage, n);
    return false;
  }
  return int64s(args, n, v);
}

// step(entry, record, first, v0, ..., v_{n-1}) -> int: writes v0.. into the int64 slots first.. of the call record
// at address `record` (an AkCall, ctypes-owned), then runs entry 0 (ak_forward) or 2 (ak_decode) on it with the
// GIL released; returns the entry's code. Internal: the caller owns the record and vouches for every pointer in it.
static PyObject* py_step(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t head[3], vals[32];
  if (nargs < 3 || nargs - 3 > 32) {
    PyErr_SetString(PyExc_TypeError, "step(entry, record, first, *values): 3 to 35 ints");
    return nullptr;
  }
  if (!int64s(args, 3, head) || !int64s(args + 3, nargs - 3, vals)) return nullptr;
  const int64_t n = nargs - 3;
  if (head[1] == 0 || head[2] < 0 || head[2] > (int64_t)(sizeof(AkCall) / 8) - n || (head[0] != 0 && head[0] != 2)) {
    PyErr_SetString(PyExc_ValueError, "step: a null record, slots outside it, or an entry other than 0 / 2");
    return nullptr;
  }
  AkCall* c = reinterpret_cast<AkCall*>((intptr_t)head[1]);
  std::memcpy(reinterpret_cast<int64_t*>(c) + head[2], vals, n * 8);
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = head[0] == 0 ? ak_forward(c) : ak_decode(c);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

// suspect_rows(ptr, dtype, n0, n1, n2, n3, s0, s1, s2, s3, whole) -> bool: ak_suspect_rows
static PyObject* py_suspect_rows(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[11];
  if (!n_ints(args, nargs, 11, v, "suspect_rows(ptr, dtype, n0, n1, n2, n3, s0, s1, s2, s3, whole)")) return nullptr;
  return PyBool_FromLong(ak_suspect_rows(reinterpret_cast<const void*>((intptr_t)v[0]), (int)v[1], v[2], v[3], v[4],
                                         v[5], v[6], v[7], v[8], v[9], (int)v[10]));
}

// dense_tiles(mask, TB, TH, L, S, m0, m1, m2, m3, kinds, index, bits, cap) -> int: ak_dense_tiles (pointers as ints)
static PyObject* py_dense_tiles(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[13];
  if (!n_ints(args, nargs, 13, v, "dense_tiles(mask, TB, TH, L, S, m0, m1, m2, m3, kinds, index, bits, cap)"))
    return nullptr;
  const int64_t P = ak_dense_tiles(reinterpret_cast<const uint8_t*>((intptr_t)v[0]), v[1], v[2], v[3], v[4], v[5],
                                   v[6], v[7], v[8], reinterpret_cast<int8_t*>((intptr_t)v[9]),
                                   reinterpret_cast<int32_t*>((intptr_t)v[10]),
                                   reinterpret_cast<uint32_t*>((intptr_t)v[11]), v[12]);
  return PyLong_FromLongLong(P);
}

// tile_rows(kinds, index, bits, TB, L, S, lo, hi) -> bool: ak_tile_rows (pointers as ints)
static PyObject* py_tile_rows(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[8];
  if (!n_ints(args, nargs, 8, v, "tile_rows(kinds, index, bits, TB, L, S, lo, hi)")) return nullptr;
  return PyBool_FromLong(ak_tile_rows(reinterpret_cast<const int8_t*>((intptr_t)v[0]),
                                      reinterpret_cast<const int32_t*>((intptr_t)v[1]),
                                      reinterpret_cast<const uint32_t*>((intptr_t)v[2]), v[3], v[4], v[5],
                                      reinterpret_cast<int32_t*>((intptr_t)v[6]),
                                      reinterpret_cast<int32_t*>((intptr_t)v[7])));
}

// ---------------------------------------------------------------------------------------------------------------
// Stepper: a prepared call signature's per-call work in C (attnkit.backends._native._stepper). A replayed call —
// a decode step, a short prompt — spends more in Python around the kernel than in the kernel's own glue: reading
// strides and pointers, allocating the output, filling the record. A Stepper does that in one vectorcall: it
// checks the inputs against what the record was prepared for (dtypes, S, unit last strides; lo / hi as the
// prepared rows, two ints, or none), copies the record onto its own stack (no per-thread state: the GIL is released
// during the kernel, and two threads each fill their own copy), allocates the outputs with torch.empty, and runs
// the entry. Anything it does not recognise — a dtype or length it was not prepared for, a last stride other than
// 1, lo / hi of another shape — goes to `fallback`, the Python stepper, which fits the inputs or raises the error
// that names them. Internal: the record's pointers (lo / hi, tile map, slopes, program) are the caller's, kept alive
// by `keep`.
namespace {

struct Names {
  PyObject *dtype, *shape, *stride, *data_ptr, *is_contiguous;
};
Names names;

struct StepperObject {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  AkCall tmpl;           // the prepared record (per call: strides, S, pointers, outputs, scale written on a copy)
  int entry;             // 0 forward, 2 decode
  int64_t S;             // the prepared key count, or -1: any (decode)
  int64_t oshape[4];     // out (B, H, L, Dv)
  int64_t rows0, rows1;  // the prepared lo / hi shape (2-d: (1 or B, L)), or rows0 = -1: not 2-d (tensors refused)
  int span_rows;         // > 0: lo / hi may come as two ints, one interval for this many rows
  bool need_lse, with_lse, beside, has_prog;
  PyObject *dt, *odt, *f32, *i32;  // q / k / v's dtype, out's, torch.float32, torch.int32
  PyObject *empty;           // torch.empty
  PyObject *fallback;        // the Python stepper (same arguments)
  PyObject *on_read_error;   // called with a program's out-of-range flag (raises the error naming the table)
  PyObject* keep;            // what the record points into
  PyObject* cpu;             // torch.device("cpu"): the outputs' device (never the user's default device)
  PyObject* sizes[4];        // B, H, L, Dv as Python ints
  PyObject* kw;              // torch.empty's keyword names: ("dtype", "device")
};

// an int from a method call or attribute (-1 with an error set on failure)
int64_t long_of(PyObject* o) {
  if (o == nullptr) return -1;
  const int64_t v = PyLong_AsLongLong(o);
  Py_DECREF(o);
  return v;
}

PyObject* call0(PyObject* self, PyObject* name) {
  PyObject* args[1] = {self};
  return PyObject_VectorcallMethod(name, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
}

// a tensor's 4 strides into s (false: not 4 of them, or an error)
bool strides4(PyObject* t, int64_t* s) {
  PyObject* st = call0(t, names.stride);
  if (st == nullptr) return false;
  bool ok = PyTuple_Check(st) && PyTuple_GET_SIZE(st) == 4;
  for (int i = 0; ok && i < 4; i++) {
    s[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(st, i));
    ok = !(s[i] == -1 && PyErr_Occurred());
  }
  Py_DECREF(st);
  return ok;
}

// whether t's dtype is `want` (identity: torch's dtypes are singletons)
int dtype_is(PyObject* t, PyObject* want) {
  PyObject* d = PyObject_GetAttr(t, names.dtype);
  if (d == nullptr) return -1;
  const int same = d == want;
  Py_DECREF(d);
  return same;
}

// dim i of t's shape (-1 with an error set on failure; -2: fewer dims)
int64_t dim_of(PyObject* t, Py_ssize_t i) {
  PyObject* sh = PyObject_GetAttr(t, names.shape);
  if (sh == nullptr) return -1;
  int64_t v = -2;
  if (PyTuple_Check(sh) && PyTuple_GET_SIZE(sh) > i) v = PyLong_AsLongLong(PyTuple_GET_ITEM(sh, i));
  Py_DECREF(sh);
  return v;
}

// a prepared lo / hi tensor: int32, contiguous, of the prepared (rows0, rows1) shape -> its data pointer; 0 where it
// is not (the fallback says what is wrong), -1 with an error set
int64_t rows_ptr(StepperObject* s, PyObject* t) {
  if (s->rows0 < 0) return 0;
  const int same = dtype_is(t, s->i32);
  if (same <= 0) return same;
  PyObject* sh = PyObject_GetAttr(t, names.shape);
  if (sh == nullptr) return -1;
  const bool fits = PyTuple_Check(sh) && PyTuple_GET_SIZE(sh) == 2 &&
                    PyLong_AsLongLong(PyTuple_GET_ITEM(sh, 0)) == s->rows0 &&
                    PyLong_AsLongLong(PyTuple_GET_ITEM(sh, 1)) == s->rows1;
  Py_DECREF(sh);
  if (PyErr_Occurred()) return -1;
  if (!fits) return 0;
  PyObject* c = call0(t, names.is_contiguous);
  if (c == nullptr) return -1;
  const int contiguous = PyObject_IsTrue(c);
  Py_DECREF(c);
  if (contiguous <= 0) return contiguous;
  return long_of(call0(t, names.data_ptr));
}

PyObject* new_empty(StepperObject* s, int n, PyObject* dtype) {
  PyObject* args[6];
  for (int i = 0; i < n; i++) args[i] = s->sizes[i];
  args[n] = dtype;
  args[n + 1] = s->cpu;
  return PyObject_Vectorcall(s->empty, args, n, s->kw);
}

// a row interval's bound given as a Python int, saturated to int32 (the kernel clamps to [0, S]); false: an error
bool bound32(PyObject* o, int32_t* v) {
  int over = 0;
  const long long x = PyLong_AsLongLongAndOverflow(o, &over);
  if (x == -1 && PyErr_Occurred()) return false;
  *v = over > 0 || x > INT32_MAX ? INT32_MAX : over < 0 || x < INT32_MIN ? INT32_MIN : (int32_t)x;
  return true;
}

PyObject* stepper_call(PyObject* self_, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  StepperObject* s = reinterpret_cast<StepperObject*>(self_);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (kwnames != nullptr || (nargs != 4 && nargs != 6))
    return PyObject_Vectorcall(s->fallback, args, nargsf, kwnames);
  PyObject *q = args[0], *k = args[1], *v = args[2];
  AkCall c;
  std::memcpy(&c, &s->tmpl, sizeof(AkCall));
  int32_t err = 0;
  if (s->has_prog) c.perr = &err;
  // q, k, v as prepared: their dtype, k's and v's S, unit last strides (else the fallback: it fits or refuses)
  for (PyObject* t : {q, k, v}) {
    const int same = dtype_is(t, s->dt);
    if (same < 0) return nullptr;
    if (!same) return PyObject_Vectorcall(s->fallback, args, nargsf, nullptr);
  }
  const int64_t sk = dim_of(k, 2);
  if (sk == -1 && PyErr_Occurred()) return nullptr;
  const int64_t sv = dim_of(v, 2);
  if (sv == -1 && PyErr_Occurred()) return nullptr;
  if (sk < 0 || sk != sv || (s->S >= 0 && sk != s->S)) return PyObject_Vectorcall(s->fallback, args, nargsf, nullptr);
  int64_t qs[4], ks[4], vs[4];
  if (!strides4(q, qs) || !strides4(k, ks) || !strides4(v, vs)) {
    if (PyErr_Occurred()) return nullptr;
    return PyObject_Vectorcall(s->fallback, args, nargsf, nullptr);
  }
  if (qs[3] != 1 || ks[3] != 1 || vs[3] != 1) return PyObject_Vectorcall(s->fallback, args, nargsf, nullptr);
  // the scale: a Python float (or what converts to one), read after the checks (as the Python stepper's order)
  c.scale = PyFloat_AsDouble(args[3]);
  if (c.scale == -1.0 && PyErr_Occurred()) return nullptr;
  // lo / hi: the prepared rows (none given), one interval for every row (two ints), or this call's rows (tensors)
  std::vector<int32_t> span;
  if (nargs == 6 && args[4] != Py_None) {
    PyObject *lo = args[4], *hi = args[5];
    if (PyLong_Check(lo) || PyLong_Check(hi) || lo == Py_None || hi == Py_None) {
      // two exact ints: one interval for every row; anything else with an int or None in it (a bool, an int and a
      // tensor): the Python stepper says what it makes of it
      if (s->span_rows <= 0 || !PyLong_CheckExact(lo) || !PyLong_CheckExact(hi))
        return PyObject_Vectorcall(s->fallback, args, nargsf, nullptr);
      int32_t a, b;
      if (!bound32(lo, &a) || !bound32(hi, &b)) return nullptr;
      try {
        span.assign(2 * (size_t)s->span_rows, a);
      } catch (const std::bad_alloc&) {
        return PyErr_NoMemory();
      }
      std::fill(span.begin() + s->span_rows, span.end(), b);
      c.lo = span.data();
      c.hi = span.data() + s->span_rows;
    } else {
      const int64_t lp = rows_ptr(s, lo);
      if (lp == -1 && PyErr_Occurred()) return nullptr;
      const int64_t hp = lp > 0 ? rows_ptr(s, hi) : 0;
      if (hp == -1 && PyErr_Occurred()) return nullptr;
      if (lp <= 0 || hp <= 0) return PyObject_Vectorcall(s->fallback, args, nargsf, nullptr);
      c.lo = reinterpret_cast<const int32_t*>((intptr_t)lp);
      c.hi = reinterpret_cast<const int32_t*>((intptr_t)hp);
    }
  }
  int64_t ptr[3];
  for (int i = 0; i < 3; i++) {
    ptr[i] = long_of(call0(args[i], names.data_ptr));
    if (ptr[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  c.S = sk;
  for (int i = 0; i < 3; i++) c.sq[i] = qs[i], c.sk[i] = ks[i], c.sv[i] = vs[i];
  c.q = reinterpret_cast<const void*>((intptr_t)ptr[0]);
  c.k = reinterpret_cast<const void*>((intptr_t)ptr[1]);
  c.v = reinterpret_cast<const void*>((intptr_t)ptr[2]);
  // the outputs: out (and lse / out_r where returned) as tensors; an lse the kernel writes but nobody reads, on
  // this call's heap (the forward's rows need it)
  PyObject* out = new_empty(s, 4, s->odt);
  if (out == nullptr) return nullptr;
  PyObject *lse = nullptr, *out_r = nullptr;
  std::vector<float> scratch;
  int64_t op = long_of(call0(out, names.data_ptr)), lp = 0, rp = 0;
  if (op == -1 && PyErr_Occurred()) goto fail;
  if (s->with_lse) {
    lse = new_empty(s, 3, s->f32);
    if (lse == nullptr) goto fail;
    lp = long_of(call0(lse, names.data_ptr));
    if (lp == -1 && PyErr_Occurred()) goto fail;
  } else if (s->need_lse) {
    try {
      scratch.resize((size_t)(s->oshape[0] * s->oshape[1] * s->oshape[2]));
    } catch (const std::bad_alloc&) {
      PyErr_NoMemory();
      goto fail;
    }
    lp = (int64_t)(intptr_t)scratch.data();
  }
  if (s->beside) {
    out_r = new_empty(s, 4, s->dt);
    if (out_r == nullptr) goto fail;
    rp = long_of(call0(out_r, names.data_ptr));
    if (rp == -1 && PyErr_Occurred()) goto fail;
    c.out_r = reinterpret_cast<void*>((intptr_t)rp);
  }
  c.out = reinterpret_cast<float*>((intptr_t)op);
  c.lse = reinterpret_cast<float*>((intptr_t)lp);
  {
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = s->entry == 0 ? ak_forward(&c) : ak_decode(&c);
    Py_END_ALLOW_THREADS
    if (rc) {
      PyErr_Format(rc == AK_E_NOMEM ? PyExc_MemoryError : PyExc_RuntimeError,
                   "attnkit's compiled kernel refused the call (code %d; 1: no memory for its scratch)", rc);
      goto fail;
    }
  }
  if (err) {  // an index a score_mod computed left a captured tensor: the Python side names the table and raises
    PyObject* e = PyLong_FromLong(err);
    if (e == nullptr) goto fail;
    PyObject* r = PyObject_CallOneArg(s->on_read_error, e);
    Py_DECREF(e);
    if (r == nullptr) goto fail;
    Py_DECREF(r);
  }
  {
    PyObject* r = s->beside ? PyTuple_Pack(3, out, lse, out_r) : s->with_lse ? PyTuple_Pack(2, out, lse) : out;
    if (r != out) {
      Py_DECREF(out);
      Py_XDECREF(lse);
      Py_XDECREF(out_r);
    }
    return r;
  }
fail:
  Py_XDECREF(out);
  Py_XDECREF(lse);
  Py_XDECREF(out_r);
  return nullptr;
}

void stepper_dealloc(PyObject* self_) {
  StepperObject* s = reinterpret_cast<StepperObject*>(self_);
  PyTypeObject* tp = Py_TYPE(self_);
  for (PyObject* o :
       {s->dt, s->odt, s->f32, s->i32, s->empty, s->fallback, s->on_read_error, s->keep, s->kw, s->cpu})
    Py_XDECREF(o);
  for (PyObject* o : s->sizes) Py_XDECREF(o);
  PyObject_Free(self_);
  Py_DECREF(tp);  // (a heap type: each instance holds a reference to it)
}

PyMemberDef stepper_members[] = {
    {"keep", T_OBJECT_EX, offsetof(StepperObject, keep), READONLY, "what the prepared record points into"},
    {"fallback", T_OBJECT_EX, offsetof(StepperObject, fallback), READONLY, "the Python stepper (same arguments)"},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(StepperObject, vectorcall), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot stepper_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(stepper_dealloc)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, stepper_members},
    {Py_tp_doc, const_cast<char*>("A prepared call signature's per-call work in C (attnkit.backends._native).")},
    {0, nullptr}};

// made only by stepper() (a Stepper() of its own would hold null pointers), and immutable (Python 3.10+; the package
// needs 3.10)
PyType_Spec stepper_spec = {"attnkit._native.Stepper", sizeof(StepperObject), 0,
                            Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION |
                                Py_TPFLAGS_IMMUTABLETYPE,
                            stepper_slots};

PyObject* stepper_type = nullptr;  // made by the module's init

}  // namespace

// stepper(record, entry, S, B, H, L, Dv, rows0, rows1, span_rows, need_lse, with_lse, beside, has_prog, dt, odt,
// f32, i32, empty, fallback, on_read_error, keep, cpu) -> Stepper: `record` the prepared AkCall's bytes, entry 0 forward
// / 2 decode, S the prepared key count or -1 (any), (rows0, rows1) the prepared lo / hi shape (-1: tensors refused),
// span_rows > 0: lo / hi may come as two ints.
static PyObject* py_stepper(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 23) {
    PyErr_SetString(PyExc_TypeError, "stepper: 23 arguments (attnkit.backends._native._stepper)");
    return nullptr;
  }
  char* rec;
  Py_ssize_t n;
  if (PyBytes_AsStringAndSize(args[0], &rec, &n) < 0) return nullptr;
  int64_t v[13];
  if (!int64s(args + 1, 13, v)) return nullptr;
  if (n != (Py_ssize_t)sizeof(AkCall) || (v[0] != 0 && v[0] != 2) || !PyCallable_Check(args[18]) ||
      !PyCallable_Check(args[19]) || !PyCallable_Check(args[20])) {
    PyErr_SetString(PyExc_ValueError, "stepper: a record of another size, an entry other than 0 / 2, or a "
                                      "non-callable empty / fallback / on_read_error");
    return nullptr;
  }
  StepperObject* s = PyObject_New(StepperObject, reinterpret_cast<PyTypeObject*>(stepper_type));
  if (s == nullptr) return nullptr;
  s->vectorcall = stepper_call;
  s->kw = nullptr;
  for (PyObject** o : {&s->dt, &s->odt, &s->f32, &s->i32, &s->empty, &s->fallback, &s->on_read_error, &s->keep,
                       &s->cpu})
    *o = nullptr;
  for (int i = 0; i < 4; i++) s->sizes[i] = nullptr;
  std::memcpy(&s->tmpl, rec, sizeof(AkCall));
  s->entry = (int)v[0];
  s->S = v[1];
  for (int i = 0; i < 4; i++) s->oshape[i] = v[2 + i];
  s->rows0 = v[6], s->rows1 = v[7];
  s->span_rows = (int)v[8];
  s->need_lse = v[9] != 0, s->with_lse = v[10] != 0, s->beside = v[11] != 0, s->has_prog = v[12] != 0;
  PyObject** objs[9] = {&s->dt,       &s->odt,           &s->f32,  &s->i32, &s->empty,
                        &s->fallback, &s->on_read_error, &s->keep, &s->cpu};
  for (int i = 0; i < 9; i++) {
    Py_INCREF(args[14 + i]);
    *objs[i] = args[14 + i];
  }
  s->kw = Py_BuildValue("(ss)", "dtype", "device");
  bool ok = s->kw != nullptr;
  for (int i = 0; ok && i < 4; i++) ok = (s->sizes[i] = PyLong_FromLongLong(s->oshape[i])) != nullptr;
  if (!ok) {
    Py_DECREF(s);
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(s);
}

static PyMethodDef methods[] = {
    {"step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_step)), METH_FASTCALL,
     "step(entry, record, first, *values) -> int: fill a call record's per-call slots and run entry 0 (forward) or "
     "2 (decode), the GIL released. Internal (attnkit.backends._native)."},
    {"suspect_rows", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_suspect_rows)),
     METH_FASTCALL,
     "suspect_rows(ptr, dtype, n0, n1, n2, n3, s0, s1, s2, s3, whole) -> bool: ak_suspect_rows. Internal."},
    {"dense_tiles", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_dense_tiles)), METH_FASTCALL,
     "dense_tiles(mask, TB, TH, L, S, m0, m1, m2, m3, kinds, index, bits, cap) -> int: ak_dense_tiles. Internal."},
    {"tile_rows", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_tile_rows)), METH_FASTCALL,
     "tile_rows(kinds, index, bits, TB, L, S, lo, hi) -> bool: ak_tile_rows. Internal."},
    {"stepper", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_stepper)), METH_FASTCALL,
     "stepper(record, entry, S, B, H, L, Dv, rows0, rows1, span_rows, need_lse, with_lse, beside, has_prog, dt, odt, "
     "f32, i32, empty, fallback, on_read_error, keep) -> Stepper. Internal (attnkit.backends._native._stepper)."},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "attnkit's CPU attention kernel (C ABI, loaded with ctypes; the per-call hot path "
                                    "as two vectorcalls).", -1, methods, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__native(void) {
  if (names.dtype == nullptr) {  // the attribute names a Stepper reads, interned once (all or none: init fails)
    names.shape = PyUnicode_InternFromString("shape");
    names.stride = PyUnicode_InternFromString("stride");
    names.data_ptr = PyUnicode_InternFromString("data_ptr");
    names.is_contiguous = PyUnicode_InternFromString("is_contiguous");
    if (!names.shape || !names.stride || !names.data_ptr || !names.is_contiguous) return nullptr;
    if ((names.dtype = PyUnicode_InternFromString("dtype")) == nullptr) return nullptr;
  }
  if (stepper_type == nullptr && (stepper_type = PyType_FromSpec(&stepper_spec)) == nullptr) return nullptr;
  return PyModule_Create(&module);
}
