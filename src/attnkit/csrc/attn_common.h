// Shared by every instruction-set build of the kernel: headers and the C ABI's call record.
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <sched.h>

// The AVX2 / AVX-512 builds' fp16 conversion and lane reductions (attn_decode.h) use intrinsics, with GCC only:
// its `#pragma GCC target` enables them per build (it does not define __AVX2__ and friends, so the builds are told
// apart by AK_VW); elsewhere (clang ignores the pragma) the portable code serves every build.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define AK_X86_INTRIN 1
#else
#define AK_X86_INTRIN 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

// Bumped whenever AkCall changes; the caller (attnkit/backends/_native.py) sends the version and
// sizeof(AkCall) it was built for, and a call whose record does not match is refused (returns AK_E_ABI).
#define AK_ABI_VERSION 10

enum { AK_OK = 0, AK_E_NOMEM = 1, AK_E_ABI = 2, AK_E_ARG = 3 };

// The decode's read order (attn_decode.h), for every call: -1 as each call's record says (AkCall::order; the
// default), 0 register-blocked, 1 memory order (units of up to 8 rows). Set by ak_set_decode_order (tests and
// benchmarks force one: both orders give the same bits).
extern int ak_decode_order;

// Where a decode call's record leaves the read order to the rule (no calibration) and the rule would read K and V in
// memory order (units of up to FEW_ROWS rows over at least STREAM_BYTES), the order is learned instead, per call shape
// (dtype, threads, unit rows, the bytes' power of two, the instruction set's vector width, bf16 dot products on): the first call of a shape runs register-blocked, untimed (its
// warm-up), the next ones alternate the two orders, each timed, and from three timings of each the faster (by its
// fastest) serves every later call of the shape. Both orders give the same bits, so what is learned changes only the
// time. ak_order_choice(key, &timed): the order to run (0 register-blocked, 1 memory) and whether to time this call;
// ak_order_sample(key, order, seconds): a timed call's time. ak_decode_learn: 1 learn (the default), 0 the rule
// (ak_set_decode_learn; tests and benchmarks).
extern std::atomic<int> ak_decode_learn;
int ak_order_choice(int64_t key, int* timed);
void ak_order_sample(int64_t key, int order, double seconds);

// The forward's bf16 matrix products on AMX tiles (attn_amx.h; the AVX-512 build, on a CPU with AMX): 1 used for
// bf16 calls (the default), 0 never (bf16 widened to fp32 per tile, as on every other CPU).
// Set by ak_set_bf16_dot (tests compare both; ATTNKIT_NATIVE_BF16_DOT=0).
extern int ak_bf16_dot;

// Element type of q, k, v (AkCall::dtype): fp32, bf16 or fp16 (the last two widened to fp32 in registers).
enum { AK_F32 = 0, AK_BF16 = 1, AK_F16 = 2 };
// the exponent bits of an element of dtype dt (all set: inf or NaN; above them, within the magnitude bits: NaN)
static inline uint32_t ak_exp_bits(int dt) { return dt == AK_F32 ? 0x7f800000u : dt == AK_BF16 ? 0x7f80u : 0x7c00u; }

// One kernel call, forward or backward. Shapes: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv); strides in
// elements (batch, head, row), the last dimension contiguous. The mask is per-row key intervals lo/hi
// (int32, (1 or B, L); row i sees keys [lo, hi)) and, optionally, a tile map over 64 x 64 tiles:
// tkind int8 (TB, TH, nq, nk) 0 empty / 1 partial / 2 full, with batch / head strides tkb / tkh (0:
// shared), tidx int32 the same shape (a partial tile's bit mask in tbits), tbits uint32 (P, 2, 64): per
// query row of a tile, keys 0-31 in plane 0 and 32-63 in plane 1, bit set = attend. With a tile map the
// intervals only bound the keys (the caller passes [0, S)).
// Decode (ak_decode): the same record, with dtype (q, k, v's element type: AK_F32 / AK_BF16 / AK_F16) and chunk
// (keys per split-K chunk, a multiple of 64; 0: chosen from S); no tile map; ALiBi's slopes or a score_mod
// program as in the forward (no table gradients); writes out (fp32, or with ort of the input dtype), lse.
// The forward and the backward take the same three dtypes (q, k, v and dout alike; widened per tile) and write
// fp32 (out, lse, dq, dk, dv) unless told to round: the forward's out_r (or, with ort, out itself) and, with
// grads_r, dq / dk / dv take the input dtype, rounded to nearest even as torch's .to() rounds (a NaN stays NaN),
// so a bf16 / fp16 call needs no fp32 copy and no conversion pass of its own; fwd_out, fwd_lse and dlse are fp32.
struct AkCall {
  int64_t size, version;
  int64_t B, H, Hkv, L, D, Dv;
  int64_t sq[3];
  // what changes from one decode step to the next, in one block (the caller writes it with one store):
  // the key count, K / V strides, the input pointers and the outputs (forward: out (B, H, L, Dv), lse (B, H, L))
  int64_t S;
  int64_t sk[3], sv[3];
  const void *q, *k, *v;
  const int32_t *lo, *hi;
  float *out, *lse;
  int64_t sdo[4];  // dO's strides (backward; any, e.g. 0 for an expanded gradient)
  int64_t lob;     // batch stride of lo / hi (0 or L)
  int64_t threads;
  int64_t tkb, tkh;
  int64_t dtype, chunk;
  double scale;
  const float* alibi;  // (H,) ALiBi slopes, or null
  const int8_t* tkind;
  const int32_t* tidx;
  const uint32_t* tbits;
  // a score_mod program (attn_prog.h), or pcode null: pn instructions of 7 int32, pregs registers, pout the
  // result register, constants, tables (fp32 / int32 data) and per table its dims and 4 sizes
  const int32_t* pcode;
  int64_t pn, pregs, pout;
  const float* pconsts;
  const void* const* ptables;
  const int64_t* ptshape;
  int32_t* perr;  // set to (table + 1) when a read's index is out of range at a point inside (L, S)
  float* const* ptgrad;  // per table: its gradient to accumulate (fp32, the table's size; backward), or null
  int64_t pntables;
  // backward: reads the forward's out (contiguous) and lse, dout (strides sdo), dlse (or null); writes dq, dk, dv
  const void* dout;
  const float *fwd_out, *fwd_lse, *dlse;
  float *dq, *dk, *dv;
  // decode: each row sees the union of nst stretches of keys (0 or 1: one), stretch k's lo / hi at lo + k * lst /
  // hi + k * lst (elements); at most AK_MAX_STRETCHES (an empty stretch, lo >= hi, adds nothing)
  int64_t nst, lst;
  // forward: ort 1 -> out is of the input dtype (rounded; no fp32 out written); else out_r, when not null, gets
  // out rounded to the input dtype besides the fp32 out. backward: grads_r 1 -> dq, dk, dv of the input dtype.
  int64_t ort;
  void* out_r;
  int64_t grads_r;
  // decode: K and V's read order (unless ak_decode_order forces one): 0 the per-call rule (memory order from
  // STREAM_BYTES of K and V, in units of <= FEW_ROWS rows), 1 register-blocked, 2 memory order (where the units
  // allow). The caller fills it from this machine's calibration (a zeroed record: the rule).
  int64_t order;
};
#define AK_MAX_STRETCHES 8
