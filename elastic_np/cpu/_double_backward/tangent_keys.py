"""The double backward's key pass: the tangents of the backward's gradients, one task per (batch, kv head, key tile).

The backward's kernel (`elastic_np.cpu._prefill.backward`) differentiated along the
direction, with the same tasks, query spans, dq shares and dbias plan: per
tile, ``p`` from ``lse`` (`tile_probabilities`: the tile keeps ``s / tau``),
``sdot / tau`` (`score_tangent`), ``dP = dout v`` and ``dPdot = dout
vdot``, then per entry (`_dz_tangents`)

    zdot = sdot / tau - (s / tau) taudot / tau + sigmadot d log G / d sigma
    pdot = p (zdot - lsedot),  dz = p (dP - delta)
    dzdot = pdot (dP - delta) + p (dPdot - deltadot)

with the rows' ``lsedot`` and ``deltadot`` of the query pass. ``tau dsdot =
dzdot - dz taudot / tau`` is the tangent of ``dbias`` (times ``tau``); with
the soft-cap's slope ``c`` and its tangent ``cdot``, ``A = dz c`` and ``Adot
= tau dsdot c + dz cdot`` are ``tau`` times the raw scores' gradient and its
tangent, and

    dvdot_j += sum_i pdot dout_i
    dkdot_j += sum_i Adot q_i scale / tau + A qdot_i scale / tau
    dqdot_i += sum_j Adot k_j + A kdot_j   (times scale / tau afterwards)

The rows of ``dtau``'s and ``dsigma``'s tangents are summed in float64.
"""

import numpy as np
from numba import njit

from elastic_np.cpu._double_backward.tangents import score_tangent, tile_probabilities
from elastic_np.cpu._prefill.dbias import dbias_tile
from elastic_np.cpu._prefill.key_tiles import copy_rows, group_spans, key_task, key_tasks, pair_head, row_stats
from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._runtime.threads import claim
from elastic_np.cpu._tiles.calls import matmul_nn, matmul_tn
from elastic_np.cpu._tiles.logits import logits_tile
from elastic_np.cpu._tiles.operands import head_rows, shape
from elastic_np.cpu._tiles.scalar import scalar_like


@njit(nogil=True, cache=True, fastmath=False)
def _tangent_keys_kernel(ins, tan, outs, dbias, options, block_q, block_k, kt0, kt1, tasks, part, parts):
    """Key tiles ``kt0 .. kt1 - 1``: dkdot, dvdot, the tiles' shares of dqdot, the dtau, dsigma and dbias tangents.

    ``ins = (k, v, q_rows, q_t, dout, dout_t, rows)`` as the backward's
    (``q_rows`` the queries times ``scale / tau_h``), ``rows = (lse, delta,
    lsedot, deltadot)``; ``tan`` the `Tangents`; ``outs = (dk, dv,
    dq_shares, share_rows, dtau_part, dsigma_part)``, ``dbias`` and
    ``options = (opt, logits_opt)`` as the backward's
    (`elastic_np.cpu._prefill.backward._backward_kernel`), whose tasks, each writing
    outputs of its own, its threads claim as these do.
    """
    k, v, q_rows = ins[0], ins[1], ins[2]
    opt = options[0]
    B, Hkv, M, D = shape(k)
    H, Dv = q_rows.shape[1], shape(v)[3]
    group = H // Hkv
    n_chunk = kt1 - kt0
    n_tasks, pairs = key_tasks(dbias[0], B, Hkv, n_chunk)
    scratch = _keys_scratch(k, block_q, block_k, Dv, group, opt.has_softcap)
    for _ in range(n_tasks):
        task = claim(tasks)
        if task >= n_tasks:
            break
        t, slot, outer, first, last = key_task(task, n_chunk, dbias[0], pairs)
        for pair in range(first, last):
            b, hk = pair_head(dbias[0], pair, outer, Hkv)
            _key_tile(ins, tan, outs, dbias, options, scratch, (b, hk, t, kt0 + t, slot), block_q, block_k)


@inner(fastmath=False)
def _keys_scratch(k, block_q, block_k, Dv, group, has_softcap):
    """The per-thread tiles of `_tangent_keys_kernel`, reused by its tasks.

    ``(tiles, cap, rows_t, dk_acc, dv_acc, head_sums, spans)``: ``tiles =
    (st, pt, rdt, dpt, dpdt)`` (`_dz_tangents`), ``cap = (cap_slope,
    cap_dot)`` (empty without a soft-cap), the query tile's ``lse``,
    ``delta``, ``lsedot``, ``deltadot``, the ``dkdot`` and ``dvdot``
    accumulators, per head of the group its three float64 sums by query
    (`_dz_tangents`) and query tiles ``[it_lo, it_hi)``.
    """
    dtype = k[0].dtype
    D = shape(k)[3]
    tile = (block_k, block_q)
    cap = tile if has_softcap else (0, 0)
    tiles = (np.empty(tile, dtype), np.empty(tile, dtype), np.empty(tile, dtype), np.empty(tile, dtype),
             np.empty(tile, dtype))
    return (
        tiles, (np.empty(cap, dtype), np.empty(cap, dtype)), np.empty((4, block_q), dtype),
        np.empty((block_k, D), dtype), np.empty((block_k, Dv), dtype),
        np.empty((group, 3, block_q)), np.empty((group, 2), dtype=np.int64),
    )


@inner(fastmath=False)
def _key_tile(ins, tan, outs, dbias, options, scratch, task, block_q, block_k):
    """One key tile of one (batch, kv head) pair: ``task = (b, hk, t, kt, slot)``, ``t`` its place in the chunk."""
    k, v = ins[0], ins[1]
    opt = options[0]
    dk, dv, dq_shares, share_rows, dtau_part, dsigma_part = outs
    b, hk, t, kt, slot = task
    M, N = opt.n_keys, opt.n_queries
    group = scratch[6].shape[0]
    tiles, cap, rows_t, dk_acc, dv_acc, head_sums, spans = scratch
    j0 = kt * block_k
    bk_all = min(block_k, M - j0)
    bk = max(min(bk_all, opt.kv_lengths[b] - j0), 0)  # keys past kv_lengths get 0
    keys = (head_rows(k, b, hk, j0, bk), head_rows(v, b, hk, j0, bk), head_rows(tan.k, b, hk, j0, bk),
            head_rows(tan.v, b, hk, j0, bk))
    dk_acc[:bk_all] = 0.0
    dv_acc[:bk_all] = 0.0
    head_sums[:] = 0.0
    it_first, it_last = group_spans(opt, b, hk, j0, bk, block_q, spans, share_rows[t])
    for it in range(it_first, it_last):
        i0 = it * block_q
        bq = min(block_q, N - i0)
        for g in range(group):
            h = hk * group + g
            if it < spans[g, 0] or it >= spans[g, 1]:
                continue
            share = dq_shares[t, b, h, i0 : i0 + bq]
            tile = (b, h, i0, bq, j0)
            if not _key_tile_head(ins, tan, options, scratch, keys, tile, bk, head_sums[g]):
                share[:, :] = 0.0
                continue
            if dbias[0][0] > 0:
                # the tangent of dbias = ds = dz / tau: (tau dsdot) / tau
                dbias_tile(tiles[4], dbias, (bk, bq, b, h, i0, j0), slot, 1.0 / opt.tau[h])
            if opt.has_softcap:
                _cap_chain(tiles[3], tiles[4], cap[0], cap[1], bk, bq)
            _tangent_products(ins, tan, scratch, keys, tile, bk, share)
    for g in range(group):
        h = hk * group + g
        inv_tau = 1.0 / opt.tau[h]
        sums = head_sums[g]
        # dtau's tangent -(1/tau^2) sum (dzdot s + dz sdot) + 2 taudot / tau^3 sum dz s, the sums of s / tau
        dtau_part[b, h, kt] = (2.0 * tan.tau_ratio[h] * sums[1].sum() - sums[0].sum()) * inv_tau
        dsigma_part[b, h, kt] = sums[2].sum()
    copy_rows(dk_acc, head_rows(dk, b, hk, j0, bk_all))
    copy_rows(dv_acc, head_rows(dv, b, hk, j0, bk_all))


@inner(fastmath=False)
def _key_tile_head(ins, tan, options, scratch, keys, tile, bk, sums):
    """The entrywise tangents of one head's tile (`_dz_tangents`); False when the mask leaves nothing in it."""
    q_t, dout_t, rows = ins[3], ins[5], ins[6]
    opt, logits_opt = options
    lse, delta, lsedot, deltadot = rows
    tiles, cap, rows_t = scratch[0], scratch[1], scratch[2]
    st, pt, rdt, dpt, dpdt = tiles
    (k_rows, k_col), (v_rows, v_col), kdot_j, (vd_rows, vd_col) = keys
    b, h, i0, bq, j0 = tile
    Dv = dout_t.shape[3]
    it = i0 // q_t.shape[4]
    kept, _ = logits_tile(st, keys[0], q_t[b, h, it], logits_opt, tile, False, cap[0], rows_t[0, :0], opt.nvm,
                          None)
    if not kept:
        return False
    row_stats(lse, delta, b, h, i0, bq, rows_t[0], rows_t[1])
    row_stats(lsedot, deltadot, b, h, i0, bq, rows_t[2], rows_t[3])
    tile_probabilities(st, pt, rows_t[0], opt, tile, bk)
    score_tangent(rdt, keys[0], kdot_j, tan, opt, tile, bk, cap[0], cap[1])
    matmul_nn(v_rows, v_col, dout_t[b, h, it], 0, dpt, bk, bq, Dv, False)
    matmul_nn(vd_rows, vd_col, dout_t[b, h, it], 0, dpdt, bk, bq, Dv, False)
    _dz_tangents(tiles, rows_t, sums, tan, opt, tile, bk)
    return True


@inner(fastmath=False)
def _tangent_products(ins, tan, scratch, keys, tile, bk, share):
    """``dvdot``, ``dkdot`` and the tile's share of ``dqdot`` from ``pdot``, ``A`` and ``Adot``."""
    q_rows, dout = ins[2], ins[4]
    pt, dpt, dpdt = scratch[0][1], scratch[0][3], scratch[0][4]
    dk_acc, dv_acc = scratch[3], scratch[4]
    (k_rows, k_col), (kd_rows, kd_col) = keys[0], keys[2]
    b, h, i0, bq, j0 = tile
    D, Dv = dk_acc.shape[1], dv_acc.shape[1]
    dout_rows, dout_col = head_rows(dout, b, h, i0, bq)
    matmul_nn(pt, 0, dout_rows, dout_col, dv_acc, bk, Dv, bq, True)
    matmul_nn(dpdt, 0, q_rows[b, h, i0 : i0 + bq], 0, dk_acc, bk, D, bq, True)
    matmul_nn(dpt, 0, tan.q_rows[b, h, i0 : i0 + bq], 0, dk_acc, bk, D, bq, True)
    matmul_tn(dpdt, 0, k_rows, k_col, share, bq, D, bk, False)
    matmul_tn(dpt, 0, kd_rows, kd_col, share, bq, D, bk, True)


@inner(fastmath=False)
def _dz_tangents(tiles, rows_t, sums, tan, opt, tile, bk):
    """Entrywise: ``pdot``, ``dz`` and ``tau dsdot`` in place of ``p``, ``dP`` and ``dPdot``; the rows' sums.

    ``tiles = (st, pt, rdt, dpt, dpdt)`` hold ``s / tau``, ``p``, ``sdot / tau``,
    ``dP``, ``dPdot``; ``rows_t`` the rows' ``lse``, ``delta``, ``lsedot``,
    ``deltadot``. ``sums`` (float64, by query) take ``dzdot s / tau + dz sdot
    / tau`` and ``dz s / tau`` (``dtau``'s tangent) and ``dzdot d log G /
    d sigma + dz sigmadot d^2 log G / d sigma^2`` (``dsigma``'s). Entries
    with ``p = 0`` give 0 (their ``s / tau`` may be ``-inf``).
    """
    st, pt, rdt, dpt, dpdt = tiles
    delta_t, lsedot_t, deltadot_t = rows_t[1], rows_t[2], rows_t[3]
    b, h, i0, bq, j0 = tile
    zero = scalar_like(0.0, st)
    ratio = tan.tau_ratio[h]
    ratio_t = scalar_like(ratio, st)
    gated = opt.has_gate
    base = j0 - opt.diag_shift[b] - i0 + opt.n_keys - 1  # the gate tables' index of (j0, i0)
    gb, gh = (b, h) if gated else (0, 0)  # the tables are 1 x 1 x 1 without a gate
    dlog_gate = opt.dlog_gate[gb, gh]
    dlog_dot, d2log_dot = tan.dlog_gate[gb, gh], tan.d2log_gate[gb, gh]
    for c in range(bk):
        at = base + c
        for r in range(bq):
            p = pt[c, r]
            live = p != 0
            sd = rdt[c, r]
            s = st[c, r]
            if gated:
                zdot = scalar_like(sd - s * ratio + dlog_dot[at - r], st)
            else:
                zdot = sd - s * ratio_t
            s = s if live else zero
            dp = dpt[c, r] - delta_t[r]
            dz = p * dp
            pdot = p * (zdot - lsedot_t[r]) if live else zero
            dzdot = pdot * dp + p * (dpdt[c, r] - deltadot_t[r])
            pt[c, r] = pdot
            dpt[c, r] = dz
            dpdt[c, r] = dzdot - dz * ratio_t
            sums[0, r] += np.float64(dzdot) * np.float64(s) + np.float64(dz) * np.float64(sd)
            sums[1, r] += np.float64(dz) * np.float64(s)
            if gated:
                sums[2, r] += np.float64(dzdot) * dlog_gate[at - r] + np.float64(dz) * d2log_dot[at - r]


@inner(fastmath=False)
def _cap_chain(dpt, dpdt, cap_slope, cap_dot, bk, bq):
    """Through the soft-cap: ``Adot = (tau dsdot) c + dz cdot`` in place of ``tau dsdot``, ``A = dz c`` of ``dz``."""
    for c in range(bk):
        dz_row, e_row, slope_row, dot_row = dpt[c, :bq], dpdt[c, :bq], cap_slope[c, :bq], cap_dot[c, :bq]
        for r in range(dz_row.shape[0]):
            dz = dz_row[r]
            e_row[r] = e_row[r] * slope_row[r] + dz * dot_row[r]
            dz_row[r] = dz * slope_row[r]
