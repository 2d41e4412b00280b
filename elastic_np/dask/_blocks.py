r"""One block of a chunked attention, computed exactly by an ordinary `attention` call.

A block is the attention of queries ``[i0, i1)`` over keys ``[j0, j1)`` for
batches ``[b0, b1)`` and query heads ``[h0, h1)``. Every option that depends
on where a key sits relative to a query (causal, the window, ALiBi, the
dynamic window) reads the offset ``d = j - i - (E_b - N)`` of the whole
problem (`elastic_np.reference._offsets`). In block coordinates
``j' = j - j0``, ``i' = i - i0`` it is ``d = j' - i' - S_b`` with the shift

.. math:: S_b = E_b - N + i_0 - j_0 .

An `attention` call on arrays of ``N''`` queries and ``M''`` keys
(``align="array"``) measures ``j' - i' - (M'' - N'')``, so the block is that
call once ``M'' - N'' = S_b``: the keys get ``P`` zero rows appended (past
the call's ``kv_lengths``, so never read, and allocated by `numpy.zeros`,
so never touched) or the queries get ``Q`` zero rows appended (computed and
dropped). Where ``S_b`` asks for many appended queries, the block is taken
with its queries and keys both reversed: the offset changes sign, causal
becomes a window's left bound of 0, ``(left, right)`` swap, and ALiBi and the
bell curve are even in ``d``; appended keys then suffice where appended
queries would be needed before. The dynamic window's position
``x = 2 d / (E_b - 1)`` is kept by rescaling ``sigma``, ``sharpness`` and
``threshold`` by ``r = (E_b - 1) / (M'' - 1)`` (which leaves the gate
unchanged: ``x/sigma`` and ``sharpness * f`` are invariant), and ``dsigma``
by ``r``. A block whose offsets no option constrains is a call with no
shift at all.

Blocks are described by plain tuples and `BlockSpec` so that they pickle to
any Dask worker. This module imports no Dask.
"""

import contextlib
import dataclasses
import math

import numpy as np

from elastic_np._api import dispatch
from elastic_np._contract import _grads, _problem, _types


@dataclasses.dataclass(frozen=True, eq=False)
class BlockSpec:
    """The whole problem, as every block reads it.

    ``problem`` is the validated `~elastic_np._contract._problem.AttentionProblem`
    without its arrays (``q``, ``k``, ``v``, ``mask``, ``bias`` are None: the
    blocks get their chunks), whose values say where a block's offsets fall.
    ``options`` are the keyword options of a block's call as far as they are
    the whole problem's: every option as given but ``mask``, ``bias`` and
    ``kv_lengths``, with ``scale`` as validated, ``beta = 0`` (added once at
    the root) and ``align="array"`` (the call's shift places its queries); a
    call replaces only what the block cuts or shifts (`_local_options`).
    """

    N: int
    M: int
    group: int  # query heads per kv head
    ends: np.ndarray  # int64 (B,): E_b
    problem: _problem.AttentionProblem
    options: dict
    backend: str
    threads: int  # kernel threads per task


@dataclasses.dataclass(frozen=True)
class Call:
    """One `attention` call of a block: batches (block-local), shift and geometry."""

    batches: tuple
    aligned: bool  # False: no positional option applies, no shift needed
    key_limits: tuple  # per batch: keys of the chunk kept (``kv_lengths`` from ``j0``)
    reverse: bool = False
    pad_keys: int = 0
    pad_queries: int = 0
    ratio: float = 1.0  # r of the dynamic window


def _structural_range(spec):
    """Offsets ``[lo, hi]`` that causal and the window keep (None: unbounded)."""
    left, right = spec.problem.window
    hi = 0 if spec.problem.causal else None
    if right >= 0:
        hi = right if hi is None else min(hi, right)
    lo = -left if left >= 0 else None
    return lo, hi


def _gate_reach(spec, b, h0, h1):
    """A bound on ``|d|`` where some head's gate is open (-1: closed for every offset; None: any)."""
    E = int(spec.ends[b])
    reach = -1
    for h in range(h0, h1):
        s = float(spec.problem.sigma[b, h])
        if spec.problem.threshold > 0.0:
            c = spec.problem.threshold * s * math.sqrt(2 * math.pi)
            if c >= 1.0:
                continue  # f <= 1 / (sigma sqrt(2 pi)) <= threshold: closed everywhere
            y_max = -math.log(c)
        else:
            y_max = 746.0  # exp(-y) underflows to 0 beyond about 745.13
        if E <= 1:
            return None  # x = 0 for every offset, and the gate is open there
        x_max = s * math.sqrt(2.0 * y_max) * (1.0 + 1e-6) + 1e-12
        reach = max(reach, int(x_max * (E - 1) / 2.0) + 2)
    return reach


def _batch_range(spec, block, b, lo, hi):
    """``(limit, S, cut)`` of batch ``b`` in ``block``, or None where the block keeps none of its pairs.

    ``limit``: the chunk's keys below ``kv_lengths``; ``S``: the shift;
    ``cut``: whether causal or the window (offsets ``[lo, hi]``,
    `_structural_range`) removes some of the block's pairs.
    """
    _, _, h0, h1, i0, i1, j0, j1 = block
    n, m = i1 - i0, j1 - j0
    limit = int(min(max(spec.problem.kv_lengths[b] - j0, 0), m))
    if n == 0 or limit == 0:
        return None
    S = int(spec.ends[b]) - spec.N + i0 - j0
    d_min, d_max = -(n - 1) - S, limit - 1 - S
    a, z = d_min, d_max
    if lo is not None:
        a = max(a, lo)
    if hi is not None:
        z = min(z, hi)
    if spec.problem.sigma is not None:
        reach = _gate_reach(spec, b, h0, h1)
        if reach is not None:
            a, z = max(a, -reach), min(z, reach)
    if a > z:
        return None
    cut = (lo is not None and d_min < lo) or (hi is not None and d_max > hi)
    return limit, S, cut


def plan(spec, block):
    """The calls that compute ``block``, or ``[]`` when it keeps nothing at all.

    Batches whose keys the block keeps nothing of are in no call (their
    partial is ``out = 0``, ``lse = -inf``): the tile-pair skipping of the
    kernels, one level up.
    """
    b0, b1, _, _, i0, i1, _, _ = block
    n = i1 - i0
    lo, hi = _structural_range(spec)
    kept = []
    for b in range(b0, b1):
        batch = _batch_range(spec, block, b, lo, hi)
        if batch is not None:
            kept.append((b - b0,) + batch)
    if not kept:
        return []
    if not any(cut for *_, cut in kept) and spec.problem.alibi is None and spec.problem.sigma is None:
        return [Call(tuple(b for b, *_ in kept), False, tuple(limit for _, limit, *_ in kept))]
    groups = {}
    for b, limit, S, _ in kept:
        groups.setdefault((limit, S, int(spec.ends[b0 + b])), []).append(b)
    return [_aligned_call(spec, tuple(bs), n, limit, S, E) for (limit, S, E), bs in groups.items()]


def _aligned_call(spec, batches, n, m, S, E):
    """The geometry that realises shift ``S`` for ``n`` queries over ``m`` keys (the chunk cut to them)."""
    if spec.problem.sigma is not None and E <= 1:
        # x = 0 everywhere: the call needs M'' = 1 (here m = 1), so only queries are appended
        return Call(batches, True, (m,) * len(batches), pad_queries=1 - n - S)
    # M'' - N'' = S as written, or M' - N' - S reversed; P - Q fixes it, the other is 0
    forward = (max(0, (m - n) - S), max(0, S - (m - n)))  # (Q, P)
    backward = (max(0, S), max(0, -S))
    reverse = backward < forward
    Q, P = backward if reverse else forward
    ratio = 1.0
    if spec.problem.sigma is not None:
        extra = max(0, 2 - (m + P))  # x' = 2 d / (M'' - 1) needs M'' >= 2
        Q, P = Q + extra, P + extra
        ratio = (E - 1) / (m + P - 1)
    return Call(batches, True, (m,) * len(batches), reverse, P, Q, ratio)


def _flip_pad(a, reverse, pad, axis, fill=0, broadcast=False):
    """``a`` reversed along ``axis`` and padded with ``pad`` entries ``fill`` at its end.

    With ``broadcast``, an axis of length 1 (a mask's or bias's broadcast
    axis) is left as it is: it then also covers the appended rows or keys,
    which are dropped or never read.
    """
    if broadcast and a.shape[axis] == 1:
        return a
    if reverse:
        a = np.flip(a, axis)
    if pad:
        shape = list(a.shape)
        shape[axis] += pad
        out = np.zeros(shape, dtype=a.dtype) if fill == 0 else np.full(shape, fill, dtype=a.dtype)
        index = [slice(None)] * a.ndim
        index[axis] = slice(0, a.shape[axis])
        out[tuple(index)] = a
        a = out
    return a


def _unflip(a, reverse, length, axis, broadcast=False):
    """Undo `_flip_pad`: the first ``length`` entries along ``axis``, in the original order."""
    if broadcast and a.shape[axis] == 1:
        return a
    index = [slice(None)] * a.ndim
    index[axis] = slice(0, length)
    a = a[tuple(index)]
    return np.flip(a, axis) if reverse else a


def _rows(a, batches):
    """Batch rows ``batches`` of ``a``: ``a`` itself (no copy) when they are all of them, in order."""
    return a if batches == list(range(a.shape[0])) else a[batches]


def _take(a, batches, keys=None):
    """Rows ``batches`` of a block-shaped option array (size-1 axes kept), keys cut to ``keys``."""
    if a is None:
        return None
    if a.shape[0] > 1:
        a = _rows(a, list(batches))
    if keys is not None and a.shape[3] > 1:
        a = a[..., :keys]
    return a


def _kv_heads(spec, h0, h1, kv_first):
    """Local kv head of each query head ``h0 .. h1-1``, and whether the group structure survives."""
    index = np.arange(h0, h1) // spec.group - kv_first
    whole = h0 % spec.group == 0 and (h1 - h0) % spec.group == 0
    return index, whole


def _local_options(spec, call, block, mask, bias):
    """The keyword options of the call: the problem's, with what the block cuts or shifts replaced.

    ``mask`` and ``bias`` are already cut and flipped. A call that no
    positional option constrains (not ``call.aligned``) gets none of them.
    """
    b0, _, h0, h1, *_ = block
    p = spec.problem
    opts = dict(spec.options, tau=p.tau[h0:h1], mask=mask, bias=bias)
    if not call.aligned:
        opts.update(causal=False, window_size=(-1, -1), kv_lengths=np.array(call.key_limits, dtype=np.int64))
        return opts
    bs = [b0 + b for b in call.batches]
    opts["kv_lengths"] = np.full(len(bs), call.key_limits[0], dtype=np.int64)
    left, right = p.window
    if call.reverse:  # offsets change sign: causal d <= 0 becomes d >= 0, a left bound of 0
        opts.update(causal=False, window_size=(0 if p.causal else right, left))
    else:
        opts.update(causal=p.causal, window_size=(left, right))
    if p.alibi is not None:
        opts["alibi_slopes"] = p.alibi[bs, h0:h1]
    if p.sigma is not None:
        r = call.ratio
        opts["dynamic_window"] = _types.DynamicWindow(
            p.sigma[bs, h0:h1] * r, sharpness=p.sharpness * r, threshold=p.threshold / r
        )
    return opts


def _local_arrays(spec, call, block, q, k, v, mask, bias):
    """Queries, keys, values, mask and bias of the call, shifted as `Call` says."""
    b0, b1, h0, h1, *_ = block
    batches = list(call.batches)
    m = call.key_limits[0] if call.aligned else k.shape[2]
    rev, P, Q = call.reverse, call.pad_keys, call.pad_queries
    q = _flip_pad(_rows(q, batches), rev, Q, 2)
    k = _flip_pad(_rows(k, batches)[:, :, :m], rev, P, 2)
    v = _flip_pad(_rows(v, batches)[:, :, :m], rev, P, 2)
    cut = m if call.aligned else None
    mask = _take(mask, batches, cut)
    bias = _take(bias, batches, cut)
    if mask is not None:
        mask = _flip_pad(_flip_pad(mask, rev, Q, 2, False, True), rev, P, 3, False, True)
    if bias is not None:
        bias = _flip_pad(_flip_pad(bias, rev, Q, 2, 0, True), rev, P, 3, 0, True)
    return q, k, v, mask, bias


def _expand_heads(spec, block, k, v, kv_first):
    """``k`` and ``v`` with one kv head per query head when the block cuts through a group."""
    index, whole = _kv_heads(spec, block[2], block[3], kv_first)
    if whole:
        lo = index[0]
        return k[:, lo:index[-1] + 1], v[:, lo:index[-1] + 1], None
    return k[:, index], v[:, index], index


@contextlib.contextmanager
def kernel_threads(n):
    """Run the kernels called from this thread on ``n`` threads, then restore the count.

    Numba's thread count is per calling thread (`numba.set_num_threads`), and
    the CPU kernels read it (`elastic_np.cpu.thread_count`): a Dask worker
    thread that sets it changes nothing for the worker's other threads.
    """
    import numba

    previous = numba.get_num_threads()
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(previous)


def forward_block(spec, block, q, k, v, mask, bias, kv_first):
    """The block's partial ``(out, lse)`` with ``beta = 0``, in the backend's dtype.

    ``q``, ``mask``, ``bias`` are the block's chunks (option arrays with
    size-1 axes where broadcast); ``k``, ``v`` the key chunk over the kv
    heads from ``kv_first`` that cover the block's query heads. Batches the
    block keeps nothing of get ``out = 0``, ``lse = -inf``.
    """
    b0, b1, h0, h1, i0, i1, j0, j1 = block
    n = i1 - i0
    k, v, _ = _expand_heads(spec, block, k, v, kv_first)
    out = lse = None
    with kernel_threads(spec.threads):
        for call in plan(spec, block):
            ql, kl, vl, ml, bl = _local_arrays(spec, call, block, q, k, v, mask, bias)
            opts = _local_options(spec, call, block, ml, bl)
            o, s = dispatch.attention(ql, kl, vl, return_lse=True, backend=spec.backend, **opts)
            o, s = _unflip(o, call.reverse, n, 2), _unflip(s, call.reverse, n, 2)
            if list(call.batches) == list(range(b1 - b0)):  # one call for the whole block
                return o, s
            if out is None:
                out = np.zeros((b1 - b0, h1 - h0, n, v.shape[3]), dtype=o.dtype)
                lse = np.full((b1 - b0, h1 - h0, n), -np.inf, dtype=s.dtype)
            out[list(call.batches)] = o
            lse[list(call.batches)] = s
    return out, lse


def backward_block(spec, block, q, k, v, mask, bias, kv_first, dout, out, lse, dlse=None):
    """The block's share of every gradient, in float64.

    Returns ``(dq, dk, dv, dtau, dsigma, dbias)``: ``dq`` of the block's
    queries, ``dk``/``dv`` of the kv heads from ``kv_first`` given, ``dtau``
    per head ``(Hc,)``, ``dsigma`` ``(Bc, Hc)`` or None, ``dbias`` in the
    shape of the block's ``bias`` chunk or None. ``out`` and ``lse`` are the
    whole rows' (the forward's), so that ``P = exp(z - lse)`` of the block is
    that of the whole problem and the shares add up to the gradient; so is
    ``dlse``, the cotangent of ``lse`` (None for zeros).
    """
    b0, b1, h0, h1, i0, i1, j0, j1 = block
    n = i1 - i0
    Bc, Hc = b1 - b0, h1 - h0
    dq = np.zeros((Bc, Hc, n, q.shape[3]))
    dk_full, dv_full = np.zeros(k.shape), np.zeros(v.shape)
    k_local, v_local, index = _expand_heads(spec, block, k, v, kv_first)
    dk = np.zeros(k_local.shape)
    dv = np.zeros(v_local.shape)
    dtau = np.zeros(Hc)
    dsigma = None if spec.problem.sigma is None else np.zeros((Bc, Hc))
    dbias = None if bias is None else np.zeros(bias.shape)
    pad_lse = np.finfo(lse.dtype).max  # appended rows: exp(z - lse) = 0, and dout = 0 there
    with kernel_threads(spec.threads):
        for call in plan(spec, block):
            bs = list(call.batches)
            ql, kl, vl, ml, bl = _local_arrays(spec, call, block, q, k_local, v_local, mask, bias)
            opts = _local_options(spec, call, block, ml, bl)
            rev, Q = call.reverse, call.pad_queries
            grads = dispatch.attention_backward(
                _flip_pad(_rows(dout, bs), rev, Q, 2), ql, kl, vl, _flip_pad(_rows(out, bs), rev, Q, 2),
                _flip_pad(_rows(lse, bs), rev, Q, 2, fill=pad_lse),
                dlse=None if dlse is None else _flip_pad(_rows(dlse, bs), rev, Q, 2),
                backend=spec.backend, **opts,
            )
            m = kl.shape[2] - call.pad_keys
            dq[bs] = _unflip(grads.dq, rev, n, 2)
            dk[bs, :, :m] = _unflip(grads.dk, rev, m, 2)
            dv[bs, :, :m] = _unflip(grads.dv, rev, m, 2)
            dtau += grads.dtau
            if dsigma is not None:
                dsigma[bs] = grads.dsigma * call.ratio
            if dbias is not None:
                db = _unflip(_unflip(grads.dbias, rev, n, 2, True), rev, m, 3, True)
                rows = bs if dbias.shape[0] > 1 else slice(None)
                keys = slice(0, m) if dbias.shape[3] > 1 else slice(None)
                dbias[rows, :, :, keys] += db
    if index is None:
        lo = (h0 // spec.group) - kv_first
        dk_full[:, lo:lo + dk.shape[1]] = dk
        dv_full[:, lo:lo + dv.shape[1]] = dv
    else:
        for h, kv in enumerate(index):  # the group's query heads, in order
            dk_full[:, kv] += dk[:, h]
            dv_full[:, kv] += dv[:, h]
    return dq, dk_full, dv_full, dtau, dsigma, dbias


def dbeta_rows(dout, out, lse, dlse=None):
    """`~elastic_np._contract._grads.sink_terms` per head of whole rows, ``delta_i = dout_i . out_i - dlse_i``."""
    delta = np.einsum("bhnd,bhnd->bhn", dout.astype(np.float64), out.astype(np.float64))
    if dlse is not None:
        delta -= dlse
    return _grads.sink_terms(delta, lse, (0, 2))
