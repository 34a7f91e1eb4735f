// Per-instruction-set entry points (meta: see attn_dispatch.cpp), inside AK_NS.
namespace AK_NS {

static Shape shape_of(const int64_t* meta, float scale) {
  Shape s;
  s.B = meta[0], s.H = meta[1], s.Hkv = meta[2], s.L = meta[3], s.S = meta[4], s.D = meta[5], s.Dv = meta[6];
  for (int i = 0; i < 3; i++) s.sq[i] = meta[7 + i], s.sk[i] = meta[10 + i], s.sv[i] = meta[13 + i];
  s.lob = meta[16];
  s.threads = (int)meta[17];
  s.scale = scale;
  s.alibi = nullptr;
  return s;
}

void run_forward(const int64_t* meta, float scale, const float* q, const float* k, const float* v, const int32_t* lo,
                 const int32_t* hi, const float* alibi, float* out, float* lse) {
  Shape s = shape_of(meta, scale);
  s.lo = lo, s.hi = hi, s.alibi = alibi;
  forward(s, q, k, v, out, lse);
}

int run_backward(const int64_t* meta, float scale, const float* q, const float* k, const float* v, const int32_t* lo,
                  const int32_t* hi, const float* alibi, const float* dout, const int64_t* sdo, const float* out,
                  const float* lse,
                  const float* dlse, float* dq, float* dk, float* dv) {
  Shape s = shape_of(meta, scale);
  s.lo = lo, s.hi = hi, s.alibi = alibi;
  long sd[4] = {(long)sdo[0], (long)sdo[1], (long)sdo[2], (long)sdo[3]};
  return backward(s, q, k, v, dout, sd, out, lse, dlse, dq, dk, dv);
}

}  // namespace AK_NS
