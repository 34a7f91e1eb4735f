// The portable build: 4 floats per vector (SSE2 on x86-64, NEON on arm64, scalar code elsewhere).
#define AK_NS ak_base
#define AK_VW 4
#include "attn_impl.h"
#include "attn_decode.h"
#include "attn_entry.h"
