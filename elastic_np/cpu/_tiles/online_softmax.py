"""The online softmax's steps, shared by every forward kernel (prefill, AMX, decode): one arithmetic for all.

A query tile keeps per query its running maximum ``m``, its sum ``l`` of
``exp(z - m)`` and its accumulator ``acc = sum exp(z - m) v`` over the key
tiles seen so far; each new tile raises ``m`` where its logits exceed it,
rescales ``l`` and ``acc`` by ``exp(m - m')`` there, and adds its own
exponentials and ``P V``. At the end ``lse = logaddexp(m + log l, log
beta)`` and ``out = acc exp(m - lse)``.

- key-major tiles ``st[c, r]`` (the prefill forward, the AMX forward, the
  decode kernel's key-major path): `load_queries` (the scaled ``Q^T`` of a
  query tile), `online_update` (a tile's step: `rescale_rows`, the shifted
  exponentials and their sums, ``P V``), `finish_rows` (``out`` and ``lse``);
- query-major stacked rows ``st[r, c]`` (the decode kernel's stacked-rows
  path): `query_major_update`, whose partial ``(m, l, acc)`` the decode
  kernel merges across its key splits.
"""

import math

import numpy as np

from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._tiles.calls import exp_inplace, exp_shift_sum, matmul_tn
from elastic_np.cpu._tiles.halves import narrow, widen
from elastic_np.cpu._tiles.logits import column_max
from elastic_np.cpu._tiles.scalar import log_add_exp, scalar_like


@inner(fastmath=FASTMATH)
def online_update(st, v_j, bk, bq, maxed, nvm_in_max, scratch, state):
    """The online softmax's step with a tile of logits ``st[:bk, :bq]`` and its values ``v_j``.

    ``st``: key-major, as `elastic_np.cpu._tiles.logits.logits_tile` leaves
    it; ``v_j = (whole, col)``: the values' rows, as
    `elastic_np.cpu._tiles.operands.head_rows` gives them.
    ``scratch = (tile_max, shift_by, rescale_by, tile_sum)``, each of length
    ``bq`` or more; ``state = (row_max, row_sum, acc)``, the rows' state.
    ``tile_max`` holds the tile's column maxima when ``maxed`` (else they
    are taken here, of the entries ``>= 0`` with ``nvm_in_max``); the rows
    are rescaled to the new maxima and the tile's exponentials (0 for the
    entries ``< 0`` with ``nvm_in_max``) and ``P V`` added.
    """
    tile_max, shift_by, rescale_by, tile_sum = scratch
    row_max, row_sum, acc = state
    if not maxed:
        column_max(st, bk, bq, tile_max, nvm_in_max)
    rescale_rows(tile_max, row_max, row_sum, shift_by, rescale_by, acc, bq)
    for r in range(bq):
        tile_sum[r] = 0.0
    exp_shift_sum(st, bk, bq, shift_by, nvm_in_max, tile_sum)
    for r in range(bq):
        row_sum[r] += tile_sum[r]
    v_rows, v_col = v_j
    matmul_tn(st, 0, v_rows, v_col, acc, bq, acc.shape[1], bk, True)


@inner(fastmath=FASTMATH)
def load_queries(q_tile, factor, q_t):
    """``q_t[:D, :bq] = (q_tile * factor)^T``: the tile's queries, scaled, transposed.

    ``factor``: `elastic_np.cpu._tiles.logits.query_factor`'s; ``q_tile =
    (whole, col)``, the ``bq`` queries' rows
    (`elastic_np.cpu._tiles.operands.head_rows`); ``D = q_t.shape[0]``.
    """
    whole, col = q_tile
    D = q_t.shape[0]
    for r in range(whole.shape[0]):
        q_row = whole[r, col : col + D]
        for d in range(D):
            q_t[d, r] = widen(q_row[d]) * factor


@inner(fastmath=FASTMATH)
def rescale_rows(tile_max, row_max, row_sum, shift_by, rescale_by, acc, bq):
    """The online softmax's update of the row maxima by a tile's: ``m' = max(m, m_tile)``.

    ``row_sum`` and ``acc`` are rescaled by ``exp(m - m')`` where the maximum
    grew; ``shift_by`` receives ``m'``, what the tile's logits are shifted by.
    """
    rescale = False
    for r in range(bq):
        new_max = max(row_max[r], tile_max[r])
        # A row with nothing kept yet stays at -inf; shift by 0 so that
        # exp(-inf - 0) = 0 instead of NaN.
        shift_by[r] = new_max if new_max > -np.inf else 0.0
        if new_max > row_max[r]:
            alpha = math.exp(row_max[r] - shift_by[r])
            row_sum[r] *= alpha
            if alpha != 1.0:
                rescale = True
            rescale_by[r] = alpha
        else:
            rescale_by[r] = 1.0
        row_max[r] = new_max
    if rescale:
        for r in range(bq):
            alpha = rescale_by[r]
            for d in range(acc.shape[1]):
                acc[r, d] *= alpha


@inner(fastmath=FASTMATH)
def finish_rows(acc, row_max, row_sum, log_beta, out_rows, lse_rows):
    """``lse = m + log(l + beta exp(-m)) = logaddexp(m + log l, log beta)`` and ``out = acc exp(m - lse)``.

    ``out_rows = (whole, col)``, the tile's rows of ``out`` (`elastic_np.cpu._tiles.operands.head_rows`).
    A row with nothing kept gets ``out = 0``, ``lse = log beta``; a row whose sum is NaN (a NaN or ``+inf``
    logit, which only a user's ``score_mod`` can give) gets ``lse = NaN``, never the empty row's result.
    """
    whole, col = out_rows
    Dv = acc.shape[1]
    for r in range(whole.shape[0]):
        out_row = whole[r, col : col + Dv]
        if row_sum[r] > 0.0:
            m = np.float64(row_max[r])
            lse_r = log_add_exp(m + math.log(row_sum[r]), log_beta)
            weight = math.exp(m - lse_r)
            for d in range(Dv):
                out_row[d] = narrow(acc[r, d] * weight, out_row)
            lse_rows[r] = lse_r
        else:
            for d in range(Dv):
                out_row[d] = narrow(0.0, out_row)
            lse_rows[r] = log_beta if row_sum[r] == row_sum[r] else np.nan


@inner(fastmath=FASTMATH)
def query_major_update(st, bk, shift_by, state):
    """A kv head's stacked rows of logits ``st[:, :bk]`` made their ``exp(z - m)``, ``state`` updated; returns ``kept``.

    ``st``: query-major, as `elastic_np.cpu._decode.decode._score_rows` leaves it.

    ``shift_by``: the rows' maxima over the tile, made what each row shifts
    by; ``state = (acc, row_max, row_sum)``; ``kept``: whether any row
    keeps a key of the tile (else ``st`` is left as it is). A value that is
    not finite makes ``acc`` not finite (``p v`` with ``p = 0`` too), which
    `elastic_np.cpu._decode.merge.store_split` checks.
    """
    acc, row_max, row_sum = state
    rows, Dv = acc.shape
    any_kept = False
    for r in range(rows):
        tile_max = shift_by[r]
        new_max = max(row_max[r], tile_max)
        # a row with nothing kept yet shifts by 0: exp(-inf - 0) = 0, not NaN
        shift_by[r] = new_max if new_max > -np.inf else 0.0
        if new_max > row_max[r]:
            alpha = math.exp(row_max[r] - shift_by[r])
            row_sum[r] *= alpha
            if alpha != 1.0:
                for d in range(Dv):
                    acc[r, d] *= alpha
        row_max[r] = new_max
        any_kept = any_kept or tile_max > -np.inf
        z = st[r, :bk]
        for c in range(bk):
            z[c] -= shift_by[r]
    if not any_kept:
        return False
    exp_inplace(st, rows, bk)
    for r in range(rows):
        z = st[r, :bk]
        total = scalar_like(0.0, st)
        for c in range(bk):
            total += z[c]
        row_sum[r] += total
    return True
