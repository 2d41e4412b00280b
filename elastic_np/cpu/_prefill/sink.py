"""The sink's gradient ``dbeta`` of the CPU backward, compiled: the contract's `sink_gradient` in one pass.

`elastic_np._contract._grads.sink_gradient` takes about twenty NumPy calls,
tens of microseconds whatever the size: as much as the kernels of a small
backward. `sink_gradient` computes the same quantity in compiled loops.
"""

import math

import numpy as np
from numba import njit


def sink_gradient(problem, delta, lse):
    """``dbeta`` of ``problem`` per head, or summed over the heads when ``beta`` is shared: float64 ``(H,)`` or
    ``(1,)``, the values of `elastic_np._contract._problem.AttentionProblem.sink_gradient` (the sums in another
    order: within rounding of them)."""
    per_head = math.prod(problem.beta_shape) > 1
    out = np.empty(delta.shape[1] if per_head else 1)
    _sink_gradient(delta, lse, out)
    return out


@njit(cache=True, fastmath=False)
def _sink_gradient(delta, lse, out):
    """``out[g] = -sum delta_i exp(-lse_i)`` over the rows of heads ``g`` (every head when ``out`` has one entry).

    The rows with ``delta_i = 0`` or ``lse_i = -inf`` add nothing. The sum is
    taken relative to its largest factor ``exp(top)`` (`sink_terms`): a sum
    whose terms overflow gets its sign and ``inf``, a sum that fits float64 is
    not lost to an overflowing term, a sum that cancels exactly is 0.
    """
    B, H, N = delta.shape
    groups = out.shape[0]
    heads = H // groups
    for g in range(groups):
        top = -np.inf
        for b in range(B):
            for h in range(g * heads, (g + 1) * heads):
                for i in range(N):
                    x = np.float64(lse[b, h, i])
                    if delta[b, h, i] != 0 and x != -np.inf:
                        top = max(top, -x)
        if top == -np.inf:
            top = 0.0
        scaled = 0.0
        for b in range(B):
            for h in range(g * heads, (g + 1) * heads):
                for i in range(N):
                    x = np.float64(lse[b, h, i])
                    if delta[b, h, i] != 0 and x != -np.inf:
                        scaled += delta[b, h, i] * math.exp(-x - top)
        if scaled == 0:
            out[g] = 0.0
        else:
            grad = -scaled * math.exp(top)
            if not math.isfinite(grad):  # exp(top) alone overflows: the product may not
                grad = -math.copysign(1.0, scaled) * math.exp(top + math.log(abs(scaled)))
            out[g] = grad
