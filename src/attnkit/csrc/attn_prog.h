// score_mod programs (attnkit/_scoreprog.py traces them): a straight-line list of instructions run on a slab
// of 64 scores at once, forward (values) and backward (reverse mode: d(out)/d(score)). Included by
// attn_impl.h inside the instruction set's namespace (uses its vf / vi vectors).
//
// Registers hold 64 lanes of 32 bits: fp32 for floats, int32 for integers and conditions (0 / 1). Lane l of a
// slab is the score of query q0 + dq*l and key kv0 + dkv*l (a row of queries or a row of keys).

enum Op {
  P_SCORE, P_QIDX, P_KVIDX, P_BIDX, P_HIDX, P_CONSTF, P_CONSTI,
  P_ADD, P_SUB, P_MUL, P_DIV, P_FMIN, P_FMAX,
  P_IADD, P_ISUB, P_IMUL, P_IFLOORDIV, P_IMOD, P_IMIN, P_IMAX,
  P_NEG, P_ABS, P_SIGN, P_TANH, P_EXP, P_LOG, P_LOG1P, P_FLOOR,
  P_INEG, P_IABS, P_ISIGN,
  P_I2F, P_F2I,
  P_FLT, P_FLE, P_FEQ, P_FNE, P_ILT, P_ILE, P_IEQ, P_INE,
  P_AND, P_OR, P_NOT,
  P_WHERE, P_IWHERE, P_READF, P_READI
};
constexpr int PW = 7;  // int32 words per instruction: op, dst, a, b, c, d, e
constexpr int SL = 64;  // lanes per slab

struct Prog {
  const int32_t* code;
  long n, regs, out;
  const float* consts;
  const void* const* tables;  // float32 or int32 data, contiguous
  const int64_t* tshape;      // per table: its number of dims, then 4 sizes
  int32_t* err;               // set to (table + 1) when a read's index is out of range at a visible point
  float* const* tgrad;        // per table: its gradient (fp32, the table's size) to accumulate, or null
  long ntables;
};

constexpr int MAX_GRAD_TABLES = 16;

// One thread's gradient into the program's tables for its current work item: a buffer of the table's size per
// table, and the range of it the item touched (zeroed again after the item's share is added, in item order).
struct GradAcc {
  long nt = 0;
  float* buf[MAX_GRAD_TABLES] = {};
  long lo[MAX_GRAD_TABLES] = {}, hi[MAX_GRAD_TABLES] = {};
};

static inline vf fv(const int32_t* r) { return *(const vf_u*)r; }
static inline vi iv(const int32_t* r) { return *(const vi_u*)r; }
static inline void put(int32_t* r, vf x) { *(vf_u*)r = x; }
static inline void puti(int32_t* r, vi x) { *(vi_u*)r = x; }

// e^x for any x: 2^(x log2 e) by exp2v's series (exact exponent range up to 2^127; beyond: inf; below 2^-126: 0)
static inline vf expv(vf x) {
  vf y = x * splat(LOG2E);
  vi big = y > splat(127.0f);
  vf r = exp2v(big ? splat(0.f) : y);
  r = big ? splat(std::numeric_limits<float>::infinity()) : r;
  return x != x ? x : r;
}

// natural log: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh((m - 1) / (m + 1)) by its series
static inline vf logv(vf x) {
  vi sub = x < splat(1.17549435e-38f);  // subnormal (or <= 0): scale up by 2^23
  vf xs = sub ? x * splat(8388608.0f) : x;
  vi bits = (vi)xs;
  vi e = ((bits >> 23) & 0xff) - 127;
  vf m = (vf)((bits & 0x007fffff) | 0x3f800000);  // [1, 2)
  vi hi = m > splat(1.41421356f);
  m = hi ? m * splat(0.5f) : m;
  e = hi ? e + 1 : e;
  e = sub ? e - 23 : e;
  vf z = (m - splat(1.f)) / (m + splat(1.f)), z2 = z * z;
  vf p = splat(1.f / 13);
  p = p * z2 + splat(1.f / 11);
  p = p * z2 + splat(1.f / 9);
  p = p * z2 + splat(1.f / 7);
  p = p * z2 + splat(1.f / 5);
  p = p * z2 + splat(1.f / 3);
  p = p * z2 + splat(1.f);
  vf r = __builtin_convertvector(e, vf) * splat(LN2) + splat(2.f) * z * p;
  r = x == splat(0.f) ? splat(-std::numeric_limits<float>::infinity()) : r;
  r = x < splat(0.f) ? splat(std::numeric_limits<float>::quiet_NaN()) : r;
  r = x == splat(std::numeric_limits<float>::infinity()) ? x : r;
  return x != x ? x : r;
}

static inline vf log1pv(vf x) {  // log(1 + x) without losing small x: log(u) * x / (u - 1), u = 1 + x
  vf u = splat(1.f) + x;
  vf d = u - splat(1.f);
  vf r = logv(u) * (x / (d == splat(0.f) ? splat(1.f) : d));
  r = d == splat(0.f) ? x : r;
  r = u == splat(std::numeric_limits<float>::infinity()) ? u : r;
  return x != x ? x : r;
}

static inline vf tanhv(vf x) {
  vi neg = x < splat(0.f);
  vf a = neg ? -x : x;
  vf a2 = a * a;  // |x| < 0.3: the odd series to x^13 (error < 1e-9 relative)
  vf p = splat(-0.00359212803657248f);
  p = p * a2 + splat(0.008863235529902197f);
  p = p * a2 + splat(-0.021869488536155203f);
  p = p * a2 + splat(0.05396825396825397f);
  p = p * a2 + splat(-0.13333333333333333f);
  p = p * a2 + splat(0.3333333333333333f);
  vf small = a - a * a2 * p;
  vf e = expv(splat(2.f) * (a < splat(9.f) ? a : splat(9.f)));
  vf large = splat(1.f) - splat(2.f) / (e + splat(1.f));
  vf r = a < splat(0.3f) ? small : large;
  r = a >= splat(9.f) ? splat(1.f) : r;
  r = neg ? -r : r;
  return x != x ? x : r;
}

static inline vf floorv(vf x) {
  vi small = (x < splat(8388608.f)) & (x > splat(-8388608.f));
  vf t = __builtin_convertvector(__builtin_convertvector(small ? x : splat(0.f), vi), vf);
  t = t > x ? t - splat(1.f) : t;
  return small ? t : x;  // |x| >= 2^23 (and inf, NaN): already an integer
}

static inline vf signv(vf x) {
  vf r = (x > splat(0.f)) ? splat(1.f) : (x < splat(0.f) ? splat(-1.f) : splat(0.f));
  return x != x ? x : r;
}

static inline vi f2iv(vf x) {  // toward zero, clamped to int32 (the tracer bounds what may be used)
  vf c = x > splat(2147483520.f) ? splat(2147483520.f) : (x < splat(-2147483520.f) ? splat(-2147483520.f) : x);
  return __builtin_convertvector(c != c ? splat(0.f) : c, vi);
}

static inline int32_t floordiv1(int32_t a, int32_t b) {
  int32_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline int32_t mod1(int32_t a, int32_t b) {
  int32_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

// Runs the program on one slab: scores s (SL), query / key index of lane l = q0 + dq*l / kv0 + dkv*l, clamped
// to the last valid index (lanes past L or S are never visible). R: regs * SL words. Returns the result register.
static const int32_t* prog_run(const Prog& p, int32_t* R, const float* s, long b, long h, long q0, long dq,
                               long qmax, long kv0, long dkv, long kvmax) {
  for (long k = 0; k < p.n; k++) {
    const int32_t* c = p.code + k * PW;
    int32_t* d = R + (long)c[1] * SL;
    const int32_t* A = R + (long)c[2] * SL;
    const int32_t* Bq = R + (long)c[3] * SL;
    const int32_t* C = R + (long)c[4] * SL;
    switch (c[0]) {
      case P_SCORE: std::memcpy(d, s, SL * 4); break;
      case P_QIDX:
      case P_KVIDX: {  // lane l: first + step * l, clamped to the last valid index
        const long first = c[0] == P_QIDX ? q0 : kv0, step = c[0] == P_QIDX ? dq : dkv;
        const vi last = splati((int32_t)(c[0] == P_QIDX ? qmax : kvmax)), st = iota() * (int32_t)step;
        for (int l = 0; l < SL; l += VW) {
          const vi x = splati((int32_t)(first + step * l)) + st;
          puti(d + l, x < last ? x : last);
        }
        break;
      }
      case P_BIDX:
      case P_HIDX:
      case P_CONSTI: {
        const vi x = splati(c[0] == P_BIDX ? (int32_t)b : c[0] == P_HIDX ? (int32_t)h : c[2]);
        for (int l = 0; l < SL; l += VW) puti(d + l, x);
        break;
      }
      case P_CONSTF: {
        const vf x = splat(p.consts[c[2]]);
        for (int l = 0; l < SL; l += VW) put(d + l, x);
        break;
      }
      case P_READF:
      case P_READI: {
        const int64_t* sh = p.tshape + 5L * c[2];
        const int32_t* base = (const int32_t*)p.tables[c[2]];  // fp32 or int32: copied as 32-bit words
        for (int l = 0; l < SL; l += VW) {
          vi off = splati(0), bad = splati(0);
          for (long t = 0; t < sh[0]; t++) {  // the element's offset, VW lanes at a time (negative indices wrap)
            const vi n = splati((int32_t)sh[1 + t]);
            vi i = iv(R + (long)c[3 + t] * SL + l);
            i = i < 0 ? i + n : i;
            bad |= (i < 0) | (i >= n);
            i = i < 0 ? splati(0) : (i >= n ? n - 1 : i);  // never read outside the table
            off = off * n + i;
          }
          for (int j = 0; j < VW; j++) d[l + j] = base[off[j]];
          for (int j = 0; j < VW; j++)  // torch would raise: report a point inside (L, S) (its lanes' indices)
            if (bad[j] && q0 + dq * (l + j) <= qmax && kv0 + dkv * (l + j) <= kvmax && p.err)
              __atomic_store_n(p.err, c[2] + 1, __ATOMIC_RELAXED);
        }
        break;
      }
      case P_IFLOORDIV: for (int l = 0; l < SL; l++) d[l] = floordiv1(A[l], Bq[l]); break;
      case P_IMOD: for (int l = 0; l < SL; l++) d[l] = mod1(A[l], Bq[l]); break;
      default:
        for (int l = 0; l < SL; l += VW) {
          const vf a = fv(A + l), bb = fv(Bq + l);
          const vi ai = iv(A + l), bi = iv(Bq + l);
          switch (c[0]) {
            case P_ADD: put(d + l, a + bb); break;
            case P_SUB: put(d + l, a - bb); break;
            case P_MUL: put(d + l, a * bb); break;
            case P_DIV: put(d + l, a / bb); break;
            case P_FMIN: put(d + l, ((a < bb) | (a != a)) ? a : bb); break;  // torch.minimum propagates NaN
            case P_FMAX: put(d + l, ((a > bb) | (a != a)) ? a : bb); break;
            case P_IADD: puti(d + l, ai + bi); break;
            case P_ISUB: puti(d + l, ai - bi); break;
            case P_IMUL: puti(d + l, ai * bi); break;
            case P_IMIN: puti(d + l, ai < bi ? ai : bi); break;
            case P_IMAX: puti(d + l, ai > bi ? ai : bi); break;
            case P_NEG: put(d + l, -a); break;
            case P_ABS: put(d + l, (vf)((vi)a & 0x7fffffff)); break;
            case P_SIGN: put(d + l, signv(a)); break;
            case P_TANH: put(d + l, tanhv(a)); break;
            case P_EXP: put(d + l, expv(a)); break;
            case P_LOG: put(d + l, logv(a)); break;
            case P_LOG1P: put(d + l, log1pv(a)); break;
            case P_FLOOR: put(d + l, floorv(a)); break;
            case P_INEG: puti(d + l, -ai); break;
            case P_IABS: puti(d + l, ai < 0 ? -ai : ai); break;
            case P_ISIGN: puti(d + l, (ai > 0) ? splati(1) : (ai < 0 ? splati(-1) : splati(0))); break;
            case P_I2F: put(d + l, __builtin_convertvector(ai, vf)); break;
            case P_F2I: puti(d + l, f2iv(a)); break;
            case P_FLT: puti(d + l, (a < bb) & 1); break;
            case P_FLE: puti(d + l, (a <= bb) & 1); break;
            case P_FEQ: puti(d + l, (a == bb) & 1); break;
            case P_FNE: puti(d + l, (a != bb) & 1); break;
            case P_ILT: puti(d + l, (ai < bi) & 1); break;
            case P_ILE: puti(d + l, (ai <= bi) & 1); break;
            case P_IEQ: puti(d + l, (ai == bi) & 1); break;
            case P_INE: puti(d + l, (ai != bi) & 1); break;
            case P_AND: puti(d + l, ai & bi); break;
            case P_OR: puti(d + l, ai | bi); break;
            case P_NOT: puti(d + l, ai ^ 1); break;
            case P_WHERE: put(d + l, iv(A + l) != 0 ? fv(Bq + l) : fv(C + l)); break;
            case P_IWHERE: puti(d + l, iv(A + l) != 0 ? iv(Bq + l) : iv(C + l)); break;
            default: break;
          }
        }
    }
  }
  return R + p.out * SL;
}

// The instructions whose float operands take a share of the adjoint (the others: integer, comparison, sign,
// floor, casts, constants, reads have no gradient to pass on, and their operand fields need not be registers).
static inline bool passes_grad(int32_t op) {
  switch (op) {
    case P_ADD: case P_SUB: case P_MUL: case P_DIV: case P_FMIN: case P_FMAX: case P_NEG: case P_ABS: case P_TANH:
    case P_EXP: case P_LOG: case P_LOG1P: case P_WHERE:
      return true;
    default:
      return false;
  }
}

// Reverse mode over the slab the last prog_run left in R: with g = dL/d(result) per lane, writes dL/d(score)
// into ds. G: regs * SL floats of adjoints. Only float registers carry adjoints; reads of captured tensors do
// not (a tensor that requires grad is refused by the tracer).
static void prog_grad(const Prog& p, const int32_t* R, float* G, const float* g, float* ds, GradAcc* acc) {
  fill(G, G + p.regs * SL, 0.f);
  std::memcpy(G + p.out * SL, g, SL * 4);
  for (long k = p.n - 1; k >= 0; k--) {
    const int32_t* c = p.code + k * PW;
    const float* gd = G + (long)c[1] * SL;
    if (passes_grad(c[0])) {  // only then are its operand fields registers (else: a constant, a table index)
      float* ga = G + (long)c[2] * SL;
      float* gb = G + (long)c[3] * SL;
      float* gc = G + (long)c[4] * SL;
      const int32_t* A = R + (long)c[2] * SL;
      const int32_t* Bq = R + (long)c[3] * SL;
      const int32_t* Y = R + (long)c[1] * SL;
      for (int l = 0; l < SL; l += VW) {
        const vf gv = load(gd + l);
        const vf a = fv(A + l), bb = fv(Bq + l), y = fv(Y + l);
        switch (c[0]) {
          case P_ADD: store(ga + l, load(ga + l) + gv); store(gb + l, load(gb + l) + gv); break;
          case P_SUB: store(ga + l, load(ga + l) + gv); store(gb + l, load(gb + l) - gv); break;
          case P_MUL: store(ga + l, load(ga + l) + gv * bb); store(gb + l, load(gb + l) + gv * a); break;
          case P_DIV: store(ga + l, load(ga + l) + gv / bb); store(gb + l, load(gb + l) - gv * y / bb); break;
          case P_FMIN:
          case P_FMAX: {  // torch's rule: the chosen side takes the gradient, a tie splits it in halves
            const vi pick_a = c[0] == P_FMIN ? (a < bb) : (a > bb);
            const vi tie = a == bb;
            const vf half = gv * splat(0.5f);
            store(ga + l, load(ga + l) + (tie ? half : (pick_a ? gv : splat(0.f))));
            store(gb + l, load(gb + l) + (tie ? half : (pick_a ? splat(0.f) : gv)));
            break;
          }
          case P_NEG: store(ga + l, load(ga + l) - gv); break;
          case P_ABS: store(ga + l, load(ga + l) + gv * signv(a)); break;
          case P_TANH: store(ga + l, load(ga + l) + gv * (splat(1.f) - y * y)); break;
          case P_EXP: store(ga + l, load(ga + l) + gv * y); break;
          case P_LOG: store(ga + l, load(ga + l) + gv / a); break;
          case P_LOG1P: store(ga + l, load(ga + l) + gv / (splat(1.f) + a)); break;
          case P_WHERE: {
            const vi cond = iv(A + l) != 0;
            store(gb + l, load(gb + l) + (cond ? gv : splat(0.f)));
            store(gc + l, load(gc + l) + (cond ? splat(0.f) : gv));
            break;
          }
          default: break;
        }
      }
    } else if (c[0] == P_READF && acc && p.tgrad && p.tgrad[c[2]]) {  // into a learnable table, at the read's element
      const int64_t* sh = p.tshape + 5L * c[2];
      float* buf = acc->buf[c[2]];
      long& lo = acc->lo[c[2]];
      long& hi = acc->hi[c[2]];
      for (int l = 0; l < SL; l++) {
        if (gd[l] == 0.f) continue;  // masked / unseen points: exactly 0 (never 0 * a garbage score)
        long off = 0;
        for (long t = 0; t < sh[0]; t++) {
          const long n = sh[1 + t];
          long i = R[(long)c[3 + t] * SL + l];
          i = i < 0 ? i + n : i;
          i = i < 0 ? 0 : (i >= n ? n - 1 : i);
          off = off * n + i;
        }
        buf[off] += gd[l];
        lo = off < lo ? off : lo;
        hi = off + 1 > hi ? off + 1 : hi;
      }
    }
  }
  std::memcpy(ds, G, SL * 4);  // register 0 is the score
}
