// OpenMP helpers that also compile, single-threaded, without OpenMP.
#pragma once
#ifdef _OPENMP
#include <omp.h>
#endif

namespace pyhet {

inline int clamp_threads(int threads) { return threads < 1 ? 1 : threads; }

// The calling thread's number within its team (0 outside a parallel region, or without OpenMP).
inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline bool have_openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace pyhet
