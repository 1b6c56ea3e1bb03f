// AVX2/FMA micro-kernel (placeholder until the packed kernel lands).
#include "gemm.h"
