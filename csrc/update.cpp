// The SGD update. Each operation rounds to float32 as PyTorch's does (no fused multiply-add
// here: this file is compiled without FMA), so the result matches torch.optim.SGD closely.
#include "update.h"

#include <algorithm>

#include "parallel.h"

namespace pyhet {

namespace {
// The update streams five floats an entry and does little else: one core comes close to the
// memory's bandwidth, and waking a team of threads that wait passively costs more than it saves
// below about a million entries a thread (Zen 5, 2 threads, a pause between calls as between a
// step's layers: 1 thread 17 us and 2 threads 26 us at 51,200 entries; 210 against 282 us at
// 2^20; 1349 against 1042 us at 2^22).
constexpr int64_t kMinEntriesPerThread = int64_t{1} << 20;
}  // namespace

void sgd_update(const float* p, const float* g, const float* v, float* p_out, float* v_out,
                int64_t n, float lr, float momentum, float weight_decay, bool first, int threads) {
  // entry i is read before it is written, so p_out == p and v_out == v update in place
  const int team = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(clamp_threads(threads), n / kMinEntriesPerThread)));
  const int region = region_size(team, threads);
  (void)region;  // without OpenMP
#pragma omp parallel for schedule(static) num_threads(region) if (team > 1)
  for (int u = 0; u < team; ++u) {
    for (int64_t i = n * u / team, end = n * (u + 1) / team; i < end; ++i) {
      float d = g[i];
      if (weight_decay != 0.f) d += weight_decay * p[i];
      if (momentum != 0.f) {
        d = first ? d : momentum * v[i] + d;
        v_out[i] = d;
      }
      p_out[i] = p[i] - lr * d;
    }
  }
}

}  // namespace pyhet
