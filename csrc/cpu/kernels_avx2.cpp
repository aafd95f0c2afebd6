// The CPU kernels built for the AVX2 instruction set (-mavx2 -mfma -mf16c; see setup.py and CMakeLists.txt).
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define TITAN_CAPABILITY_NAME "avx2"
#include "kernels_impl.h"
