// Shared by every instruction-set build of the kernel: headers and the C ABI's shape record.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#ifdef _OPENMP
#include <omp.h>
#endif
