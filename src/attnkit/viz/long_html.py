"""The offline page of a :class:`~attnkit.TileMass`: a zoomable map of attention mass.

One self-contained HTML file: inline CSS and plain JS drawing on a canvas, the data embedded
as base64 float32/int32 arrays, no external library, no network request. What it embeds::

    tiles   int32 (T, 2)          (query block, key block) of every non-empty tile at the finest
                                  level that fits ``max_bytes`` (the TileMass's own tiles, or
                                  2×2, 4×4 ... of them summed; mass is additive)
    mass    float32 (H + 1, T)    per head, then the mean of heads
    live    float32 (H + 1, nq)   live query rows per block (share = mass / live)
    rows    a few query rows' exact weights (per head and mean) over the keys they see,
            per key, or summed into at most 2048 bins when they see more
    top     per map, head and the mean: the 6 heaviest tiles away from the diagonal (the list
            on the page follows the map and head picked)
    open    the map the page opens on (the one a caller's summary names, e.g. a model's
            heaviest layer)

The page builds coarser levels in JS (sums of 2×2 tiles) and draws the level whose tiles
are at least 2 px at the current zoom: drag a rectangle (or click) to zoom in.
"""

from __future__ import annotations

import base64
import html as _html
import json

import numpy as np

from .._args import as_int
from ._checks import need_kind

__all__ = ["tile_mass_page", "ROW_BINS"]

ROW_BINS = 2048  # most values per embedded row and head


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def _coarsen(tiles: np.ndarray, mass: np.ndarray, live: np.ndarray, f: int):
    """Tiles of ``f × f`` finer tiles: masses summed, live rows summed over ``f`` query blocks."""
    if f == 1:
        return tiles, mass, live
    ct = tiles // f
    nkc = int(ct[:, 1].max()) + 1 if len(ct) else 1
    key = ct[:, 0].astype(np.int64) * nkc + ct[:, 1]
    uniq, inv = np.unique(key, return_inverse=True)
    out = np.zeros((mass.shape[0], uniq.size), dtype=np.float64)
    for h in range(mass.shape[0]):
        out[h] = np.bincount(inv, weights=mass[h], minlength=uniq.size)
    nqc = -(-live.shape[1] // f)
    lv = np.zeros((live.shape[0], nqc))
    for h in range(live.shape[0]):
        lv[h] = np.bincount(np.arange(live.shape[1]) // f, weights=live[h], minlength=nqc)
    return np.stack([uniq // nkc, uniq % nkc], 1), out, lv


def _default_rows(tm, n=8):
    L = tm.L
    rows = sorted({min(L - 1, int(L * (k + 0.5) / n)) for k in range(n)})
    return rows


def _row_payload(tm, rows, b):
    """Per embedded row: its key span, bin width and weights (H + 1, bins), base64 float32."""
    bm, bn = tm.block
    out = []
    for i in rows:
        qb = i // bm
        live = tm.tiles[tm._row_start[qb]:tm._row_start[qb + 1], 1].numpy()
        if live.size == 0:
            out.append({"i": int(i), "j0": 0, "j1": 0, "bin": 1, "w": ""})
            continue
        j0, j1 = int(live.min()) * bn, min(tm.S, (int(live.max()) + 1) * bn)
        w = tm.row_weights(int(i), b=b)[:, j0:j1].double().numpy()  # (H, n)
        w = np.concatenate([w, w.mean(0, keepdims=True)], 0)
        binw = max(1, -(-(j1 - j0) // ROW_BINS))
        if binw > 1:
            pad = (-w.shape[1]) % binw
            w = np.pad(w, ((0, 0), (0, pad))).reshape(w.shape[0], -1, binw).sum(-1)
        out.append({"i": int(i), "j0": j0, "j1": j1, "bin": binw, "w": _b64(w.astype(np.float32))})
    return out


def tile_mass_page(tm, *, title=None, rows=None, b: int = 0, max_bytes: int = 4_000_000, embed: bool = False,
                   maps=None) -> str:
    """The page's HTML text for ``tm`` (batch row ``b``); ``maps``: optional ``[(name, TileMass), ...]``
    of the same sizes (e.g. one per layer), selectable on the page; the page opens on ``tm``'s
    entry of ``maps``, and its heaviest-tiles list follows the layer and head picked. ``embed=True``
    wraps the page in an ``<iframe srcdoc>`` for a notebook cell."""
    what, fix = "an attnkit.tile_mass(q, k) TileMass", "Make one with attnkit.tile_mass(q, k, mask=...)"
    need_kind("tm", tm, ("tiles", "mass", "L", "S", "H", "block"), what, fix)
    maps = [("", tm)] if maps is None else list(maps)
    for i, entry in enumerate(maps):
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise TypeError(f"maps: expected a list of (name, TileMass) pairs, got {type(entry).__name__} at {i}.")
        need_kind(f"maps[{i}][1]", entry[1], ("tiles", "mass", "L", "S", "H", "block"), what, fix)
        sizes = {k: getattr(entry[1], k) for k in ("B", "H", "L", "S", "block")}
        if sizes != {k: getattr(tm, k) for k in sizes}:  # one page draws one grid: each map is read on tm's
            raise ValueError(f"maps[{i}]: expected a TileMass of tm's sizes "
                             f"({', '.join(f'{k}={getattr(tm, k)}' for k in sizes)}), got "
                             f"{', '.join(f'{k}={v}' for k, v in sizes.items())}. Compute every map from inputs of "
                             "the same shape with the same block.")
    tm._check_bh(b, None)
    if rows is None:
        rows = _default_rows(tm, 8 if len(maps) == 1 else 6)
    given = list(rows)
    picked = [as_int(r) for r in given]
    for r, got in zip(given, picked, strict=True):
        if got is None or not 0 <= got < tm.L:
            raise ValueError(f"rows: expected query rows, ints in 0..{tm.L - 1}, got {r!r}.")
    rows = sorted(set(picked))
    H = tm.H
    payload = []
    row_bytes = 0
    for name, m in maps:
        rp = _row_payload(m, rows, b)
        row_bytes += sum(len(r["w"]) for r in rp)
        payload.append({"name": name, "rows": rp, "m": m})
    budget = max_bytes - row_bytes - 60_000  # the page's own HTML/JS
    f = 1
    while True:  # the finest level whose tiles (of every map: a layer's mask may differ) fit the budget (base64: 4/3)
        n = sum(len(np.unique((t // f)[:, 0].astype(np.int64) * (10 ** 9) + (t // f)[:, 1]))
                for t in (m.tiles.numpy() for _, m in maps))
        need = n * (8 + 4 * (H + 1)) * 4 // 3
        if need <= budget or f >= max(tm.shape):
            break
        f *= 2
    bm, bn = tm.block
    data = {"L": tm.L, "S": tm.S, "bm": bm * f, "bn": bn * f, "H": H, "rows": rows, "maps": [],
            "labels": list(tm.labels) if tm.labels is not None else None,
            "title": title or "Attention mass per tile", "sub": "", "top": []}
    for p in payload:
        m = p["m"]
        mass = m.mass[b].double().numpy()
        mass = np.concatenate([mass, mass.mean(0, keepdims=True)], 0)
        live = m.live_rows[b].double().numpy()
        live = np.concatenate([live, live.mean(0, keepdims=True)], 0)
        t, ms, lv = _coarsen(m.tiles.numpy(), mass, live, f)
        # the heaviest tiles away from the diagonal, per head and for the mean (index H): the list
        # on the page follows the layer and head picked
        top = [[{"mass": m_, "share": s_, "q": list(qr), "k": list(kr)}
                for m_, s_, qr, kr in m.top(6, b=b, head=h, off_diagonal=True)] for h in [*range(H), None]]
        data["maps"].append({"name": p["name"], "T": int(t.shape[0]),
                             "tiles": _b64(t.astype(np.int32)), "mass": _b64(ms.astype(np.float32)),
                             "live": _b64(lv.astype(np.float32)), "rows": p["rows"], "top": top})
    tot = tm.kinds.numel()
    data["sub"] = (f"B={tm.B} (showing b={b}) · H={H} heads · L={tm.L} queries · S={tm.S} keys · mask: "
                   f"{tm.mask_name or 'none'} · tiles {bm}×{bn}: {tm.tiles.shape[0]} of {tot} computed "
                   f"({100 * tm.tiles.shape[0] / max(1, tot):.2f}%) in {tm.seconds:.2f} s"
                   + (f" · page tiles {bm * f}×{bn * f}" if f > 1 else ""))
    # the page opens on tm's map: the one a caller's summary (and the heaviest-tiles list) speaks of
    data["open"] = next((i for i, (_, m) in enumerate(maps) if m is tm), 0)
    names = [n for n, _ in maps]
    data["maplabel"] = "layer" if len(names) > 1 and all(n.startswith("layer ") for n in names) else "map"
    page = _PAGE.replace("__TITLE__", _html.escape(data["title"])).replace(
        "__DATA__", json.dumps(data, separators=(",", ":")).replace("</", "<\\/"))
    if embed:
        return (f'<iframe srcdoc="{_html.escape(page, quote=True)}" style="width:100%;height:1080px;border:0" '
                f'title="{_html.escape(data["title"])}"></iframe>')
    return page


_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px 20px;color:#1f2933;background:#fff}
h1{font-size:20px;margin:0 0 2px}#sub{color:#52606d;font-size:12.5px;margin-bottom:10px}
#bar{display:flex;gap:10px;align-items:center;flex-wrap:wrap;margin-bottom:8px}
button,select{font:inherit;padding:2px 8px}
#wrap{display:flex;gap:18px;align-items:flex-start}
#side{width:330px;font-size:13px}
#readout{white-space:pre-line;min-height:64px;background:#f5f7fa;border:1px solid #e4e7eb;border-radius:4px;
  padding:6px 8px;font-variant-numeric:tabular-nums}
#legend{margin:10px 0}#legendbar{height:12px;border:1px solid #9aa5b1}
#legendticks{display:flex;justify-content:space-between;font-size:11px;color:#52606d}
#top li{cursor:pointer;color:#1d4ed8}#top li:hover{text-decoration:underline}
.hint{color:#7b8794;font-size:12px}
canvas{display:block}
#rowpanel{margin-top:12px}#rowread{font-size:12px;color:#3e4c59;min-height:18px;font-variant-numeric:tabular-nums}
</style></head>
<body data-ready="0">
<h1 id="title"></h1><div id="sub"></div>
<div id="bar"><label id="mapl"><span id="maplabel">map</span> <select id="map"></select></label>
<label>head <select id="head"></select></label>
<button id="back">◀ back</button><button id="reset">whole input</button>
<span id="viewtxt" class="hint"></span></div>
<div id="wrap"><div><canvas id="map2d" width="700" height="560"></canvas>
<div id="rowpanel"><div id="rowtitle" style="font-weight:600"></div>
<canvas id="rowc" width="700" height="150"></canvas><div id="rowread"></div></div></div>
<div id="side"><div id="readout">Hover a tile: its query and key range, mass and share.</div>
<div id="legend"><div id="legendbar"></div><div id="legendticks"></div>
<div class="hint">colour: share of the query rows' attention that lands in the tile (log scale);
grey: tile empty under the mask (never computed)</div></div>
<div class="hint">Drag a rectangle to zoom into it, or click to zoom ×4 around a point (and pick the nearest
row below). Finer tiles appear as you zoom.</div>
<h3 style="font-size:14px;margin:12px 0 4px">Heaviest tiles away from the diagonal (<span id="topwho"></span>)</h3>
<ol id="top"></ol>
<label>row <select id="rowsel"></select></label></div></div>
<script>
"use strict";
(function(){
const D=__DATA__;
function b64(s,T){const bin=atob(s),u=new Uint8Array(bin.length);for(let i=0;i<bin.length;i++)u[i]=bin.charCodeAt(i);
  return new T(u.buffer);}
const $=id=>document.getElementById(id);
const H=D.H,NH=H+1,L=D.L,S=D.S;
const cv=$("map2d"),cx=cv.getContext("2d"),rc=$("rowc"),rx=rc.getContext("2d");
const M0={l:70,t:14,r:14,b:44};const PW=cv.width-M0.l-M0.r,PH=cv.height-M0.t-M0.b;
// colour: a dark-blue → teal → yellow ramp of our own, on log10(share) from -4 to 0
const STOPS=[[0,[24,30,74]],[0.3,[37,92,153]],[0.55,[32,160,150]],[0.8,[158,204,76]],[1,[250,230,60]]];
function ramp(t){t=Math.max(0,Math.min(1,t));for(let i=1;i<STOPS.length;
  i++){if(t<=STOPS[i][0]){const[a,ca]=STOPS[i-1],[b,cb]=STOPS[i];const u=(t-a)/(b-a);
  return"rgb("+ca.map((c,k)=>Math.round(c+(cb[k]-c)*u)).join(",")+")";}}return"rgb(250,230,60)";}
function colour(share){return share<=0?"rgb(16,20,52)":ramp((Math.log10(share)+4)/4);}
const maps=D.maps.map(m=>{const t=b64(m.tiles,Int32Array),ms=b64(m.mass,Float32Array),lv=b64(m.live,Float32Array);
  const lev=[{f:1,T:m.T,q:new Int32Array(m.T),k:new Int32Array(m.T),mass:ms,live:lv,nq:lv.length/NH}];
  for(let i=0;i<m.T;i++){lev[0].q[i]=t[2*i];lev[0].k[i]=t[2*i+1];}
  while(true){const p=lev[lev.length-1];if(p.nq<=1&&p.T<=1)break;const f=p.f*2,idx=new Map();const q=[],k=[];
    for(let i=0;i<p.T;i++){const a=p.q[i]>>1,c=p.k[i]>>1,key=a*1048576+c;if(!idx.has(key)){idx.set(key,q.length);
      q.push(a);k.push(c);}}
    const T=q.length,mass=new Float32Array(NH*T),nq=Math.ceil(p.nq/2),live=new Float32Array(NH*nq);
    for(let i=0;i<p.T;i++){const j=idx.get((p.q[i]>>1)*1048576+(p.k[i]>>1));for(let h=0;h<NH;
      h++)mass[h*T+j]+=p.mass[h*p.T+i];}
    for(let h=0;h<NH;h++)for(let a=0;a<p.nq;a++)live[h*nq+(a>>1)]+=p.live[h*p.nq+a];
    lev.push({f,T,q:Int32Array.from(q),k:Int32Array.from(k),mass,live,nq});if(T===p.T&&nq===p.nq)break;
      if(lev.length>24)break;}
  return{name:m.name,lev,rows:m.rows.map(r=>({i:r.i,j0:r.j0,j1:r.j1,bin:r.bin,w:r.w?b64(r.w,
    Float32Array):new Float32Array(0)}))};});
let st={map:D.open,head:H,x0:0,x1:S,y0:0,y1:L,row:0};const hist=[];
$("title").textContent=D.title;$("sub").textContent=D.sub;$("maplabel").textContent=D.maplabel;
if(maps.length>1){maps.forEach((m,i)=>{const o=document.createElement("option");o.value=i;o.textContent=m.name;
  $("map").appendChild(o);});$("map").value=D.open;}else{$("mapl").style.display="none";}
{const o=document.createElement("option");o.value=H;o.textContent="mean of heads";$("head").appendChild(o);for(let h=0;
  h<H;h++){const p=document.createElement("option");p.value=h;p.textContent="head "+h;$("head").appendChild(p);}}
$("head").value=H;
maps[0].rows.forEach((r,n)=>{const o=document.createElement("option");o.value=n;o.textContent="query "+r.i;
  $("rowsel").appendChild(o);});
$("legendbar").style.background="linear-gradient(to right,"+[0,0.25,0.5,0.75,1].map(t=>ramp(t)).join(",")+")";
$("legendticks").innerHTML="<span>≤0.01%</span><span>0.1%</span><span>1%</span><span>10%</span><span>100%</span>";
function fmt(x){return x>=100?x.toFixed(0):x>=1?x.toFixed(2):x>=0.001?x.toFixed(4):x.toExponential(2);}
function tok(j){return D.labels&&D.labels[j]!==undefined?" “"+D.labels[j]+"”":"";}
function level(){const m=maps[st.map];const span=Math.max(st.x1-st.x0,(st.y1-st.y0));
  for(const lv of m.lev){const tpx=Math.min(PW*D.bn*lv.f/(st.x1-st.x0),PH*D.bm*lv.f/(st.y1-st.y0));
    if(tpx>=2||lv===m.lev[m.lev.length-1])return lv;}return m.lev[m.lev.length-1];}
function nice(span){const r=span/6,p=Math.pow(10,Math.floor(Math.log10(r)));
  for(const m of[1,2,5,10])if(m*p>=r)return m*p;return 10*p;}
function kfmt(v){return v>=10000?(v/1000).toFixed(v%1000?1:0)+"k":String(v);}
function draw(){const lv=level(),h=st.head,T=lv.T,bm=D.bm*lv.f,bn=D.bn*lv.f;
  cx.clearRect(0,0,cv.width,cv.height);cx.fillStyle="#e9ecf1";cx.fillRect(M0.l,M0.t,PW,PH);
  const sx=PW/(st.x1-st.x0),sy=PH/(st.y1-st.y0);
  cx.save();cx.beginPath();cx.rect(M0.l,M0.t,PW,PH);cx.clip();
  for(let i=0;i<T;i++){const q0=lv.q[i]*bm,k0=lv.k[i]*bn;if(q0>=st.y1||q0+bm<=st.y0||k0>=st.x1||k0+bn<=st.x0)continue;
    const lvr=lv.live[h*lv.nq+lv.q[i]];const share=lvr>0?lv.mass[h*T+i]/lvr:0;cx.fillStyle=colour(share);
    const x=M0.l+(k0-st.x0)*sx,y=M0.t+(q0-st.y0)*sy;
      cx.fillRect(Math.floor(x),Math.floor(y),Math.max(1,Math.ceil(bn*sx+x-Math.floor(x))),Math.max(1,Math.ceil(bm*sy+
        y-Math.floor(y))));}
  const r=maps[st.map].rows[st.row];if(r&&r.i>=st.y0&&r.i<st.y1){const y=M0.t+(r.i+0.5-st.y0)*sy;
    cx.strokeStyle="#ff3b6b";cx.lineWidth=1.5;cx.setLineDash([5,3]);cx.beginPath();cx.moveTo(M0.l,y);
    cx.lineTo(M0.l+PW,y);cx.stroke();cx.setLineDash([]);}
  if(drag&&drag.moved){cx.strokeStyle="#fff";cx.lineWidth=1.5;
    cx.strokeRect(Math.min(drag.x,drag.cx),Math.min(drag.y,drag.cy),Math.abs(drag.cx-drag.x),Math.abs(drag.cy-drag.y));}
  cx.restore();
  cx.fillStyle="#1f2933";cx.strokeStyle="#52606d";cx.font="11px system-ui,sans-serif";cx.lineWidth=1;
  const tx=nice(st.x1-st.x0);cx.textAlign="center";for(let v=Math.ceil(st.x0/tx)*tx;v<=st.x1;
    v+=tx){const x=M0.l+(v-st.x0)*sx;cx.beginPath();cx.moveTo(x,M0.t+PH);cx.lineTo(x,M0.t+PH+4);cx.stroke();
    cx.fillText(kfmt(v),x,M0.t+PH+15);}
  const ty=nice(st.y1-st.y0);cx.textAlign="right";for(let v=Math.ceil(st.y0/ty)*ty;v<=st.y1;
    v+=ty){const y=M0.t+(v-st.y0)*sy;cx.beginPath();cx.moveTo(M0.l-4,y);cx.lineTo(M0.l,y);cx.stroke();
    cx.fillText(kfmt(v),M0.l-6,y+4);}
  cx.textAlign="center";cx.font="12px system-ui,sans-serif";
    cx.fillText("key position (tokens) →",M0.l+PW/2,cv.height-8);
  cx.save();cx.translate(14,M0.t+PH/2);cx.rotate(-Math.PI/2);cx.fillText("query position (tokens) →",0,0);cx.restore();
  cx.strokeStyle="#9aa5b1";cx.strokeRect(M0.l,M0.t,PW,PH);
  $("viewtxt").textContent="queries "+Math.round(st.y0)+"–"+Math.round(st.y1-1)+" × keys "+Math.round(st.x0)+"–"+
    Math.round(st.x1-1)+" · tiles "+bm+"×"+bn;
  drawRow();}
function tileAt(px,py){const lv=level(),bm=D.bm*lv.f,bn=D.bn*lv.f;
  const kj=st.x0+(px-M0.l)*(st.x1-st.x0)/PW,qi=st.y0+(py-M0.t)*(st.y1-st.y0)/PH;
  if(kj<0||kj>=S||qi<0||qi>=L||px<M0.l||py<M0.t||px>M0.l+PW||py>M0.t+PH)return null;
    const a=Math.floor(qi/bm),c=Math.floor(kj/bn);
  let idx=-1;for(let i=0;i<lv.T;i++)if(lv.q[i]===a&&lv.k[i]===c){idx=i;break;
    }return{lv,a,c,idx,bm,bn,qi:Math.floor(qi),kj:Math.floor(kj)};}
function describe(t){if(!t)return"";
  const h=st.head,q0=t.a*t.bm,q1=Math.min(L,q0+t.bm),k0=t.c*t.bn,k1=Math.min(S,k0+t.bn);
  const who=(h===H?"mean of heads":"head "+h)+(maps.length>1?" · "+maps[st.map].name:"");
  let s="queries "+q0+"–"+(q1-1)+" → keys "+k0+"–"+(k1-1)+"\n"+who+"\n";
  if(D.labels&&q1-q0<=16&&k1-k0<=16)s+="“"+D.labels.slice(q0,q1).join(" ")+"” → “"+D.labels.slice(k0,k1).join(" ")+
    "”\n";
  if(t.idx<0)return s+"empty under the mask: never computed (weight 0)";
  const lvr=t.lv.live[h*t.lv.nq+t.a],m=t.lv.mass[h*t.lv.T+t.idx];
  return s+"mass "+fmt(m)+" (of "+fmt(lvr)+" live query rows)\nshare "+(lvr>0?(100*m/lvr).toPrecision(3):"0")+
    "% of these rows' attention";}
function readout(t){$("readout").textContent=describe(t)||"Hover a tile: its query and key range, mass and share.";}
let drag=null;
cv.addEventListener("mousedown",e=>{const b=cv.getBoundingClientRect();
  drag={x:e.clientX-b.left,y:e.clientY-b.top,cx:e.clientX-b.left,cy:e.clientY-b.top,moved:false};});
cv.addEventListener("mousemove",e=>{const b=cv.getBoundingClientRect(),px=e.clientX-b.left,py=e.clientY-b.top;
  if(drag){drag.cx=px;drag.cy=py;if(Math.abs(px-drag.x)+Math.abs(py-drag.y)>6){drag.moved=true;draw();
    }}readout(tileAt(px,py));});
window.addEventListener("mouseup",e=>{if(!drag)return;const d=drag;drag=null;
  const tk=px=>st.x0+(px-M0.l)*(st.x1-st.x0)/PW,tq=py=>st.y0+(py-M0.t)*(st.y1-st.y0)/PH;
  if(d.moved){zoom(tk(Math.min(d.x,d.cx)),tk(Math.max(d.x,d.cx)),tq(Math.min(d.y,d.cy)),tq(Math.max(d.y,d.cy)));}
  else if(d.x>=M0.l&&d.y>=M0.t&&d.x<=M0.l+PW&&d.y<=M0.t+PH){const k=tk(d.x),q=tq(d.y),w=(st.x1-st.x0)/8,
    hh=(st.y1-st.y0)/8;pickRow(q);zoom(k-w,k+w,q-hh,q+hh);}});
function clampView(x0,x1,y0,y1){const mw=Math.min(S,16),mh=Math.min(L,16);if(x1-x0<mw){const c=(x0+x1)/2;x0=c-mw/2;
  x1=c+mw/2;}if(y1-y0<mh){const c=(y0+y1)/2;y0=c-mh/2;y1=c+mh/2;}
  if(x0<0){x1-=x0;x0=0;}if(x1>S){x0-=x1-S;x1=S;}if(y0<0){y1-=y0;y0=0;}if(y1>L){y0-=y1-L;y1=L;
    }return[Math.max(0,x0),Math.min(S,x1),Math.max(0,y0),Math.min(L,y1)];}
function zoom(x0,x1,y0,y1){hist.push([st.x0,st.x1,st.y0,st.y1]);[st.x0,st.x1,st.y0,st.y1]=clampView(x0,x1,y0,y1);draw();
  }
function pickRow(q){const rows=maps[st.map].rows;let best=0;
  rows.forEach((r,n)=>{if(Math.abs(r.i-q)<Math.abs(rows[best].i-q))best=n;});st.row=best;$("rowsel").value=best;}
$("back").onclick=()=>{if(hist.length){[st.x0,st.x1,st.y0,st.y1]=hist.pop();draw();}};
$("reset").onclick=()=>{zoom(0,S,0,L);};
function drawTop(){const h=st.head;$("topwho").textContent=(maps.length>1?D.maps[st.map].name+", ":"")+
    (h===H?"mean of heads":"head "+h);$("top").innerHTML="";
  D.maps[st.map].top[h].forEach(t=>{const li=document.createElement("li");
  li.textContent="queries "+t.q[0]+"–"+(t.q[1]-1)+" → keys "+t.k[0]+"–"+(t.k[1]-1)+": "+(100*t.share).toFixed(1)+"%";
  li.onclick=()=>{const w=Math.max(t.k[1]-t.k[0],t.q[1]-t.q[0])*4;
    zoom((t.k[0]+t.k[1]-w)/2,(t.k[0]+t.k[1]+w)/2,(t.q[0]+t.q[1]-w)/2,(t.q[0]+t.q[1]+w)/2);};$("top").appendChild(li);});}
$("head").onchange=e=>{st.head=+e.target.value;drawTop();draw();};
$("map").onchange=e=>{st.map=+e.target.value;drawTop();draw();};
$("rowsel").onchange=e=>{st.row=+e.target.value;draw();};
drawTop();
const RM={l:70,t:8,r:14,b:26};
function rowView(r){let a=Math.max(st.x0,r.j0),b=Math.min(st.x1,r.j1);if(b-a<Math.min(16,r.j1-r.j0)){a=r.j0;b=r.j1;
  }return[a,b];}
function drawRow(){const r=maps[st.map].rows[st.row];rx.clearRect(0,0,rc.width,rc.height);if(!r)return;
  const h=st.head,n=r.w.length/NH,W=rc.width-RM.l-RM.r,Hh=rc.height-RM.t-RM.b;
  $("rowtitle").textContent="Exact weights of query row "+r.i+(h===H?" (mean of heads)":" (head "+h+")")+
    (r.bin>1?", summed per "+r.bin+" keys":"")+tok(r.i);
  if(!n){rx.fillStyle="#52606d";rx.fillText("this row sees no key (fully masked): all weights 0",RM.l,40);return;}
  const[a,b]=rowView(r);let mx=0;const i0=Math.floor((a-r.j0)/r.bin),i1=Math.ceil((b-r.j0)/r.bin);for(let i=i0;
    i<i1&&i<n;i++)mx=Math.max(mx,r.w[h*n+i]);mx=mx||1;
  rx.fillStyle="#f5f7fa";rx.fillRect(RM.l,RM.t,W,Hh);const sx=W/(b-a);rx.fillStyle="#255c99";
  for(let i=i0;i<i1&&i<n;
    i++){const v=r.w[h*n+i],k0=r.j0+i*r.bin,x=RM.l+(k0-a)*sx,w=Math.max(1,r.bin*sx-(r.bin*sx>3?1:0)),y=Hh*v/mx;
    rx.fillRect(x,RM.t+Hh-y,w,y);}
  rx.fillStyle="#1f2933";rx.font="11px system-ui,sans-serif";rx.textAlign="right";rx.fillText(fmt(mx),RM.l-4,RM.t+9);
    rx.fillText("0",RM.l-4,RM.t+Hh);
  rx.textAlign="center";const t=nice(b-a);for(let v=Math.ceil(a/t)*t;v<=b;
    v+=t)rx.fillText(kfmt(v),RM.l+(v-a)*sx,RM.t+Hh+13);
  rx.fillText("key position (tokens) — bars: weight",RM.l+W/2,rc.height-2);}
rc.addEventListener("mousemove",e=>{const r=maps[st.map].rows[st.row];if(!r||!r.w.length)return;
  const b=rc.getBoundingClientRect(),px=e.clientX-b.left,W=rc.width-RM.l-RM.r;const[a,bb]=rowView(r);
  const j=Math.floor(a+(px-RM.l)*(bb-a)/W);if(j<r.j0||j>=r.j1){$("rowread").textContent="";return;
    }const n=r.w.length/NH,i=Math.floor((j-r.j0)/r.bin),k0=r.j0+i*r.bin;
  $("rowread").textContent=(r.bin>1?"keys "+k0+"–"+(Math.min(r.j1,k0+r.bin)-1):"key "+k0+tok(k0))+": weight "+
    fmt(r.w[st.head*n+i]);});
window.attnkitLong={zoom:(x0,x1,y0,y1)=>zoom(x0,x1,y0,y1),reset:()=>zoom(0,S,0,L),back:()=>$("back").click(),
  view:()=>({x0:st.x0,x1:st.x1,y0:st.y0,y1:st.y1,tile:[D.bm*level().f,D.bn*level().f],tiles:level().T}),
  setHead:h=>{st.head=h;$("head").value=h;drawTop();draw();},readout:()=>$("readout").textContent,
  setMap:i=>{st.map=i;$("map").value=i;drawTop();draw();},state:()=>({map:st.map,head:st.head,
    mapName:D.maps[st.map].name,top:$("topwho").textContent}),
  hover:(q,k)=>{const px=M0.l+(k+0.5-st.x0)*PW/(st.x1-st.x0),py=M0.t+(q+0.5-st.y0)*PH/(st.y1-st.y0);
    readout(tileAt(px,py));return $("readout").textContent;},
  tileShare:(q,k)=>{const t=tileAt(M0.l+(k+0.5-st.x0)*PW/(st.x1-st.x0),M0.t+(q+0.5-st.y0)*PH/(st.y1-st.y0));
    if(!t||t.idx<0)return 0;const l=t.lv.live[st.head*t.lv.nq+t.a];return l>0?t.lv.mass[st.head*t.lv.T+t.idx]/l:0;},
  rowWeights:n=>Array.from(maps[st.map].rows[n].w)};
draw();document.body.setAttribute("data-ready","1");
})();
</script></body></html>
"""
