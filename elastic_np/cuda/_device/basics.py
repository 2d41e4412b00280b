"""The device-code basics every kernel uses: forced inlining, unsigned indices, the dtype's constants, the shapes.

Also Neumaier's compensated sum (`compensated_add`), for the backward's
deterministic parameter gradients. Imports ``numba.cuda``: imported by the
kernel modules only.
"""

import numba
from numba import cuda

from elastic_np.cuda._device.indices import F_NEG_INF, F_ZERO, O_FOPTS


def inline_device(fn):
    """``cuda.jit(device=True, forceinline=True)``: inlined at the NVVM IR level.

    For the device functions that take the kernels' register micro-tiles
    (``cuda.local.array`` s): once inlined and unrolled, their indices are
    constants and the arrays become registers. The simulator's ``jit`` has no
    ``forceinline`` (and nothing to inline).
    """
    try:
        return cuda.jit(device=True, forceinline=True)(fn)
    except TypeError:
        return cuda.jit(device=True)(fn)


@inline_device
def unsigned(index):
    """``index`` as an unsigned integer: Numba indexes with it without the wraparound test of a signed one.

    The test (``index < 0``: add the length) kept every shared-memory address
    apart; unsigned, the addresses of a fragment share one base and constant
    offsets, and stay out of the registers.
    """
    return numba.uint64(index)


@inline_device
def constants(opts):
    """``(fopts, zero, neg_inf)``: the float option array of ``opts`` and its 0 and ``-inf`` (in the kernel's dtype)."""
    fopts = opts[O_FOPTS]
    return fopts, fopts[F_ZERO], fopts[F_NEG_INF]


@cuda.jit(device=True)
def compensated_add(total, carry, term):
    """Neumaier's compensated sum: add ``term`` to ``total`` keeping the lost low part in ``carry``."""
    new_total = total + term
    if abs(total) >= abs(term):
        carry += (total - new_total) + term
    else:
        carry += (term - new_total) + total
    return new_total, carry


@inline_device
def problem_dims(q, k, v):
    """``(B, H, Hkv, N, M, D, Dv)`` from the shapes of ``q``, ``k``, ``v`` (the order of ``AttentionProblem.shape``)."""
    B, H, N, D = q.shape
    return B, H, k.shape[1], N, k.shape[2], D, v.shape[3]
