// The SGD update in one pass over memory, as torch.optim.SGD defines it (dampening 0, no
// Nesterov):  d = g + wd * p;  v = first ? d : momentum * v + d;  p -= lr * v
// (with momentum == 0: p -= lr * d, and v is not touched).
#pragma once
#include <cstdint>

namespace pyhet {

void sgd_update(float* p, const float* g, float* v, int64_t n, float lr, float momentum,
                float weight_decay, bool first, int threads);

}  // namespace pyhet
