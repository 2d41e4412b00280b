"""The prefill backward: recomputation from ``lse`` (FlashAttention-2).

`backward` prepares the scaled queries, ``dout^T`` and ``delta``
(`_backward_prepare`), runs one task per (batch, kv head, key tile) in
chunks of key tiles (`_backward_kernel`), then adds the key tiles' shares of
``dq`` in key-tile order (`sum_dq_shares`). Where ``dbias`` goes is
`elastic_np.cpu._prefill.dbias`'s. bfloat16 and float16 inputs go through the
float32 kernels (`_from_halves`).
"""

import dataclasses

import numpy as np
from numba import njit

from elastic_np.cpu._prefill.capture_grads import CaptureGradients
from elastic_np.cpu._prefill.dbias import dbias_tile, DbiasPlan, ensure_dbias
from elastic_np.cpu._prefill.key_tiles import (
    copy_rows, gated_probabilities, group_spans, key_task, key_tasks, pair_head, probabilities, row_stats,
    NO_FACTOR, softcap_slope, sum_dq_shares,
)
from elastic_np.cpu._prefill.plan import check_cache, kernel_options
from elastic_np.cpu._prefill import values
from elastic_np.cpu._prefill.sink import sink_gradient
from elastic_np.cpu._runtime import config
from elastic_np.cpu._runtime.numba_private import direct_call, inner
from elastic_np.cpu._runtime.scratch import scratch
from elastic_np.cpu._runtime.threads import claim, run_tasks, task_counter, task_range
from elastic_np.cpu._tiles.calls import exp_inplace, matmul_nn, matmul_nn_max, matmul_tn
from elastic_np.cpu._tiles.logits import logits_tile, modify_tile, prefetch_bias
from elastic_np.cpu._tiles.operands import BHND, head, head_rows, kernel_array, new, operand, shape
from elastic_np.cpu._tiles.simd import compile_for
from elastic_np.cpu._tiles.transpose import transpose_store, transpose_width
from elastic_np.cpu._tiles.variant import (
    EMPTY, kernel_variant, narrow_spans, saved_score_stage, score_gradient, tile_state, uncached,
)


def backward(problem, dout, out, lse, dlse=None):
    """Gradients of the attention for ``q, k, v, tau, beta, sigma, bias``.

    Parameters
    ----------
    problem : elastic_np._contract._problem.AttentionProblem
    dout, out : ndarray, shape (B, H, N, Dv)
    lse : ndarray, shape (B, H, N)
        In the problem's dtype, as `forward` returned them.
    dlse : ndarray, shape (B, H, N), optional
        Cotangent of ``lse`` in the problem's dtype; None for zeros.

    Returns
    -------
    AttentionGrads
        ``dq``, ``dk``, ``dv`` in the dtype and the layouts of ``q``, ``k``, ``v``
        (`elastic_np.cpu._tiles.operands`).
    """
    if problem.dtype != problem.compute_dtype:
        return _from_halves(problem, dout, out, lse, dlse)
    return Backward(problem).run(problem, dout, out, lse, dlse)


def planned(problem):
    """`backward` of ``problem``'s shapes, dtype and options as ``run(problem, dout, out, lse, dlse)`` for problems of
    them: a `Backward` made once, and again only when the config changes (`config.GENERATION`); bfloat16 and
    float16 inputs: `backward` itself."""
    if problem.dtype != problem.compute_dtype:
        return backward
    made = {}

    def run(given, dout, out, lse, dlse):
        schedule = made.get(config.GENERATION)
        if schedule is None:
            made.clear()
            schedule = made[config.GENERATION] = Backward(problem)
        return schedule.run(given, dout, out, lse, dlse)

    return run


class Backward:
    """`backward` of one problem's shapes, dtype and options, what it derives from them made once.

    ``run(problem, dout, out, lse, dlse)`` takes a problem of those shapes,
    dtype and options (its arrays may change from run to run: a plan's,
    `elastic_np._api.plans.BackwardPlan`). A `Backward` run again and
    again calls its kernels through their entry points from its second run
    on (`direct_call`), and keeps the bias's and the captures' plans where
    they hold nothing of a run (no bias, no ``score_mod``).
    """

    def __init__(self, problem):
        compile_for(problem.dtype, BACKWARD_TILES)
        values.compile_for(problem.dtype)  # the checks of a plan's runs (`elastic_np._api.plans.BackwardPlan`)
        B, H, Hkv, N, M, D, Dv = self.shape = problem.shape
        dtype = self.dtype = problem.dtype
        self.opt = kernel_options(problem, with_sigma_grad=True, dtype=dtype)
        if problem.bias is not None:
            ensure_dbias(dtype)
        # the kernel forms the logits tiles without log G and adds it with the probabilities
        # (`gated_probabilities`): the tile keeps the score s / tau that dtau needs
        self.logits_opt = self.opt._replace(has_gate=False)
        # One pass over key tiles gives dk, dv and each key tile's share of dq;
        # the shares are summed in key-tile order afterwards (no racing writes).
        # Key tiles go in chunks so that the shares take at most DQ_SHARES_BYTES.
        self.block_k = block_k = config.BLOCK_K * config.BACKWARD_K_FACTOR
        self.n_kt = n_kt = -(-M // block_k)
        share_bytes = max(B * H * N * D * np.dtype(dtype).itemsize, 1)
        self.chunk = int(min(max(config.DQ_SHARES_BYTES // share_bytes, 1), max(n_kt, 1)))
        # the logits tiles without a score_mod, which the kernel applies itself (`saved_score_stage`)
        self.variants = (kernel_variant(problem, dtype), kernel_variant(problem, dtype, with_score=False))
        self.factor = np.ascontiguousarray(problem.scale / problem.tau, dtype=np.float64)  # (H,)
        self.kept = problem.bias is None and (problem.variant is None or problem.variant.score_mod is None)
        self.plans = self._plans(problem) if self.kept else None
        kernel = _backward_kernel if self.variants[0] is None else _VARIANT_KERNEL
        self.calls = [_backward_prepare, kernel, sum_dq_shares]  # each its entry point from the second run on
        self.runs = 0

    def _plans(self, problem):
        """The bias's and the captures' plans of a run: `DbiasPlan`, `CaptureGradients`."""
        plan = DbiasPlan(problem, self.dtype, self.n_kt, self.chunk)
        return plan, CaptureGradients(problem, plan.params, self.chunk, self.dtype)

    def run(self, problem, dout, out, lse, dlse):
        """`backward` of ``problem`` (of this one's shapes, dtype and options)."""
        check_cache(problem)
        B, H, Hkv, N, M, D, Dv = self.shape
        dtype, opt, block_k, n_kt, chunk, calls = self.dtype, self.opt, self.block_k, self.n_kt, self.chunk, self.calls
        q, k, v, dout, out = (operand(a) for a in (problem.q, problem.k, problem.v, dout, out))
        lse = kernel_array(lse)
        q_scaled, q_scaled_t, dout_t, delta = prepared(problem, opt, q, dout, out, dlse, calls[0])
        dq_shares = np.empty((chunk, B, H, N, D), dtype=dtype)
        share_rows = np.zeros((chunk, B, H, 2), dtype=np.int64)
        dq_sum = np.zeros((B, H, N, D), dtype=dtype)  # sum_j ds_ij k_j, (B, H, N, D) in every layout
        dk, dk_operand = new((B, Hkv, M, D), dtype, k[1])
        dv, dv_operand = new((B, Hkv, M, Dv), dtype, v[1])
        dtau_part = np.zeros((B, H, n_kt))
        dsigma_part = np.zeros((B, H, n_kt))
        plan, captures = self.plans if self.kept else self._plans(problem)
        ins = (k, v, q_scaled, q_scaled_t, dout, dout_t, lse, delta)
        outs = (dk_operand, dv_operand, dq_shares, share_rows, dtau_part, dsigma_part)
        dbias = (plan.params, plan.strides, plan.direct, plan.partials)
        options = (opt, self.logits_opt, captures.gradient, self.variants)
        # dq = (scale / tau_h) * sum_j ds_ij k_j, in float64 then rounded, as a kernel would, in q's layout
        # (`sum_dq_shares` of the last chunk; no keys, no chunk: zeros)
        dq, dq_operand = new((B, H, N, D), dtype, q[1], np.zeros, storage=dq_sum if q[1] == BHND else None)
        scaled = (self.factor, dq_operand)
        for kt0 in range(0, n_kt, chunk):
            kt1 = min(kt0 + chunk, n_kt)
            work = B * H * N * (min(M, kt1 * block_k) - kt0 * block_k) * (3 * D + 2 * Dv)  # the chunk's
            tasks = task_counter()
            run_tasks(calls[1], ins, outs, dbias, options, config.BLOCK_Q, block_k, kt0, kt1, tasks=tasks, work=work)
            last = scaled if kt1 == n_kt else (NO_FACTOR, scaled[1])
            sums = (dq_shares, share_rows, kt1 - kt0, config.BLOCK_Q, dq_sum, last)
            run_tasks(calls[2], *sums, work=work)
            plan.after_chunk()
            captures.after_chunk(kt1 - kt0)
        if self.runs < 2 and n_kt > 0:
            self._go_direct((ins, outs, dbias, options, config.BLOCK_Q, block_k, 0, 1, tasks, 0, 1),
                            (*sums, 0, 1), (q, dout, out, opt, config.BLOCK_Q, (q_scaled, q_scaled_t, dout_t, delta),
                                            0, 1))
        return problem.reduce_grads(
            dq, dk, dv,
            dtau_part.sum(axis=2),
            sink_gradient(problem, delta, lse),
            dsigma_part.sum(axis=2) if problem.sigma is not None else None,
            dbias=plan.result(),
            dcaptures=captures.result(),
        )

    def _go_direct(self, kernel_args, sum_args, prepare_args):
        """The kernels through their entry points (`direct_call`) from the second run on, looked up once."""
        self.runs += 1
        if self.runs == 2:
            self.calls[:] = (direct_call(self.calls[0], prepare_args), direct_call(self.calls[1], kernel_args),
                             direct_call(self.calls[2], sum_args))


def prepared(problem, opt, q, dout, out, dlse, prepare=None):
    """``(q_scaled, q_scaled_t, dout_t, delta)``, what the backward's key tiles read (`_backward_prepare`).

    Per-head scaled queries ``q * scale / tau_h``, row-major and as ``Q^T``
    tiles, ``dout^T`` tiles, and ``delta_i = dout_i . out_i - dlse_i`` in
    float64 (``dlse`` None: zeros). ``q``, ``dout``, ``out``: operands;
    ``prepare``: `_backward_prepare` or its entry point (None: the former).
    """
    B, H, Hkv, N, M, D, Dv = problem.shape
    dtype = problem.dtype
    n_qt = -(-N // config.BLOCK_Q)
    q_scaled = scratch("q_scaled", (B, H, N, D), dtype)
    q_scaled_t = scratch("q_scaled_t", (B, H, n_qt, D, config.BLOCK_Q), dtype, np.zeros)  # zero padding
    dout_t = scratch("dout_t", (B, H, n_qt, Dv, config.BLOCK_Q), dtype, np.zeros)
    delta = scratch("delta", (B, H, N), np.float64)
    # the work of the backward it prepares decides the threads (`run_tasks`)
    run_tasks(prepare or _backward_prepare, q, dout, out, opt, config.BLOCK_Q, (q_scaled, q_scaled_t, dout_t, delta),
              work=B * H * N * M * (3 * D + 2 * Dv))
    if dlse is not None:
        np.subtract(delta, dlse, out=delta)
    return q_scaled, q_scaled_t, dout_t, delta


def single(problem):
    """The problem of bfloat16 or float16 inputs with ``q``, ``k``, ``v`` widened to float32, exactly."""
    return dataclasses.replace(problem, q=widened(problem.q), k=widened(problem.k), v=widened(problem.v))


def widened(a):
    """A half array as float32 (exact), in its layout: a ``(B, N, H, D)`` storage stays one."""
    return a.astype(np.float32, order="K")


def halved(grads, dtype):
    """``grads`` with ``dq``, ``dk``, ``dv`` and ``dbias`` rounded to the half ``dtype`` (to nearest even)."""
    half = {name: getattr(grads, name).astype(dtype, order="K") for name in ("dq", "dk", "dv")}
    if grads.dbias is not None:
        half["dbias"] = grads.dbias.astype(dtype)
    return dataclasses.replace(grads, **half)


def _from_halves(problem, dout, out, lse, dlse):
    """`backward` of bfloat16 or float16 inputs: the float32 backward of their values, the gradients rounded.

    The inputs of a backward are ``O(N D)`` beside its ``O(N M D)`` work (and
    it keeps ``O(N D)`` float32 buffers of its own anyway), so they are
    converted to float32 once, exactly, in their layouts; the bias is
    converted by the kernel plan, its distinct entries only. ``dq``, ``dk``,
    ``dv`` and ``dbias`` are rounded to the inputs' dtype (to nearest even).
    """
    return halved(backward(single(problem), widened(dout), widened(out), lse, dlse), problem.dtype)


@njit(nogil=True, cache=True, fastmath=False)
def _backward_prepare(q, dout, out, opt, block_q, outs, part, parts):
    """``outs = (q_scaled, q_scaled_t, dout_t, delta)``: scaled queries (rows and Q^T tiles), dout^T tiles, delta.

    ``q``, ``dout``, ``out``: operands (`elastic_np.cpu._tiles.operands`).
    The ``Q^T`` tiles are the scaled rows transposed (the logits' factor is
    the rows' own, `elastic_np.cpu._tiles.logits.query_factor`, but under NVM, where it is 1: ``q``'s).
    """
    q_scaled, q_scaled_t, dout_t, delta = outs
    B, H, N, D = shape(q)
    Dv = shape(dout)[3]
    for bh in task_range(B * H, part, parts):
        b = bh // H
        h = bh % H
        factor = opt.scale / opt.tau[h]
        (q_h, q_col), (dout_h, dout_col), (out_h, out_col) = head(q, b, h), head(dout, b, h), head(out, b, h)
        _row_dots(dout_h, dout_col, out_h, out_col, Dv, delta[b, h])
        rows = q_scaled[b, h]
        for i in range(N):
            src, dst = q_h[i, q_col : q_col + D], rows[i]
            for d in range(D):
                dst[d] = src[d] * factor
        logits_rows, logits_col = (q_h, q_col) if opt.nvm else (rows, 0)
        for i0 in range(0, N, block_q):
            it, bq = i0 // block_q, min(block_q, N - i0)
            transposed(dout_h, dout_col, i0, bq, Dv, dout_t[b, h, it])
            transposed(logits_rows, logits_col, i0, bq, D, q_scaled_t[b, h, it])


@inner(fastmath=False)
def _row_dots(a, a_col, c, c_col, n, dots):
    """``dots[i] = sum_d a[i, a_col + d] c[i, c_col + d]`` over ``d < n`` in order, in float64: four rows at a time
    (four sums in flight), each row's sum in the order of ``d``."""
    rows = dots.shape[0]
    i = 0
    while i + 4 <= rows:
        s0 = s1 = s2 = s3 = 0.0
        a0, a1, a2, a3 = a[i, a_col : a_col + n], a[i + 1, a_col : a_col + n], a[i + 2, a_col : a_col + n], \
            a[i + 3, a_col : a_col + n]
        c0, c1, c2, c3 = c[i, c_col : c_col + n], c[i + 1, c_col : c_col + n], c[i + 2, c_col : c_col + n], \
            c[i + 3, c_col : c_col + n]
        for d in range(n):
            s0 += np.float64(a0[d]) * np.float64(c0[d])
            s1 += np.float64(a1[d]) * np.float64(c1[d])
            s2 += np.float64(a2[d]) * np.float64(c2[d])
            s3 += np.float64(a3[d]) * np.float64(c3[d])
        dots[i], dots[i + 1], dots[i + 2], dots[i + 3] = s0, s1, s2, s3
        i += 4
    for i in range(i, rows):
        total = 0.0
        for d in range(n):
            total += np.float64(a[i, a_col + d]) * np.float64(c[i, c_col + d])
        dots[i] = total


@inner(fastmath=False)
def transposed(x, col, i0, bq, n, dst):
    """``dst[d, r] = x[i0 + r, col + d]`` for ``d < n``, ``r < bq``: ``W x W`` blocks through SIMD registers
    (`transpose_store`), the edges entry by entry. ``x`` and ``dst``: 2-D C-contiguous arrays of one dtype."""
    width = transpose_width(dst)
    stride = dst.shape[1]
    flat = dst.reshape(-1)
    one = dst.dtype.type(1.0)
    n_w, bq_w = n - n % width, bq - bq % width
    for d0 in range(0, n_w, width):
        for r0 in range(0, bq_w, width):
            transpose_store(x, flat, d0 * stride + r0, stride, i0 + r0, col + d0, one)
    for d in range(n):
        row = dst[d]
        for r in range(bq_w if d < n_w else 0, bq):
            row[r] = x[i0 + r, col + d]


@inner(fastmath=False)
def _dz_tile(pt, dpt, st, delta_t, delta_r, sums, dlog_gate, base, bk):
    """``dz = p (dP - delta)`` in place of ``dP``, and the query rows' ``dtau`` and ``dsigma`` sums.

    ``dz`` in the working dtype feeds the products; the sums (``sums[0]``,
    ``sums[1]``) take it in float64 against the float64 ``delta_r``, on the
    entries with ``p != 0``: ``dz s`` for ``dtau`` (``st``: ``s / tau``, also
    under the gate, `gated_probabilities`), ``dz dlog G / dsigma`` for
    ``dsigma``, the gate's table read at index ``base + c - r`` for key ``j0
    + c``, query ``i0 + r`` (an empty table: no gate).
    """
    bq = delta_r.shape[0]
    dtau, dsigma = sums[0], sums[1]
    gated = dlog_gate.shape[0] > 0
    for c in range(bk):
        if gated:
            at = base + c
            for r in range(bq):
                p = pt[c, r]
                dp = dpt[c, r]
                dpt[c, r] = p * (dp - delta_t[r])
                if p != 0:
                    dz = np.float64(p) * (np.float64(dp) - delta_r[r])
                    dtau[r] += dz * np.float64(st[c, r])
                    dsigma[r] += dz * dlog_gate[at - r]
        else:
            for r in range(bq):
                p = pt[c, r]
                dp = dpt[c, r]
                dpt[c, r] = p * (dp - delta_t[r])
                s = np.float64(st[c, r]) if p != 0 else 0.0
                dtau[r] += np.float64(p) * (np.float64(dp) - delta_r[r]) * s


@inner(fastmath=False)
def _head_tile(ins, dq_shares, dbias, options, scratch, at, sums, kv_j):
    """Head ``h``'s query tile ``it`` against the task's key tile: its shares of dk, dv and dq, its sums.

    ``at = (t, slot, task, b, h, it, i0, bq, j0, bk)``: the key tile's index
    in the chunk, its dbias slot, the claimed task, and the tile; ``sums``:
    the head's ``dtau`` and ``dsigma`` sums by query; ``kv_j``: the key
    tile's keys and values (`head_rows`); the rest as `_backward_kernel` has them.
    """
    k, v, q_scaled, q_scaled_t, dout, dout_t, lse, delta = ins
    opt, logits_opt, gradient, (variant, logits_variant) = options
    st, pt, dpt, cap_slope, lse_t, delta_t, dk_acc, dv_acc, pre, no_max, no_gate = scratch
    t, slot, task, b, h, it, i0, bq, j0, bk = at
    (k_rows, k_col), (v_rows, v_col) = kv_j
    M, D, Dv = shape(k)[2], shape(k)[3], shape(v)[3]
    share = dq_shares[t, b, h, i0 : i0 + bq]
    tile = (b, h, i0, bq, j0)
    kept = tile_state(variant, b, h, i0, bq, j0, bk) != EMPTY
    if kept:  # NVM tests s, which the logits tile holds: it joins the pass that forms z - lse
        kept, _ = logits_tile(st, kv_j[0], q_scaled_t[b, h, it], logits_opt, tile, False, cap_slope, no_max, opt.nvm,
                              logits_variant)
    if not kept:
        share[:, :] = 0.0
        return
    saved_score_stage(st, pre, bk, bq, variant, tile, opt.tau[h])
    # the steps of docs/derivations.rst: p, dv, dP, dz (with the dtau and dsigma
    # sums), a user's score_mod's input, dbias = ds, the soft-cap's slope, dk, dq
    row_stats(lse, delta, b, h, i0, bq, lse_t, delta_t)
    base = j0 - opt.diag_shift[b] - i0 + M - 1  # the gate's index of (j0, i0)
    if opt.has_gate:
        gated_probabilities(st, pt, lse_t, bk, bq, opt.nvm, opt.log_gate[b, h], base)
    else:
        probabilities(st, pt, lse_t, bk, bq, opt.nvm)
    dout_rows, dout_col = head_rows(dout, b, h, i0, bq)
    matmul_nn(pt, 0, dout_rows, dout_col, dv_acc, bk, Dv, bq, True)
    matmul_nn(v_rows, v_col, dout_t[b, h, it], 0, dpt, bk, bq, Dv, False)
    _dz_tile(pt, dpt, st, delta_t, delta[b, h, i0 : i0 + bq], sums,
             opt.dlog_gate[b, h] if opt.has_gate else no_gate, base, bk)
    score_gradient(dpt, pre, bk, bq, gradient, tile, opt.tau[h], task)
    if dbias[0][0] > 0:
        dbias_tile(dpt, dbias, (bk, bq, b, h, i0, j0), slot, 1.0 / opt.tau[h])
    if opt.has_softcap:
        softcap_slope(dpt, cap_slope, bk, bq)
    # dk_j = scale/tau_h sum_i dz_ij q_i = sum_i dz_ij q_scaled_i
    matmul_nn(dpt, 0, q_scaled[b, h, i0 : i0 + bq], 0, dk_acc, bk, D, bq, True)
    # this key tile's share of dq_i = scale/tau_h sum_j dz_ij k_j
    matmul_tn(dpt, 0, k_rows, k_col, share, bq, D, bk, False)


#: What the backward kernel calls of `elastic_np.cpu._tiles.calls` (see `elastic_np.cpu._tiles.simd.compile_for`).
BACKWARD_TILES = (matmul_nn, matmul_nn_max, matmul_tn, exp_inplace, modify_tile, dbias_tile)


@inner(fastmath=False)
def _backward_scratch(k, block_q, block_k, Dv, group, has_softcap):
    """The per-thread tiles of `_backward_kernel`, reused by its tasks (``k``: the keys' operand).

    ``(st, pt, dpt, cap_slope, lse_t, delta_t, dk_acc, dv_acc, head_sums,
    spans)``: the logits ``z``, ``p``, ``dP`` then ``dz`` (key-major tiles),
    the soft-cap's slope (empty without one), the query tile's ``lse`` and
    ``delta``, the ``dk`` and ``dv`` accumulators, and per head of the group
    its ``dtau`` and ``dsigma`` sums by query and its query tiles ``[it_lo, it_hi)``.
    """
    dtype = k[0].dtype
    D = shape(k)[3]
    tile = (block_k, block_q)
    return (
        np.empty(tile, dtype=dtype), np.empty(tile, dtype=dtype), np.empty(tile, dtype=dtype),
        np.empty(tile if has_softcap else (0, 0), dtype=dtype),
        np.empty(block_q, dtype=dtype), np.empty(block_q, dtype=dtype),
        np.empty((block_k, D), dtype=dtype), np.empty((block_k, Dv), dtype=dtype),
        np.empty((group, 2, block_q)), np.empty((group, 2), dtype=np.int64),
    )


@njit(nogil=True, cache=True, fastmath=False)
def _backward_kernel(ins, outs, dbias, options, block_q, block_k, kt0, kt1, tasks, part, parts):
    """Key tiles ``kt0 .. kt1 - 1``: dk, dv, the tile's share of dq, dtau, dsigma and dbias sums.

    ``ins = (k, v, q_scaled, q_scaled_t, dout, dout_t, lse, delta)`` (see
    `backward`), ``outs = (dk, dv, dq_shares, share_rows, dtau_part,
    dsigma_part)``, ``options = (opt, logits_opt, gradient, (variant,
    logits_variant))``: the plan's options, those the logits tiles are
    formed with, the gate left out (it joins with the probabilities,
    `gated_probabilities`), a user's ``score_mod``'s
    `CaptureGradients.gradient` (None without one; with one the kernel
    applies it to the tiles itself, the scores before it kept for its
    gradient), and the user's functions with and without the ``score_mod``
    (`kernel_variant`, or None); ``k``, ``v``, ``dout``, ``dk``, ``dv`` are operands
    (`elastic_np.cpu._tiles.operands`), ``dbias`` the `DbiasPlan`'s ``(params, strides, direct,
    partials)``. ``dq_shares[t, b, h]`` receives, for rows ``share_rows[t, b,
    h]`` (whole query tiles), ``sum_j dz_ij k_j`` over the keys of tile ``kt0
    + t``. A task covers one key tile of one (batch, kv head) pair, or of the
    pairs of a dbias lane (`DbiasPlan`), one after the other; the threads
    claim them from ``tasks`` (`elastic_np.cpu._runtime.threads.claim`). Every task
    writes outputs of its own: its rows of ``dk``, ``dv`` and the dq share,
    its entries of ``dtau_part`` and ``dsigma_part``, and its dbias slot (a
    lane's one slot when the keys are not reduced: then each key tile writes
    columns of its own).
    """
    k, v, q_scaled = ins[0], ins[1], ins[2]
    dk, dv, dq_shares, share_rows, dtau_part, dsigma_part = outs
    opt, gradient = options[0], options[2]
    B, Hkv, M, D = shape(k)
    H, N, Dv = q_scaled.shape[1], q_scaled.shape[2], shape(v)[3]
    group = H // Hkv
    n_chunk = kt1 - kt0
    n_tasks, pairs = key_tasks(dbias[0], B, Hkv, n_chunk)
    st, pt, dpt, cap_slope, lse_t, delta_t, dk_acc, dv_acc, head_sums, spans = _backward_scratch(
        k, block_q, block_k, Dv, group, opt.has_softcap
    )
    pre = np.empty((block_k, block_q) if gradient is not None else (0, 0), dtype=st.dtype)
    no_max, no_gate = np.empty(0, dtype=lse_t.dtype), np.empty(0)  # the backward takes no tile maxima
    scratch = (st, pt, dpt, cap_slope, lse_t, delta_t, dk_acc, dv_acc, pre, no_max, no_gate)
    for _ in range(n_tasks):
        task = claim(tasks)
        if task >= n_tasks:
            break
        t, slot, outer, first, last = key_task(task, n_chunk, dbias[0], pairs)
        kt = kt0 + t
        j0 = kt * block_k
        bk_all = min(block_k, M - j0)
        for pair in range(first, last):
            b, hk = pair_head(dbias[0], pair, outer, Hkv)
            bk = max(min(bk_all, opt.kv_lengths[b] - j0), 0)  # keys past kv_lengths get 0
            k_j, v_j = head_rows(k, b, hk, j0, bk), head_rows(v, b, hk, j0, bk)
            dk_acc[:bk_all] = 0.0
            dv_acc[:bk_all] = 0.0
            head_sums[:] = 0.0
            it_first, it_last = narrow_spans(
                options[3][0], b, hk, j0, bk, block_q, N, spans, share_rows[t],
                group_spans(opt, b, hk, j0, bk, block_q, spans, share_rows[t]),
            )
            # query tiles outer, heads inner: a bias tile is read by every head while in cache
            for it in range(it_first, it_last):
                i0 = it * block_q
                bq = min(block_q, N - i0)
                for g in range(group):
                    h = hk * group + g
                    if it < spans[g, 0] or it >= spans[g, 1]:
                        continue
                    if opt.has_bias and it + 1 < spans[g, 1]:
                        prefetch_bias(opt, b, h, i0 + block_q, block_q, j0, bk_all)
                    _head_tile(ins, dq_shares, dbias, options, scratch, (t, slot, task, b, h, it, i0, bq, j0, bk),
                               head_sums[g], (k_j, v_j))
            for g in range(group):
                h = hk * group + g
                # dtau_h = -(1/tau^2) sum dz s = -(1/tau) sum dz (s / tau)
                dtau_part[b, h, kt] = -head_sums[g, 0].sum() / opt.tau[h]
                dsigma_part[b, h, kt] = head_sums[g, 1].sum()
            copy_rows(dk_acc, head_rows(dk, b, hk, j0, bk_all))
            copy_rows(dv_acc, head_rows(dv, b, hk, j0, bk_all))


#: `_backward_kernel` for the calls with a user's variant, compiled per function, never saved to Numba's cache.
_VARIANT_KERNEL = uncached(_backward_kernel)
