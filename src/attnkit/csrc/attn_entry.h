// Per-instruction-set entry points (the call record: attn_common.h), inside AK_NS.
namespace AK_NS {

static Shape shape_of(const AkCall* c, Prog* prog) {
  Shape s;
  s.prog = nullptr;
  if (c->pcode) {
    *prog = Prog{c->pcode,   (long)c->pn,  (long)c->pregs, (long)c->pout,    c->pconsts,
                 c->ptables, c->ptshape, c->perr,       c->ptgrad, (long)c->pntables};
    s.prog = prog;
  }
  s.B = c->B, s.H = c->H, s.Hkv = c->Hkv, s.L = c->L, s.S = c->S, s.D = c->D, s.Dv = c->Dv;
  for (int i = 0; i < 3; i++) s.sq[i] = c->sq[i], s.sk[i] = c->sk[i], s.sv[i] = c->sv[i];
  s.lo = c->lo, s.hi = c->hi, s.lob = c->lob;
  s.threads = (int)c->threads;
  s.scale = (float)c->scale;
  s.alibi = c->alibi;
  s.tkind = c->tkind, s.tidx = c->tidx, s.tbits = c->tbits, s.tkb = c->tkb, s.tkh = c->tkh;
  s.dt = (int)c->dtype;
  s.bdot = false;
#if AK_BDOT
  s.bdot = ak_bf16_dot != 0 && s.dt == AK_BF16 && amx_usable();
#endif
  return s;
}

// Whether the forward can multiply bf16 on AMX tiles here (attn_amx.h)
bool amx_available() {
#if AK_BDOT
  return amx_usable();
#else
  return false;
#endif
}

// Whether the decode's bf16 scores can take avx512_bf16's vector dot products here (attn_decode.h, dots_bdot)
bool vdot_available() {
#if AK_BDOT
  return bdot_cpu();
#else
  return false;
#endif
}

int run_forward(const AkCall* c) {
  if (c->dtype < AK_F32 || c->dtype > AK_F16) return AK_E_ARG;
  Prog prog;
  if (c->ort && c->out_r) return AK_E_ARG;  // one rounded output: out itself, or out_r beside an fp32 out
  if (c->ort) {
    forward(shape_of(c, &prog), c->q, c->k, c->v, nullptr, c->lse, c->out);
  } else {
    forward(shape_of(c, &prog), c->q, c->k, c->v, c->out, c->lse, c->out_r);
  }
  return AK_OK;
}

int run_backward(const AkCall* c) {
  if (c->dtype < AK_F32 || c->dtype > AK_F16) return AK_E_ARG;
  const long sd[4] = {(long)c->sdo[0], (long)c->sdo[1], (long)c->sdo[2], (long)c->sdo[3]};
  Prog prog;
  const Shape s = shape_of(c, &prog);
  if (rows_backward_fits(s))  // a few query rows: the rows of a kv head as one unit (attn_decode.h)
    return rows_backward(s, c->q, c->k, c->v, c->dout, sd, c->fwd_out, c->fwd_lse, c->dlse, c->dq, c->dk, c->dv,
                         c->grads_r != 0);
  return backward(s, c->q, c->k, c->v, c->dout, sd, c->fwd_out, c->fwd_lse, c->dlse, c->dq, c->dk, c->dv,
                  c->grads_r != 0);
}

}  // namespace AK_NS
