// OpenMP helpers that also compile, single-threaded, without OpenMP.
#pragma once
#ifdef _OPENMP
#include <omp.h>
#endif

namespace pyhet {

inline int clamp_threads(int threads) { return threads < 1 ? 1 : threads; }

// The threads a parallel region opens to run `team` of them for a caller of `threads`. libgomp
// keeps the threads of a calling thread's last team, but where a region has fewer (2 or more),
// it wakes the rest to end them, and makes them anew for the next larger region: a team
// smaller than the caller's between two whole ones cost a thread's making and ending for each
// one left out (10 a step on the default network at cpu:8). So a region of 2 or more opens
// the caller's whole team, and threads past `team` sit it out (woken as those that ended
// were; they also meet its barriers); a team of 1 runs inline and keeps the others.
inline int region_size(int team, int threads) {
  return team > 1 ? (threads > team ? threads : team) : 1;
}

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

// Starts the calling thread's team of `threads` OpenMP threads now (libgomp keeps a team for
// each thread that starts one, for its later regions); returns the team's size (1 without
// OpenMP). libgomp ends the process where it cannot make a thread: callers check first.
inline int start_team(int threads) {
  int size = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(clamp_threads(threads))
  {
#pragma omp single
    size = omp_get_num_threads();
  }
#else
  (void)threads;
#endif
  return size;
}

}  // namespace pyhet
