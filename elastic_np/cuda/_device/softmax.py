"""The online softmax every kernel shares: the row max and sum over a row's lanes, and the finish of a row.

Imports ``numba.cuda``: imported by the kernel modules only.
"""

import math

import numba
from numba import cuda

from elastic_np.cuda._device.basics import inline_device
from elastic_np.cuda._device.indices import F_NEG_INF, F_ONE, F_ZERO


@inline_device
def lane_mask(t, threads):
    """The shuffle mask of thread ``t``'s warp: its lanes that exist in a block of ``threads``."""
    lanes = min(32, threads - (t - t % 32))
    if lanes >= 32:
        return numba.uint32(0xFFFFFFFF)
    return numba.uint32((1 << lanes) - 1)


@inline_device
def group_max(value, width, lanes):
    """The max of ``value`` over an aligned group of ``width`` lanes (a power of two <= 32), in every lane."""
    offset = 16
    for _ in range(5):  # a fixed trip count, unrolled; the steps past the group are skipped
        if offset < width:
            value = max(value, cuda.shfl_xor_sync(lanes, value, offset))
        offset //= 2
    return value


@inline_device
def group_sum(value, width, lanes):
    """The sum of ``value`` over an aligned group of ``width`` lanes, bit-identical in every lane.

    A butterfly: at each step two lanes add the same two numbers (in swapped
    order, which IEEE addition does not see), so every lane ends with the
    same bits, run after run.
    """
    offset = 16
    for _ in range(5):
        if offset < width:
            value = value + cuda.shfl_xor_sync(lanes, value, offset)
        offset //= 2
    return value


@cuda.jit(device=True)
def _log_add_exp(a, b):
    """``log(exp(a) + exp(b))`` for finite ``a``, ``b``."""
    hi = max(a, b)
    return hi + math.log1p(math.exp(min(a, b) - hi))


@cuda.jit(device=True)
def finish_row(row_max, row_sum, beta_h, fopts):
    """``(lse, num, den)`` of a row from its running max and sum: ``out = (acc num) / den``.

    ``lse = log(row_sum exp(row_max) + beta)``; ``out = acc / (row_sum +
    beta exp(-row_max))``, computed directly rather than as ``acc exp(row_max
    - lse)``, which would turn the rounding of ``lse`` into a relative error
    of ``out``, and as a quotient (one rounding, not two through a
    reciprocal). A row that kept nothing has ``out = 0`` and ``lse = log(beta)``.
    """
    zero = fopts[F_ZERO]
    one = fopts[F_ONE]
    if row_sum > zero:
        row_lse = row_max + math.log(row_sum)
        num = one
        den = row_sum
        if beta_h > zero:
            log_beta = math.log(beta_h)
            row_lse = _log_add_exp(row_lse, log_beta)
            gap = log_beta - row_max  # beta exp(-row_max) = exp(gap); no exp of a positive gap
            if gap > zero:
                num = math.exp(-gap)
                den = row_sum * num + one
            else:
                den = row_sum + math.exp(gap)
        return row_lse, num, den
    row_lse = fopts[F_NEG_INF]
    if beta_h > zero:
        row_lse = math.log(beta_h)
    return row_lse, zero, one
