"""The double backward (second-order VJP): the backward's tangent along the cotangent of its outputs.

The formulas are those of `elastic_np.reference._double_backward` (the
derivations page, "Second derivatives"), in two tiled passes that hold
nothing ``N x M``, after the backward's preparation (`prepared`: the
scaled queries, ``dout^T``, ``delta``) and the tangent queries'
(`_tangent_queries`):

1. the query pass (`elastic_np.cpu._double_backward.tangent_rows`), one task per (batch,
   head, query tile): ``outdot`` (``ddout``), ``lsedot`` (``ddlse``) and
   ``deltadot = dout . outdot``;
2. the key pass (`elastic_np.cpu._double_backward.tangent_keys`), one task per (batch, kv
   head, key tile) as the backward's, in chunks of key tiles: the tangents
   of ``dk``, ``dv``, ``dbias`` and each key tile's share of ``dq``'s,
   added in key-tile order afterwards (`sum_dq_shares`), and per-task
   float64 sums of ``dtau``'s and ``dsigma``'s; ``dbeta``'s tangent comes
   from the rows' ``deltadot`` and ``lsedot`` (`sink_gradient`).

Every task writes memory of its own and every sum runs in a fixed order:
the same bits for every thread count. bfloat16 and float16 inputs go
through the float32 kernels (`_from_halves`).
"""


import numpy as np
from numba import njit

from elastic_np._contract._compact import compact_bias
from elastic_np.cpu._double_backward.tangent_keys import _tangent_keys_kernel
from elastic_np.cpu._double_backward.tangent_rows import _tangent_rows_kernel
from elastic_np.cpu._double_backward.tangents import Tangents
from elastic_np.cpu._prefill.backward import BACKWARD_TILES, halved, prepared, single, widened
from elastic_np.cpu._prefill.dbias import DbiasPlan, ensure_dbias
from elastic_np.cpu._prefill.key_tiles import NO_FACTOR, sum_dq_shares
from elastic_np.cpu._prefill.plan import check_cache, kernel_options
from elastic_np.cpu._prefill.sink import sink_gradient
from elastic_np.cpu._runtime import config
from elastic_np.cpu._runtime.threads import run_tasks, task_counter, task_range
from elastic_np.cpu._tiles.operands import BHND, head, kernel_array, new, operand, shape
from elastic_np.cpu._tiles.simd import compile_for
from elastic_np.reference._double_backward import d2log_gate


def double_backward(problem, dout, out, lse, dlse, direction):
    """The second-order VJP for a validated problem: ``(ddout, ddlse, AttentionGrads)``.

    Parameters
    ----------
    problem : elastic_np._contract._problem.AttentionProblem
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
    check_cache(problem)
    dtype = problem.dtype
    compile_for(dtype, BACKWARD_TILES)
    B, H, Hkv, N, M, D, Dv = problem.shape
    q, k, v, dout, out = (operand(a) for a in (problem.q, problem.k, problem.v, dout, out))
    lse = kernel_array(lse)
    opt = kernel_options(problem, with_sigma_grad=True, dtype=dtype)
    if problem.bias is not None:
        ensure_dbias(dtype)
    q_rows, q_t, dout_t, delta = prepared(problem, opt, q, dout, out, dlse)
    tan = _tangents(problem, opt, q, q_t, direction)
    # as the backward: logits tiles without log G, added with the probabilities
    # (`elastic_np.cpu._double_backward.tangents.tile_probabilities`), so the tiles keep s / tau
    options = (opt, opt._replace(has_gate=False))

    outdot, outdot_operand = new((B, H, N, Dv), dtype, out[1])
    lsedot, deltadot = np.empty((B, H, N)), np.empty((B, H, N))
    run_tasks(_tangent_rows_kernel, (k, v, q_t, dout, lse), tan, options, config.BLOCK_Q, config.BLOCK_K,
               (outdot_operand, lsedot, deltadot), tasks=task_counter(), work=B * H * N * M * (3 * D + 2 * Dv))

    ins = (k, v, q_rows, q_t, dout, dout_t, (lse, delta, lsedot, deltadot))
    dq, dk, dv, dtau, dsigma, dbias = _key_pass(problem, options, ins, tan, q[1])
    grads = problem.reduce_grads(
        dq, dk, dv, dtau,
        sink_gradient(problem, deltadot - delta * lsedot, lse),  # dbeta = -sum delta exp(-lse), differentiated
        dsigma, dbias=dbias,
    )
    return outdot, lsedot.astype(problem.compute_dtype), grads


def _key_pass(problem, options, ins, tan, q_layout):
    """The key pass in chunks of key tiles, as the backward's: ``(dq, dk, dv, dtau, dsigma, dbias)`` tangents.

    ``options = (opt, logits_opt)`` as `_tangent_keys_kernel` takes them;
    ``dtau`` and ``dsigma`` per ``(b, h)`` (None without a dynamic window),
    ``dbias`` compact (`DbiasPlan.result`).
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
    # dqdot = (scale / tau_h) sum_j (Adot k_j + A kdot_j), in float64 then rounded, in q's layout
    # (`sum_dq_shares` of the last chunk; no keys, no chunk: zeros)
    dq, dq_operand = new((B, H, N, D), dtype, q_layout, np.zeros, storage=dq_sum if q_layout == BHND else None)
    factor = np.ascontiguousarray(problem.scale / problem.tau, dtype=np.float64)
    scaled = (factor, dq_operand)
    dk, dk_operand = new((B, Hkv, M, D), dtype, k[1])
    dv, dv_operand = new((B, Hkv, M, Dv), dtype, v[1])
    dtau_part, dsigma_part = np.zeros((B, H, n_kt)), np.zeros((B, H, n_kt))
    plan = DbiasPlan(problem, dtype, n_kt, chunk)
    outs = (dk_operand, dv_operand, dq_shares, share_rows, dtau_part, dsigma_part)
    dbias = (plan.params, plan.strides, plan.direct, plan.partials)
    for kt0 in range(0, n_kt, chunk):
        kt1 = min(kt0 + chunk, n_kt)
        work = B * H * N * (min(M, kt1 * block_k) - kt0 * block_k) * (5 * D + 4 * Dv)  # the chunk's
        run_tasks(_tangent_keys_kernel, ins, tan, outs, dbias, options, config.BLOCK_Q, block_k, kt0, kt1,
                  tasks=task_counter(), work=work)
        last = scaled if kt1 == n_kt else (NO_FACTOR, scaled[1])
        run_tasks(sum_dq_shares, dq_shares, share_rows, kt1 - kt0, config.BLOCK_Q, dq_sum, last, work=work)
        plan.after_chunk()
    dsigma = dsigma_part.sum(axis=2) if problem.sigma is not None else None
    return dq, dk, dv, dtau_part.sum(axis=2), dsigma, plan.result()


def _tangents(problem, opt, q, q_t, direction):
    """The `Tangents` of ``direction``: the tangent queries' rows and ``Q^T`` tiles, ``kdot``, ``vdot``, the rest.

    ``q_t`` are the logits' ``Q^T`` tiles (`prepared`), which the tangent
    logits share unless NVM scales the logits after the product.
    """
    B, H, Hkv, N, M, D, Dv = problem.shape
    dtype = problem.dtype
    n_qt = -(-N // config.BLOCK_Q)
    d = direction
    qdot, kdot, vdot = (operand(a.astype(dtype, copy=False)) for a in (d.q, d.k, d.v))
    qdot_rows = np.empty((B, H, N, D), dtype)
    tiles = (B, H, n_qt, D, config.BLOCK_Q)
    qdot_t = np.zeros(tiles, dtype)
    q_tan_t = np.zeros(tiles, dtype) if problem.nvm else q_t
    run_tasks(_tangent_queries, q, qdot, opt, config.BLOCK_Q, (q_tan_t, qdot_rows, qdot_t),
              work=B * H * N * M * (5 * D + 4 * Dv))  # the double backward's, which decides the threads
    dlog, d2log = _gate_tangents(problem, opt, d.sigma)
    if problem.bias is None:
        bias, bias_strides = opt.bias, opt.bias_strides  # a dummy, never read
    else:
        bias, bias_strides = compact_bias(d.bias, dtype, check=False)
    return Tangents(
        q_rows=qdot_rows, q_t=qdot_t, q_tan_t=q_tan_t, k=kdot, v=vdot,
        tau_ratio=np.ascontiguousarray(d.tau / problem.tau), beta=np.ascontiguousarray(d.beta, dtype=np.float64),
        dlog_gate=dlog, d2log_gate=d2log, has_bias=problem.bias is not None, bias=bias, bias_strides=bias_strides,
    )


def _gate_tangents(problem, opt, sigmadot):
    """``sigmadot d log G / d sigma`` and ``sigmadot d^2 log G / d sigma^2`` by offset, float64 ``(B, H, N + M - 1)``.

    The first from the plan's table; the second by the oracle's
    `d2log_gate`, on the oracle's gate at the offsets ``j - i - diag_shift
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
        d2log = np.where(G > 0, d2log_gate(problem, G, f, x), 0.0)[:, :, 0]
    scale = np.broadcast_to(sigmadot, (B, H))[:, :, None]
    return np.ascontiguousarray(opt.dlog_gate * scale), np.ascontiguousarray(d2log * scale)


def _from_halves(problem, dout, out, lse, dlse, direction):
    """`double_backward` of bfloat16 or float16 inputs: the float32 kernels on their values, the results rounded.

    As `elastic_np.cpu._prefill.backward._from_halves`: ``ddout``, ``dq``, ``dk``,
    ``dv`` and ``dbias`` rounded to the inputs' dtype (to nearest even),
    ``ddlse`` and the parameters' gradients as computed.
    """
    outdot, lsedot, grads = double_backward(single(problem), widened(dout), widened(out), lse, dlse, direction)
    return outdot.astype(problem.dtype, order="K"), lsedot, halved(grads, problem.dtype)


@njit(nogil=True, cache=True, fastmath=False)
def _tangent_queries(q, qdot, opt, block_q, outs, part, parts):
    """``outs = (q_tan_t, qdot_rows, qdot_t)`` per (batch, head).

    ``q_tan_t`` the queries' ``Q^T`` tiles times ``scale / tau_h``, written
    only under NVM (else it is the logits' own, `prepared`'s); the tangent
    queries times ``scale / tau_h`` as rows and as ``Q^T`` tiles. ``q``,
    ``qdot``: operands (`elastic_np.cpu._tiles.operands`).
    """
    q_tan_t, qdot_rows, qdot_t = outs
    B, H, N, D = shape(q)
    for bh in task_range(B * H, part, parts):
        b, h = bh // H, bh % H
        factor = opt.scale / opt.tau[h]
        (q_h, q_col), (qd_h, qd_col) = head(q, b, h), head(qdot, b, h)
        for i in range(N):
            it, r = i // block_q, i % block_q
            for d in range(D):
                xd = qd_h[i, qd_col + d]
                if opt.nvm:
                    q_tan_t[b, h, it, d, r] = q_h[i, q_col + d] * factor
                qdot_rows[b, h, i, d] = xd * factor
                qdot_t[b, h, it, d, r] = xd * factor
