// The SGD update in one pass over memory, as torch.optim.SGD defines it (dampening 0, no
// Nesterov):  d = g + wd * p;  v' = first ? d : momentum * v + d;  p' = p - lr * v'
// (with momentum == 0: p' = p - lr * d, and v is not touched). The new state goes to p_out and
// v_out, which are either p and v themselves (in place) or arrays that overlap nothing: written
// beside the old state, it lets the old one stay until the step is committed.
#pragma once
#include <cstdint>

namespace pyhet {

void sgd_update(const float* p, const float* g, const float* v, float* p_out, float* v_out,
                int64_t n, float lr, float momentum, float weight_decay, bool first, int threads);

}  // namespace pyhet
