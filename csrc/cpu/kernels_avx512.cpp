// The CPU kernels built for the AVX512 instruction set (-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma; see setup.py and CMakeLists.txt).
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define TITAN_CAPABILITY_NAME "avx512"
#include "kernels_impl.h"
