/* The kernel built for AVX2 (chosen at run time when the CPU has it). */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2")
#define KVC_SUFFIX avx2
#include "kernel.h"
#endif
