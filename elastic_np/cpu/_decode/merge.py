"""A decode task's result: its split's partials, or, for a batch entry of one split, its rows of ``out`` and ``lse``.

A task of `elastic_np.cpu._decode.decode` ends with the online softmax's
state of its stacked rows, ``(acc, row_max, row_sum)``. Where the batch
entry has several key splits, `store_split` keeps them as the split's
partials and `_merge_kernel` merges the splits after every task has run;
where it has one, the task writes its rows of ``out`` and ``lse`` there
and then (`finish_split`), with the merge's own arithmetic on that one
split (`write_rows`): the same bits, without the partials' memory or the
merge's call, and on the thread that ran the task.
"""

import math

import numpy as np
from numba import njit
from numba.extending import overload

from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._runtime.threads import task_range
from elastic_np.cpu._tiles.halves import narrow
from elastic_np.cpu._tiles.operands import head
from elastic_np.cpu._tiles.scalar import log_add_exp, scalar_like


@inner(fastmath=FASTMATH)
def store_split(acc, row_max, row_sum, part_acc, part_max, part_sum, v_scale):
    """A split's partials of its stacked rows into ``part_*``, ``acc`` times ``v_scale`` (a quantized cache's;
    1 for a float cache, which changes no bit); returns ``sum(acc * 0)`` (NaN if not finite)."""
    checksum = scalar_like(0.0, acc)
    zero = scalar_like(0.0, acc)
    for r in range(acc.shape[0]):
        part_max[r] = row_max[r]
        part_sum[r] = row_sum[r]
        for d in range(acc.shape[1]):
            part_acc[r, d] = acc[r, d] * v_scale
            checksum += acc[r, d] * zero
    return checksum


@inner(fastmath=FASTMATH)
def finish_split(acc, row_max, row_sum, v_scale, where, beta, final, one):
    """The stacked rows of a batch entry's only split, as `_merge_kernel` would leave them, into ``final``.

    ``where = (b, hk, N)``: row ``r`` is query ``r % N`` of head ``hk *
    group + r // N``; ``final = (out, lse)`` (``out`` an operand);
    ``one = (part_max, part_sum, part_acc, weight, x)``: ``(1, rows)``,
    ``(1, rows)``, ``(1, rows, Dv)``, ``(1,)``, ``(Dv,)``, float64 but
    ``part_acc`` in the compute dtype: the partials of one split. Returns
    `store_split`'s check.
    """
    b, hk, N = where
    out, lse = final
    part_max, part_sum, part_acc, weight, x = one
    check = store_split(acc, row_max, row_sum, part_acc[0], part_max[0], part_sum[0], v_scale)
    write_rows((part_max, part_sum, part_acc, 1), beta, (weight, x), (out, lse), (b, hk, N))
    return check


@inner(fastmath=FASTMATH)
def task_result(acc, row_max, row_sum, v_scale, task, outs, one):
    """The end of a task, split ``s`` of ``n_split`` of kv head ``hk`` (``task = (b, hk, s, n_split, N,
    beta)``): `finish_split` for an entry of one split, else `store_split` into the partials of ``outs =
    (part_max, part_sum, part_acc, read, suspect, out, lse)``; returns the check of ``acc``."""
    b, hk, s, n_split, N, beta = task
    part_max, part_sum, part_acc, _, _, out, lse = outs
    if n_split == 1:
        return finish_split(acc, row_max, row_sum, v_scale, (b, hk, N), beta, (out, lse), one)
    return store_split(acc, row_max, row_sum, part_acc[b, hk, s], part_max[b, hk, s], part_sum[b, hk, s], v_scale)


def one_split(rows, Dv, dtype):
    """`finish_split`'s scratch ``one`` for ``rows`` stacked rows (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(one_split, inline="always")
def _one_split(rows, Dv, dtype):
    return lambda rows, Dv, dtype: (np.empty((1, rows)), np.empty((1, rows)), np.empty((1, rows, Dv), dtype=dtype),
                                    np.empty(1), np.empty(Dv))


@inner(fastmath=False)
def write_rows(parts, beta, scratch, final, where):
    """The rows of ``out`` and ``lse`` of one task from the partials of its stacked rows' ``n_split`` splits,
    ``parts = (part_max, part_sum, part_acc, n_split)`` (``[s, r]``, ``[s, r]``, ``[s, r, :Dv]``), in split
    order, ``beta_h`` added once: row ``r`` is query ``r % N`` of head ``hk * group + r // N`` (``where = (b,
    hk, N)``) of ``final = (out, lse)``.

    ``lse = logaddexp(m + log l, log beta_h)`` with ``m = max_s m_s``,
    ``l = sum_s l_s exp(m_s - m)``, and ``out = sum_s acc_s exp(m_s - lse)``;
    ``scratch = (weight, x)``, float64 of at least the splits and of ``Dv``.
    One call a task, and no view of a row: a call of its own, or a view (two atomic counts of its memory),
    a row would cost about what its arithmetic does.
    """
    part_max, part_sum, part_acc, n_split = parts
    out, lse = final
    b, hk, N = where
    weight, x = scratch
    rows, Dv = part_acc.shape[1], part_acc.shape[2]
    group = rows // N
    for r in range(rows):
        h, i = hk * group + r // N, r % N
        log_beta = math.log(beta[h]) if beta[h] > 0 else -np.inf
        m = -np.inf
        for s in range(n_split):
            m = max(m, part_max[s, r])
        total = 0.0
        if m > -np.inf:
            for s in range(n_split):
                if part_max[s, r] > -np.inf:  # exp(0) is 1 exactly: not called for the split of the maximum
                    total += part_sum[s, r] * (1.0 if part_max[s, r] == m else math.exp(part_max[s, r] - m))
        out_h, col = head(out, b, h)
        if total > 0.0:
            lse_r = log_add_exp(m + math.log(total), log_beta)
            if n_split == 1:  # the loops below in one: x[d] = 0 + acc[d] w (a zero's sign as they leave it)
                w = math.exp(part_max[0, r] - lse_r)
                for d in range(Dv):
                    out_h[i, col + d] = narrow(0.0 + np.float64(part_acc[0, r, d]) * w, out_h)
                lse[b, h, i] = lse_r
                continue
            for s in range(n_split):
                weight[s] = math.exp(part_max[s, r] - lse_r)  # 0 for an empty split
            for d in range(Dv):
                x[d] = 0.0
            for s in range(n_split):  # each x[d] summed in split order; the loop over d vectorises
                w = weight[s]
                for d in range(Dv):
                    x[d] += np.float64(part_acc[s, r, d]) * w
            for d in range(Dv):
                out_h[i, col + d] = narrow(x[d], out_h)
            lse[b, h, i] = lse_r
        else:
            for d in range(Dv):
                out_h[i, col + d] = narrow(0.0, out_h)
            lse[b, h, i] = log_beta


@njit(nogil=True, cache=True, fastmath=False)
def _merge_kernel(part_max, part_sum, part_acc, split_start, beta, N, out, lse, part, parts):
    """Merge the splits of each stacked row of the batch entries of several splits (`write_rows`); an entry of
    one split was finished by its tasks (`finish_split`).

    Batch entry ``b`` has ``split_start[b + 1] - split_start[b]`` splits;
    ``out``: an operand (`elastic_np.cpu._tiles.operands`).
    """
    B, Hkv, most = part_max.shape[:3]
    scratch = (np.empty(most), np.empty(part_acc.shape[4]))
    for task in task_range(B * Hkv, part, parts):
        b = task // Hkv
        hk = task % Hkv
        n_split = split_start[b + 1] - split_start[b]
        if n_split == 1:
            continue
        write_rows((part_max[b, hk], part_sum[b, hk], part_acc[b, hk], n_split), beta, scratch, (out, lse),
                   (b, hk, N))
