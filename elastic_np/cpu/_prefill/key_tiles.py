"""The backward's key tiles: their tasks, the steps the double backward's passes share, the shares of dq.

The backward (`elastic_np.cpu._prefill.backward`) and the double
backward's key pass (`elastic_np.cpu._double_backward.tangent_keys`) run
the same tasks, one per key tile of a chunk and lane of (batch, kv head)
pairs (`key_tasks`, `key_task`, `pair_head`), claimed by the threads in
`elastic_np.cpu._runtime.threads.zigzag`'s order. For each pair they take
the query tiles each head of the group may keep with the tile's keys
(`group_spans`), the rows' ``lse`` and ``delta`` (`row_stats`), ``p =
exp(z - lse)`` (`probabilities`, `gated_probabilities` under the dynamic
window), the soft-cap's slope (`softcap_slope`), and write their
accumulators out (`copy_rows`); each key tile writes its share of ``dq``
into a buffer of its own, which `sum_dq_shares` adds in key-tile order.
The double backward's query pass takes the probabilities too
(`elastic_np.cpu._double_backward.tangents.tile_probabilities`).
"""

import numpy as np
from numba import njit

from elastic_np._contract._ranges import query_range
from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._runtime.threads import task_range, zigzag
from elastic_np.cpu._tiles.calls import exp_inplace
from elastic_np.cpu._tiles.operands import head_rows
from elastic_np.cpu._tiles.scalar import scalar_like


@inner(fastmath=False)
def key_tasks(params, B, Hkv, n_chunk):
    """``(n_tasks, pairs)``: the tasks of a chunk of ``n_chunk`` key tiles, and the (batch, kv head) pairs of a lane.

    ``params``: the `elastic_np.cpu._prefill.dbias.DbiasPlan`'s, which fold
    the pairs of a broadcast bias's gradient into ``params[3]`` lanes.
    """
    n_outer, pairs = _task_pairs(params, B, Hkv)
    return n_outer * params[3] * n_chunk, pairs


@inner(fastmath=False)
def key_task(task, n_chunk, params, pairs):
    """``(t, slot, outer, first, last)`` of a claimed ``task`` of `key_tasks`.

    ``t``: its key tile in the chunk (`elastic_np.cpu._runtime.threads.zigzag`'s
    order), ``slot``: its lane's dbias slot, ``outer``: the axes its lane
    does not fold, ``[first, last)``: its lane's pairs, each a (batch, kv
    head) by `pair_head`.
    """
    lanes, slots_per_lane = params[3], params[4]
    t = zigzag(task % n_chunk, n_chunk)
    lane = task // n_chunk % lanes
    outer = task // n_chunk // lanes
    slot = lane * slots_per_lane + (t if slots_per_lane > 1 else 0)
    return t, slot, outer, lane * pairs // lanes, (lane + 1) * pairs // lanes


@inner(fastmath=False)
def _task_pairs(params, B, Hkv):
    """``(n_outer, pairs)``: a task's (batch, kv head) pairs, split over the lanes, and the tasks' outer count.

    Without folding each task has one pair; folding the batch (kv heads) moves
    that axis from the outer count into the pairs.
    """
    fold_b, fold_h = params[1] != 0, params[2] != 0
    pairs = (B if fold_b else 1) * (Hkv if fold_h else 1)
    return (1 if fold_b else B) * (1 if fold_h else Hkv), pairs


@inner(fastmath=False)
def pair_head(params, pair, outer, Hkv):
    """The (batch, kv head) of a task's ``pair`` (its lane's folded axes) and ``outer`` (the others)."""
    fold_b, fold_h = params[1] != 0, params[2] != 0
    pairs_h = Hkv if fold_h else 1
    outer_h = 1 if fold_h else Hkv
    b = pair // pairs_h if fold_b else outer // outer_h
    hk = pair % pairs_h if fold_h else outer % outer_h
    return b, hk


@inner(fastmath=False)
def group_spans(opt, b, hk, j0, bk, block_q, spans, share_rows):
    """What the heads of kv head ``hk``'s group do with keys ``j0 .. j0 + bk - 1`` of batch entry ``b``.

    ``spans[g]`` receives the query tiles ``[it_lo, it_hi)`` where head ``hk
    group + g`` may keep one of the keys (``0, 0`` when none), ``share_rows[b,
    h]`` the rows ``[lo, hi)`` of those tiles, where the key tile's share of
    ``dq`` goes. Returns the union of the spans, ``[it_first, it_last)``.
    """
    group = spans.shape[0]
    N = opt.n_queries
    it_first, it_last = N, 0
    for g in range(group):
        h = hk * group + g
        i_lo, i_hi = query_range(opt.diag_shift[b], j0, j0 + bk, opt.band[b, h, 0], opt.band[b, h, 1], N)
        it_lo, it_hi = 0, 0
        if bk > 0 and i_lo < i_hi:
            it_lo, it_hi = i_lo // block_q, (i_hi - 1) // block_q + 1
            it_first, it_last = min(it_first, it_lo), max(it_last, it_hi)
        spans[g, 0], spans[g, 1] = it_lo, it_hi
        share_rows[b, h, 0], share_rows[b, h, 1] = it_lo * block_q, min(it_hi * block_q, N)
    return it_first, it_last


@inner(fastmath=False)
def row_stats(lse, delta, b, h, i0, bq, lse_t, delta_t):
    """The ``lse`` and ``delta`` of query rows ``i0 .. i0 + bq - 1`` of head ``(b, h)`` into ``lse_t``, ``delta_t``."""
    for r in range(bq):
        value = lse[b, h, i0 + r]
        # An empty row with beta = 0 has lse = -inf and only -inf logits:
        # shift by +inf so that exp(z - lse) = 0 rather than NaN.
        lse_t[r] = np.inf if value == -np.inf else value
        delta_t[r] = delta[b, h, i0 + r]


@inner(fastmath=False)
def probabilities(st, pt, lse_t, bk, bq, nvm_in_exp):
    """``p = exp(z - lse)`` into ``pt`` (``lse_t`` from `row_stats`); ``s < 0`` removed here with ``nvm_in_exp``."""
    neg_inf = -np.inf
    if nvm_in_exp:
        for c in range(bk):
            for r in range(bq):
                x = st[c, r]
                pt[c, r] = x - lse_t[r] if x >= 0 else neg_inf
    else:
        for c in range(bk):
            for r in range(bq):
                pt[c, r] = st[c, r] - lse_t[r]
    exp_inplace(pt, bk, bq)


@inner(fastmath=False)
def gated_probabilities(st, pt, lse_t, bk, bq, nvm, log_gate, base):
    """`probabilities` under the dynamic window: ``st`` holds the scores ``s / tau`` without ``log G``.

    ``z = s / tau + log G`` is rounded to the tile's dtype as the forward
    rounds it (`elastic_np.cpu._tiles.logits._remove_in_tile`: the same bits), and
    ``p = exp(z - lse)`` goes into ``pt``; ``st`` keeps ``s / tau``, which
    ``z - log G`` would give only to the rounding of ``z`` at ``|log G|``
    (`elastic_np.cpu._prefill.backward._dz_tile`). The gate's table is read at ``base + c - r`` for key ``j0
    + c``, query ``i0 + r``; a closed gate's ``-inf`` and, with ``nvm``, ``s
    < 0`` remove the entry.
    """
    neg_inf = -np.inf
    for c in range(bk):
        at = base + c
        for r in range(bq):
            x = st[c, r]
            z = scalar_like(np.float64(x) + log_gate[at - r], st)
            pt[c, r] = z - lse_t[r] if x >= 0 or not nvm else neg_inf
    exp_inplace(pt, bk, bq)


@inner(fastmath=False)
def softcap_slope(dpt, cap_slope, bk, bq):
    """``ds_raw = ds (1 - tanh^2)``: dk and dq take the raw score's gradient."""
    for c in range(bk):
        row = dpt[c]
        slope_row = cap_slope[c]
        for r in range(bq):
            row[r] *= slope_row[r]


@inner(fastmath=False)
def copy_rows(src, dst):
    """``src``'s first rows into ``dst = (whole, col)`` (`head_rows`' pair), element by element.

    (An array slice assignment compiles Numba's shape-mismatch message,
    string formatting, into the caller.)
    """
    whole, col = dst
    width = src.shape[1]
    for c in range(whole.shape[0]):
        dst_row = whole[c, col : col + width]
        for d in range(width):
            dst_row[d] = src[c, d]


#: `sum_dq_shares`'s ``factor`` of a chunk before the last: none.
NO_FACTOR = np.empty(0)


@njit(nogil=True, cache=True, fastmath=False)
def sum_dq_shares(dq_shares, share_rows, n_shares, block_q, dq, scaled, part, parts):
    """``dq += sum_t dq_shares[t]`` over each share's rows, in the order of ``t``; then, with ``scaled = (factor,
    out)`` holding a factor per head (the last chunk; else an empty one), ``out = factor[h] dq`` in float64,
    rounded, into the operand ``out`` (which may be ``dq``'s own operand)."""
    factor, out = scaled
    B, H, N, D = dq.shape
    n_qt = (N + block_q - 1) // block_q
    for task in task_range(B * H * n_qt, part, parts):
        bh = task // n_qt
        b = bh // H
        h = bh % H
        i0 = (task % n_qt) * block_q
        i1 = min(i0 + block_q, N)
        for t in range(n_shares):
            lo = max(share_rows[t, b, h, 0], i0)
            hi = min(share_rows[t, b, h, 1], i1)
            for i in range(lo, hi):
                for d in range(D):
                    dq[b, h, i, d] += dq_shares[t, b, h, i, d]
        if factor.shape[0] > 0:
            rows, col = head_rows(out, b, h, i0, i1 - i0)
            f = factor[h]
            for r in range(i1 - i0):
                row, dq_row = rows[r, col : col + D], dq[b, h, i0 + r]
                for d in range(D):
                    row[d] = dq_row[d] * f
