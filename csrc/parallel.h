// OpenMP helpers that also compile, single-threaded, without OpenMP.
#pragma once
#ifdef _OPENMP
#include <omp.h>
#endif

namespace pyhet {

inline int clamp_threads(int threads) { return threads < 1 ? 1 : threads; }

inline bool have_openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace pyhet
