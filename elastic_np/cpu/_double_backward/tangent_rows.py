"""The double backward's query pass: the tangents of ``out`` and ``lse``, one task per (batch, head, query tile).

Over the key tiles that the query tile may keep (as the forward visits
them), with ``p = exp(z - lse)`` recomputed from ``lse`` as the backward
does (`tile_probabilities`: the tile keeps ``s / tau``) and ``zdot`` the
tangent of the logits:

- ``lsedot_i = sum_j p zdot + betadot exp(-lse_i)`` (float64 sums);
- ``outdot_i = sum_j pdot v_j + p vdot_j`` with ``pdot = p (zdot - lsedot)``,
  accumulated as ``sum_j p zdot v_j - lsedot_i sum_j p v_j + sum_j p vdot_j``
  (``lsedot`` is known only after the last key tile), the key tiles' products
  summed in float64 (`_add_tile_sums`);
- ``deltadot_i = dout_i . outdot_i`` (float64), which the key pass reads.
"""

import math

import numpy as np
from numba import njit

from elastic_np._contract._ranges import key_range
from elastic_np.cpu._double_backward.tangents import score_tangent, tile_probabilities
from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._runtime.threads import claim, query_tile
from elastic_np.cpu._tiles.calls import matmul_tn
from elastic_np.cpu._tiles.logits import logits_tile
from elastic_np.cpu._tiles.operands import head_rows, shape
from elastic_np.cpu._tiles.scalar import scalar_like


@njit(nogil=True, cache=True, fastmath=False)
def _tangent_rows_kernel(ins, tan, options, block_q, block_k, outs, tasks, part, parts):
    """Query tiles: ``outs = (outdot, lsedot, deltadot)``.

    ``ins = (k, v, q_t, dout, lse)``: the operands of ``k``, ``v``,
    ``dout``, the logits' ``Q^T`` tiles (as the backward scales them) and
    ``lse``; ``tan`` the `Tangents`; ``options = (opt, logits_opt)``: the
    plan's options and those the logits tiles are formed with, the gate left
    out (`tile_probabilities`). ``outdot`` is an operand in the kernel's
    dtype, ``lsedot`` and ``deltadot`` float64 ``(B, H, N)``.
    """
    k, v, q_t, dout, lse = ins
    opt, logits_opt = options
    B, Hkv, M, D = shape(k)
    H, N, Dv = q_t.shape[1], opt.n_queries, shape(v)[3]
    group = H // Hkv
    n_qt = (N + block_q - 1) // block_q
    dtype = lse.dtype
    tile_shape = (block_k, block_q)
    st, pt, rdt = np.empty(tile_shape, dtype), np.empty(tile_shape, dtype), np.empty(tile_shape, dtype)
    cap_slope = np.empty(tile_shape if opt.has_softcap else (0, 0), dtype=dtype)
    # sum_j p zdot v_j, sum_j p v_j, sum_j p vdot_j: each key tile's in the kernel's dtype, summed in float64
    tile_acc = np.empty((3, block_q, Dv), dtype=dtype)
    acc = np.empty((3, block_q, Dv))
    lse_t = np.empty(block_q, dtype=dtype)
    zsum = np.empty(block_q)  # sum_j p zdot
    no_max = np.empty(0, dtype=dtype)
    n_tasks = B * H * n_qt
    for _ in range(n_tasks):
        task = claim(tasks)  # each task writes its own rows: `elastic_np.cpu._runtime.threads.claim`
        if task >= n_tasks:
            break
        b, h, hk, it, i0, bq = query_tile(task, n_qt, H, group, block_q, N)
        acc[:] = 0.0
        zsum[:] = 0.0
        for r in range(bq):
            value = lse[b, h, i0 + r]
            lse_t[r] = np.inf if value == -np.inf else value  # p = 0 on an empty row with beta = 0
        j_lo, j_hi = key_range(opt.diag_shift[b], i0, i0 + bq, opt.band[b, h, 0], opt.band[b, h, 1],
                               opt.kv_lengths[b])
        for j0 in range(j_lo, j_hi, block_k):
            bk = min(block_k, j_hi - j0)
            tile = (b, h, i0, bq, j0)
            k_j = head_rows(k, b, hk, j0, bk)
            kept, _ = logits_tile(st, k_j, q_t[b, h, it], logits_opt, tile, False, cap_slope, no_max, opt.nvm, None)
            if not kept:
                continue
            tile_probabilities(st, pt, lse_t, opt, tile, bk)
            score_tangent(rdt, k_j, head_rows(tan.k, b, hk, j0, bk), tan, opt, tile, bk, cap_slope, rdt[:0])
            _weighted_logit_tangent(st, pt, rdt, zsum, tan, opt, tile, bk)
            v_rows, v_col = head_rows(v, b, hk, j0, bk)
            vd_rows, vd_col = head_rows(tan.v, b, hk, j0, bk)
            matmul_tn(rdt, 0, v_rows, v_col, tile_acc[0], bq, Dv, bk, False)
            matmul_tn(pt, 0, v_rows, v_col, tile_acc[1], bq, Dv, bk, False)
            matmul_tn(pt, 0, vd_rows, vd_col, tile_acc[2], bq, Dv, bk, False)
            _add_tile_sums(acc, tile_acc, bq)
        _finish_rows(acc, zsum, lse, tan.beta[h], (b, h, i0, bq), head_rows(dout, b, h, i0, bq), outs)


@inner(fastmath=False)
def _weighted_logit_tangent(st, pt, rdt, zsum, tan, opt, tile, bk):
    """``rdt = p zdot`` in place of ``sdot / tau``, and ``zsum[r] += sum_c p zdot`` in float64.

    ``zdot = sdot / tau - (s / tau) taudot / tau + sigmadot d log G / d sigma``
    with ``st`` the scores ``s / tau`` (`tile_probabilities`); 0 where ``p =
    0``, among them the removed entries, whose ``s / tau`` may be ``-inf``.
    """
    b, h, i0, bq, j0 = tile
    zero = scalar_like(0.0, st)
    if opt.has_gate:
        ratio = tan.tau_ratio[h]
        base = j0 - opt.diag_shift[b] - i0 + opt.n_keys - 1  # the table's index of (j0, i0)
        dlog_gate = tan.dlog_gate[b, h]
        for c in range(bk):
            at = base + c
            for r in range(bq):
                p = pt[c, r]
                zdot = rdt[c, r] - st[c, r] * ratio + dlog_gate[at - r]
                pz = scalar_like(p * zdot, st) if p != 0 else zero
                rdt[c, r] = pz
                zsum[r] += pz
    else:
        ratio_t = scalar_like(tan.tau_ratio[h], st)
        for c in range(bk):
            for r in range(bq):
                p = pt[c, r]
                pz = p * (rdt[c, r] - st[c, r] * ratio_t) if p != 0 else zero
                rdt[c, r] = pz
                zsum[r] += np.float64(pz)


@inner(fastmath=False)
def _add_tile_sums(acc, tile_acc, bq):
    """``acc[:, :bq] += tile_acc[:, :bq]`` in float64.

    ``outdot = sum p zdot v - lsedot sum p v + sum p vdot`` cancels where
    ``zdot`` is near ``lsedot`` along a row: its parts are kept in float64 so
    that ``outdot`` is rounded once, at the end, and ``deltadot`` is taken before.
    """
    for x in range(3):
        for r in range(bq):
            row, tile_row = acc[x, r], tile_acc[x, r]
            for d in range(row.shape[0]):
                row[d] += tile_row[d]


@inner(fastmath=False)
def _finish_rows(acc, zsum, lse, betadot, rows, dout_rows, outs):
    """``lsedot``, ``outdot`` and ``deltadot`` of the query tile's rows ``rows = (b, h, i0, bq)``.

    ``exp(-lse)`` is ``d lse / d beta``; a row with ``lse = -inf`` takes none.
    """
    outdot, lsedot, deltadot = outs
    b, h, i0, bq = rows
    d_whole, d_col = dout_rows
    o_whole, o_col = head_rows(outdot, b, h, i0, bq)
    Dv = acc.shape[2]
    for r in range(bq):
        value = np.float64(lse[b, h, i0 + r])
        row_dot = zsum[r]
        if betadot != 0 and value > -np.inf:
            row_dot += betadot * math.exp(-value)
        lsedot[b, h, i0 + r] = row_dot
        dot = 0.0
        for d in range(Dv):
            x = acc[0, r, d] - row_dot * acc[1, r, d] + acc[2, r, d]
            o_whole[r, o_col + d] = x
            dot += np.float64(d_whole[r, d_col + d]) * x
        deltadot[b, h, i0 + r] = dot
