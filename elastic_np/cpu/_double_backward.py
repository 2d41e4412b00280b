"""The double backward (second-order VJP): the backward's tangent along the cotangent of its outputs.

The formulas are those of `elastic_np.reference._double_backward` (the
derivations page, "Second derivatives"), in two tiled passes that hold
nothing ``N x M``, after a preparation like the backward's
(`_tangent_prepare`: the scaled queries and tangent queries, ``dout^T``,
``delta``):

1. the query pass (`elastic_np.cpu._tangent_rows`), one task per (batch,
   head, query tile): ``outdot`` (``ddout``), ``lsedot`` (``ddlse``) and
   ``deltadot = dout . outdot``;
2. the key pass (`elastic_np.cpu._tangent_keys`), one task per (batch, kv
   head, key tile) as the backward's, in chunks of key tiles: the tangents
   of ``dk``, ``dv``, ``dbias`` and each key tile's share of ``dq``'s,
   added in key-tile order afterwards (`_sum_dq_shares`), and per-task
   float64 sums of ``dtau``'s and ``dsigma``'s; ``dbeta``'s tangent comes
   from the rows' ``deltadot`` and ``lsedot`` (`sink_gradient`).

Every task writes memory of its own and every sum runs in a fixed order:
the same bits for every thread count. bfloat16 and float16 inputs go
through the float32 kernels (`_from_halves`).
"""

import dataclasses

import numpy as np
from numba import njit

from elastic_np._compact import compact_bias
from elastic_np.cpu import _config as config
from elastic_np.cpu._backward import _BACKWARD_TILES, _sum_dq_shares, ensure_dbias
from elastic_np.cpu._dbias import _DbiasPlan
from elastic_np.cpu._logits import _query_factor
from elastic_np.cpu._operands import BHND, head, new, operand, shape
from elastic_np.cpu._plan import _check_cache, _kernel_array, _options
from elastic_np.cpu._simd import compile_for
from elastic_np.cpu._tangent_keys import _tangent_keys_kernel
from elastic_np.cpu._tangent_rows import _tangent_rows_kernel
from elastic_np.cpu._tangents import Tangents
from elastic_np.cpu._threads import _run_tasks, _task_range
from elastic_np.reference._double_backward import _d2log_gate


def double_backward(problem, dout, out, lse, dlse, direction):
    """The second-order VJP for a validated problem: ``(ddout, ddlse, AttentionGrads)``.

    Parameters
    ----------
    problem : elastic_np._problem.AttentionProblem
    dout, out : ndarray, shape (B, H, N, Dv)
    lse : ndarray, shape (B, H, N)
        In the problem's dtype, as `forward` returned them.
    dlse : ndarray, shape (B, H, N) or None
        Cotangent of ``lse`` given to the backward; None for zeros.
    direction : elastic_np.reference._double_backward._Direction
        The cotangents of the backward's outputs, float64.

    Returns
    -------
    ddout : ndarray, shape (B, H, N, Dv)
        The tangent of ``out``, in the dtype and layout of ``out``.
    ddlse : ndarray, shape (B, H, N)
        The tangent of ``lse``, in ``lse``'s dtype.
    grads : AttentionGrads
        As the backward returns them: ``dq``, ``dk``, ``dv``, ``dbias`` in the
        inputs' dtype and layouts, the parameters' in float64.
    """
    if problem.dtype != problem.compute_dtype:
        return _from_halves(problem, dout, out, lse, dlse, direction)
    _check_cache(problem)
    dtype = problem.dtype
    compile_for(dtype, _BACKWARD_TILES)
    B, H, Hkv, N, M, D, Dv = problem.shape
    q, k, v, dout, out = (operand(a) for a in (problem.q, problem.k, problem.v, dout, out))
    lse = _kernel_array(lse)
    opt = _options(problem, with_sigma_grad=True, dtype=dtype)
    if problem.bias is not None:
        ensure_dbias(dtype)
    q_rows, q_t, dout_t, delta, tan = _prepare(problem, opt, q, dout, out, direction)
    if dlse is not None:
        np.subtract(delta, dlse, out=delta)

    outdot, outdot_operand = new((B, H, N, Dv), dtype, out[1])
    lsedot, deltadot = np.empty((B, H, N)), np.empty((B, H, N))
    _run_tasks(_tangent_rows_kernel, (k, v, q_t, dout, lse), tan, opt, config.BLOCK_Q, config.BLOCK_K,
               (outdot_operand, lsedot, deltadot))

    ins = (k, v, q_rows, q_t, dout, dout_t, (lse, delta, lsedot, deltadot))
    dq, dk, dv, dtau, dsigma, dbias = _key_pass(problem, opt, ins, tan, q[1])
    grads = problem.reduce_grads(
        dq, dk, dv, dtau,
        problem.sink_gradient(deltadot - delta * lsedot, lse),  # dbeta = -sum delta exp(-lse), differentiated
        dsigma, dbias=dbias,
    )
    return outdot, lsedot.astype(problem.compute_dtype), grads


def _key_pass(problem, opt, ins, tan, q_layout):
    """The key pass in chunks of key tiles, as the backward's: ``(dq, dk, dv, dtau, dsigma, dbias)`` tangents.

    ``dtau`` and ``dsigma`` per ``(b, h)`` (None without a dynamic window),
    ``dbias`` compact (`_DbiasPlan.result`).
    """
    B, H, Hkv, N, M, D, Dv = problem.shape
    dtype = problem.dtype
    k, v = ins[0], ins[1]
    block_k = config.BLOCK_K * config.BACKWARD_K_FACTOR
    n_kt = -(-M // block_k)
    share_bytes = max(B * H * N * D * np.dtype(dtype).itemsize, 1)
    chunk = int(min(max(config.DQ_SHARES_BYTES // share_bytes, 1), max(n_kt, 1)))
    dq_shares = np.empty((chunk, B, H, N, D), dtype=dtype)
    share_rows = np.zeros((chunk, B, H, 2), dtype=np.int64)
    dq_sum = np.zeros((B, H, N, D), dtype=dtype)
    dk, dk_operand = new((B, Hkv, M, D), dtype, k[1])
    dv, dv_operand = new((B, Hkv, M, Dv), dtype, v[1])
    dtau_part, dsigma_part = np.zeros((B, H, n_kt)), np.zeros((B, H, n_kt))
    plan = _DbiasPlan(problem, dtype, n_kt, chunk)
    outs = (dk_operand, dv_operand, dq_shares, share_rows, dtau_part, dsigma_part)
    dbias = (plan.params, plan.strides, plan.direct, plan.partials)
    for kt0 in range(0, n_kt, chunk):
        kt1 = min(kt0 + chunk, n_kt)
        _run_tasks(_tangent_keys_kernel, ins, tan, outs, dbias, opt, config.BLOCK_Q, block_k, kt0, kt1)
        _run_tasks(_sum_dq_shares, dq_shares, share_rows, kt1 - kt0, config.BLOCK_Q, dq_sum)
        plan.after_chunk()
    # dqdot = (scale / tau_h) sum_j (Adot k_j + A kdot_j), in float64 then rounded, in q's layout
    dq = dq_sum if q_layout == BHND else new((B, H, N, D), dtype, q_layout)[0]
    np.multiply(dq_sum, (problem.scale / problem.tau)[None, :, None, None], out=dq, casting="unsafe")
    dsigma = dsigma_part.sum(axis=2) if problem.sigma is not None else None
    return dq, dk, dv, dtau_part.sum(axis=2), dsigma, plan.result()


def _prepare(problem, opt, q, dout, out, direction):
    """``(q_rows, q_t, dout_t, delta, tangents)``: the backward's prepared arrays and the `Tangents`.

    ``q_rows`` the queries times ``scale / tau_h``, ``q_t`` their ``Q^T``
    tiles as the logits take them (`_query_factor`), ``dout_t`` the ``dout^T``
    tiles, ``delta = dout . out`` (float64).
    """
    B, H, Hkv, N, M, D, Dv = problem.shape
    dtype = problem.dtype
    n_qt = -(-N // config.BLOCK_Q)
    d = direction
    qdot, kdot, vdot = (operand(a.astype(dtype, copy=False)) for a in (d.q, d.k, d.v))
    q_rows, qdot_rows = np.empty((B, H, N, D), dtype), np.empty((B, H, N, D), dtype)
    tiles = (B, H, n_qt, D, config.BLOCK_Q)
    q_t, qdot_t = np.zeros(tiles, dtype), np.zeros(tiles, dtype)
    q_tan_t = np.zeros(tiles, dtype) if problem.nvm else q_t  # NVM scales the logits after the product
    dout_t = np.zeros((B, H, n_qt, Dv, config.BLOCK_Q), dtype=dtype)
    delta = np.empty((B, H, N))
    outs = (q_rows, q_t, q_tan_t, qdot_rows, qdot_t, dout_t, delta)
    _run_tasks(_tangent_prepare, q, qdot, dout, out, opt, config.BLOCK_Q, outs)
    dlog, d2log = _gate_tangents(problem, opt, d.sigma)
    if problem.bias is None:
        bias, bias_strides = opt.bias, opt.bias_strides  # a dummy, never read
    else:
        bias, bias_strides = compact_bias(d.bias, dtype, check=False)
    tan = Tangents(
        q_rows=qdot_rows, q_t=qdot_t, q_tan_t=q_tan_t, k=kdot, v=vdot,
        tau_ratio=np.ascontiguousarray(d.tau / problem.tau), beta=np.ascontiguousarray(d.beta, dtype=np.float64),
        dlog_gate=dlog, d2log_gate=d2log, has_bias=problem.bias is not None, bias=bias, bias_strides=bias_strides,
    )
    return q_rows, q_t, dout_t, delta, tan


def _gate_tangents(problem, opt, sigmadot):
    """``sigmadot d log G / d sigma`` and ``sigmadot d^2 log G / d sigma^2`` by offset, float64 ``(B, H, N + M - 1)``.

    The first from the plan's table; the second by the oracle's
    `_d2log_gate`, on the oracle's gate at the offsets ``j - i - diag_shift
    = t - (M - 1)`` (0 where the gate is closed). ``1 x 1 x 1`` zeros without a
    dynamic window.
    """
    if problem.sigma is None:
        return np.zeros((1, 1, 1)), np.zeros((1, 1, 1))
    B, H, Hkv, N, M, D, Dv = problem.shape
    sigma = problem.sigma[:, :, None, None]
    off = np.arange(max(N + M - 1, 1)) - (M - 1)
    ends = problem.kv_ends[:, None, None, None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        x = np.where(ends > 1, 2.0 * off / (ends - 1), 0.0)  # `window_position` at these offsets
        u = x / sigma
        f = np.exp(-0.5 * (u * u)) / (sigma * np.sqrt(2 * np.pi))
        G = np.tanh(problem.sharpness * np.where(f > problem.threshold, f, 0.0))
        d2log = np.where(G > 0, _d2log_gate(problem, G, f, x), 0.0)[:, :, 0]
    scale = np.broadcast_to(sigmadot, (B, H))[:, :, None]
    return np.ascontiguousarray(opt.dlog_gate * scale), np.ascontiguousarray(d2log * scale)


def _from_halves(problem, dout, out, lse, dlse, direction):
    """`double_backward` of bfloat16 or float16 inputs: the float32 kernels on their values, the results rounded.

    As `elastic_np.cpu._backward._from_halves`: ``ddout``, ``dq``, ``dk``,
    ``dv`` and ``dbias`` rounded to the inputs' dtype (to nearest even),
    ``ddlse`` and the parameters' gradients as computed.
    """
    def widened(a):
        return a.astype(np.float32, order="K")  # keeps a (B, N, H, D) storage

    single = dataclasses.replace(problem, q=widened(problem.q), k=widened(problem.k), v=widened(problem.v))
    outdot, lsedot, grads = double_backward(single, widened(dout), widened(out), lse, dlse, direction)
    half = {name: getattr(grads, name).astype(problem.dtype, order="K") for name in ("dq", "dk", "dv")}
    if grads.dbias is not None:
        half["dbias"] = grads.dbias.astype(problem.dtype)
    return outdot.astype(problem.dtype, order="K"), lsedot, dataclasses.replace(grads, **half)


@njit(nogil=True, cache=True, fastmath=False)
def _tangent_prepare(q, qdot, dout, out, opt, block_q, outs, part, parts):
    """``outs = (q_rows, q_t, q_tan_t, qdot_rows, qdot_t, dout_t, delta)`` per (batch, head).

    Rows times ``scale / tau_h`` and ``Q^T`` tiles of the queries (``q_t``
    with `_query_factor`, ``q_tan_t`` with ``scale / tau_h``, written only
    under NVM: else it is ``q_t``) and of the tangent queries, the ``dout^T``
    tiles, ``delta = dout . out`` in float64. ``q``, ``qdot``, ``dout``,
    ``out``: operands (`elastic_np.cpu._operands`).
    """
    q_rows, q_t, q_tan_t, qdot_rows, qdot_t, dout_t, delta = outs
    B, H, N, D = shape(q)
    Dv = shape(dout)[3]
    for bh in _task_range(B * H, part, parts):
        b, h = bh // H, bh % H
        factor = opt.scale / opt.tau[h]
        logit_factor = _query_factor(opt, h)
        (q_h, q_col), (qd_h, qd_col) = head(q, b, h), head(qdot, b, h)
        (dout_h, dout_col), (out_h, out_col) = head(dout, b, h), head(out, b, h)
        for i in range(N):
            it, r = i // block_q, i % block_q
            acc = 0.0
            for d in range(Dv):
                acc += np.float64(dout_h[i, dout_col + d]) * np.float64(out_h[i, out_col + d])
                dout_t[b, h, it, d, r] = dout_h[i, dout_col + d]
            delta[b, h, i] = acc
            for d in range(D):
                x, xd = q_h[i, q_col + d], qd_h[i, qd_col + d]
                q_rows[b, h, i, d] = x * factor
                q_t[b, h, it, d, r] = x * logit_factor
                if opt.nvm:
                    q_tan_t[b, h, it, d, r] = x * factor
                qdot_rows[b, h, i, d] = xd * factor
                qdot_t[b, h, it, d, r] = xd * factor
