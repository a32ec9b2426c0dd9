/* The kernel built for the compiler's baseline instruction set (SSE2 on x86-64, NEON on arm64). */
#define KVC_SUFFIX base
#include "kernel.h"
