// The decode entry's arithmetic against its memory reads: ak_decode (the compiled kernel's decode entry, the .so
// that `make` builds) called directly from C, with no Python around it (BENCHMARKS.md, eighth session, "Long-cache
// GQA decode"). One query row per head (L = 1), D = Dv = 128 (or $D), g query heads per kv head (GQA group), fp32 or bf16.
//
//   resident = 1: K and V held in L2 — 256 batch rows read the same 256-key cache (batch stride 0, 256 KB fp32), so
//                 the time is the arithmetic: printed as ns per key per thread (FMA peak: g * 32 / 2 / GHz ns);
//   resident = 0: Hkv kv heads of S keys from memory; after each call, K and V summed once by an OpenMP loop over the
//                 same threads (the read); printed: kernel ms, read ms, kernel / read (the goal: <= 1.25).
//
//   g++ -O2 -fopenmp -std=c++17 -Isrc/attnkit/csrc benchmarks/decode_arith.cpp -o /tmp/decode_arith -ldl \
//       -Wl,--no-as-needed -L"$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')" \
//       -lpython3.11 -Wl,-rpath,"$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
//   AKSO=$(ls src/attnkit/_native*.so) /tmp/decode_arith g Hkv S dtype resident order threads reps
//     e.g. /tmp/decode_arith 4 1 256 0 1 1 1 200      (arithmetic, group of 4, fp32, memory order, 1 thread)
//          /tmp/decode_arith 4 8 65536 0 0 1 2 5      (GQA 32 / 8 over 65536 keys, fp32, 2 threads)
//   dtype 0 fp32 / 1 bf16; order -1 chosen per call, 0 register-blocked, 1 memory order (ak_set_decode_order);
//   MIN=1 in the environment prints the fastest repeat instead of the median; D=64 sets the head dim (default 128). The .so links Python's C API for its
//   module entry (never called here), hence -lpython.
#include "attn_common.h"
#include <dlfcn.h>
#include <cstdio>
#include <chrono>
#include <vector>
#include <algorithm>
#include <cstdint>
typedef int (*fn_t)(const AkCall*);
typedef int (*ord_t)(int);
int main(int argc, char** argv) {
  int g = atoi(argv[1]); long Hkv = atol(argv[2]), S = atol(argv[3]); int dt = atoi(argv[4]); int res = atoi(argv[5]);
  int order = atoi(argv[6]); int th = atoi(argv[7]); int reps = atoi(argv[8]);
  void* h = dlopen(getenv("AKSO"), RTLD_NOW);
  if (!h) { printf("%s\n", dlerror()); return 1; }
  fn_t dec = (fn_t)dlsym(h, "ak_decode"); ord_t so = (ord_t)dlsym(h, "ak_set_decode_order");
  so(order);
  long D = getenv("D") ? atol(getenv("D")) : 128, B = res ? 256 : 1, H = g * Hkv, esz = dt ? 2 : 4;
  size_t n = Hkv * S * D;
  char* K = (char*)aligned_alloc(64, n * esz); char* V = (char*)aligned_alloc(64, n * esz);
  for (size_t i = 0; i < n; i++) {
    float a = ((i * 2654435761u) % 1000) / 1000.f - 0.5f, b = ((i * 40503u) % 997) / 997.f - 0.5f;
    if (dt) { uint32_t x, y; memcpy(&x, &a, 4); memcpy(&y, &b, 4); ((uint16_t*)K)[i] = x >> 16; ((uint16_t*)V)[i] = y >> 16; }
    else { ((float*)K)[i] = a; ((float*)V)[i] = b; }
  }
  std::vector<char> Q(B * H * D * esz);
  for (size_t i = 0; i < Q.size(); i++) Q[i] = dt ? (i % 2 ? 0x3c : (char)i) : (i % 4 == 3 ? 0x3c : (char)i);
  std::vector<float> out(B * H * D), lse(B * H);
  int32_t lo = 0, hi = (int32_t)S;
  AkCall c; memset(&c, 0, sizeof c);
  c.size = sizeof c; c.version = AK_ABI_VERSION;
  c.B = B; c.H = H; c.Hkv = Hkv; c.L = 1; c.D = D; c.Dv = D; c.S = S;
  c.sq[0] = H * D; c.sq[1] = D; c.sq[2] = D;
  c.sk[0] = res ? 0 : Hkv * S * D; c.sk[1] = S * D; c.sk[2] = D;
  for (int i = 0; i < 3; i++) c.sv[i] = c.sk[i];
  c.q = Q.data(); c.k = K; c.v = V; c.lo = &lo; c.hi = &hi; c.out = out.data(); c.lse = lse.data();
  c.lob = 0; c.threads = th; c.chunk = getenv("CHUNK") ? atol(getenv("CHUNK")) : 0; c.dtype = dt; c.scale = 0.088;
  std::vector<double> ts, tr;
  double sink = 0;
  for (int r = 0; r < reps + 1; r++) {
    auto t0 = std::chrono::steady_clock::now();
    int rc = dec(&c);
    if (rc) { printf("rc %d\n", rc); return 1; }
    auto t1 = std::chrono::steady_clock::now();
    double s = 0;
    if (!res) {
      #pragma omp parallel for num_threads(th) reduction(+:s)
      for (size_t i = 0; i < n * esz / 4; i += 8) s += ((float*)K)[i] + ((float*)V)[i];
      // touches every line? stride 8 floats = 32 B: yes
    }
    auto t2 = std::chrono::steady_clock::now();
    sink += s + out[5];
    if (r) ts.push_back(std::chrono::duration<double>(t1 - t0).count()), tr.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  std::sort(ts.begin(), ts.end()); std::sort(tr.begin(), tr.end());
  double k = getenv("MIN") ? ts[0] : ts[reps / 2], rd = getenv("MIN") ? tr[0] : tr[reps / 2];
  if (res) printf("g=%d dt=%d order=%d th=%d resident: %.3f ms, %.1f ns/key/thread\n", g, dt, order, th, k * 1e3, k / (B * Hkv * S) * 1e9 * th);
  else printf("g=%d dt=%d order=%d th=%d: kernel %.2f ms read %.2f ms ratio %.2f  (%g)\n", g, dt, order, th, k * 1e3, rd * 1e3, k / rd, sink > 1e30 ? 1. : 0.);
}
