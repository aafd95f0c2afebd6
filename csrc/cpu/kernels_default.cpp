// The CPU kernels built for the DEFAULT instruction set (no extra flags; see setup.py and CMakeLists.txt).
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#define TITAN_CAPABILITY_NAME "default"
#include "kernels_impl.h"
