// The SGD update. Each operation rounds to float32 as PyTorch's does (no fused multiply-add
// here: this file is compiled without FMA), so the result matches torch.optim.SGD closely.
#include "update.h"

#include "parallel.h"

namespace pyhet {

void sgd_update(const float* p, const float* g, const float* v, float* p_out, float* v_out,
                int64_t n, float lr, float momentum, float weight_decay, bool first, int threads) {
  // entry i is read before it is written, so p_out == p and v_out == v update in place
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i];
    if (weight_decay != 0.f) d += weight_decay * p[i];
    if (momentum != 0.f) {
      d = first ? d : momentum * v[i] + d;
      v_out[i] = d;
    }
    p_out[i] = p[i] - lr * d;
  }
}

}  // namespace pyhet
