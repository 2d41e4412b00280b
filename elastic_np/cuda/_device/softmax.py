"""The online softmax every kernel takes its rows through: a row's running max and sum, tile by tile, and its finish.

Per key tile, a row's logits ``z`` (``-inf`` where removed) update its
running max ``m``, combined over the row's lanes by shuffles
(`running_max`); what the row summed before is rescaled by ``alpha =
exp(m_old - m)`` (`rescale`) and each logit becomes ``p = exp(z - m)``
(`probability`). Two steps, one per place a row's logits lie: `row_step`,
in shared memory (a SIMT forward micro-tile's rows, a decode row), and
`fragment_step`, in the registers of a tensor-core fragment (two rows a
thread). `finish_row` then gives ``lse`` and the output's factors, ``beta``
added once. Imports ``numba.cuda``: imported by the kernel modules only.
"""

import math

import numba
from numba import cuda

from elastic_np.cuda._device.basics import inline_device
from elastic_np.cuda._device.indices import F_NEG_INF, F_ONE, F_ZERO

#: Every lane of a warp: a tensor-core row's 4 lanes reduce by shuffles (`group_max`, `group_sum` of width 4).
FULL_MASK = numba.uint32(0xFFFFFFFF)


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


@inline_device
def running_max(run_max, tile_max, width, lanes):
    """A row's running max after a tile whose logits' max over the thread's entries is ``tile_max``.

    ``tile_max`` is combined over the row's ``width`` lanes (`group_max`).
    """
    return max(run_max, group_max(tile_max, width, lanes))


@inline_device
def rescale(run_max, new_max, one, neg_inf):
    """``alpha = exp(run_max - new_max)``: the factor for what a row summed before the tile (1 if it kept none)."""
    alpha = one
    if new_max > neg_inf:
        alpha = math.exp(run_max - new_max)  # 1 when the max stays, 0 from -inf
    return alpha


@inline_device
def probability(z, row_max, zero, neg_inf):
    """``p = exp(z - row_max)`` of a logit, 0 where the entry is removed (``z = -inf``)."""
    p = zero
    if z > neg_inf:
        p = math.exp(z - row_max)
    return p


@inline_device
def row_step(tile, at, tpr, count, state, tile_max, lanes, consts):
    """The online-softmax step of a row whose logits lie in shared memory: ``p`` in their place.

    The thread's logits of the row are ``tile[at + tpr n]`` for ``n <
    count`` (its lane of the row's ``tpr``), their max ``tile_max``; ``state
    = (run_max, run_sum)`` is the row's state before the tile (the thread's
    partial sum), ``consts = (zero, one, neg_inf)`` in the kernel's dtype.
    Returns ``(new_max, new_sum, alpha)``: the caller rescales its
    accumulators by ``alpha``.
    """
    run_max, run_sum = state
    zero, one, neg_inf = consts
    new_max = running_max(run_max, tile_max, tpr, lanes)
    alpha = rescale(run_max, new_max, one, neg_inf)
    total = run_sum * alpha
    for n in range(count):
        p = probability(tile[at + tpr * n], new_max, zero, neg_inf)
        total += p
        tile[at + tpr * n] = p
    return new_max, total, alpha


@inline_device
def fragment_step(s_frag, stats, fopts):
    """The online-softmax step of a thread's two rows of a tensor-core fragment: ``p`` in place of the logits.

    ``s_frag[n]`` holds rows ``g`` (entries 0, 1) and ``g + 8`` (2, 3) of
    the warp's 16, each row's max taken over its four lanes; ``stats`` holds
    the two rows' running max (0, 1) and the thread's partial sums (2, 3).
    Returns the two rows' rescale factors.
    """
    neg_inf = fopts[F_NEG_INF]
    zero = fopts[F_ZERO]
    one = fopts[F_ONE]
    top = neg_inf
    bottom = neg_inf
    for n in range(s_frag.shape[0]):
        top = max(top, max(s_frag[n, 0], s_frag[n, 1]))
        bottom = max(bottom, max(s_frag[n, 2], s_frag[n, 3]))
    new_top = running_max(stats[0], top, 4, FULL_MASK)
    new_bottom = running_max(stats[1], bottom, 4, FULL_MASK)
    alpha_top = rescale(stats[0], new_top, one, neg_inf)
    alpha_bottom = rescale(stats[1], new_bottom, one, neg_inf)
    sum_top = stats[2] * alpha_top
    sum_bottom = stats[3] * alpha_bottom
    for n in range(s_frag.shape[0]):
        for e in range(4):
            p = probability(s_frag[n, e], new_top if e < 2 else new_bottom, zero, neg_inf)
            s_frag[n, e] = p
            if e < 2:
                sum_top += p
            else:
                sum_bottom += p
    stats[0] = new_top
    stats[1] = new_bottom
    stats[2] = sum_top
    stats[3] = sum_bottom
    return alpha_top, alpha_bottom


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
