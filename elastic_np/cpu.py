"""Numba CPU kernels: tiled online-softmax attention, forward and backward.

The contract is the one of `elastic_np.reference.attention` (see the
project's contract, section 2): every option (causal, ``window_size``,
``kv_lengths``, boolean ``mask``, NVM, per-head ``tau`` and ``beta``, the
dynamic window) in float32 or float64, output in the input dtype.

Layout of the work
------------------
Every tile holds scores *transposed*: ``st[c, r]`` is the score of key
``j0 + c`` against query ``i0 + r``. The query tile's scaled ``Q^T`` is built
once per task, so both products of the forward read plain row slices of ``k``
and ``v`` (``S^T = K_j Q^T``, ``O += (P^T)^T V_j``) and key tiles may start
anywhere: each query tile visits exactly the key range ``[j_lo, j_hi)`` that
causal, ``window_size``, ``kv_lengths`` and the dynamic-window band leave.
Per-query running statistics (``row_max``, ``row_sum``) are vectors along the
contiguous axis of the tile.

- forward: ``prange`` over (batch, head, query tile), the online-softmax
  recurrence with the ``beta`` term folded in at the end.
- backward: recomputation from ``lse`` (FlashAttention-2), one ``prange``
  over (batch, kv head, key tile): each task owns its ``dk``, ``dv`` rows
  (the query heads of a group summed inside the task) and writes its key
  tile's share of ``dq`` into a buffer of its own, together with per-task
  partial sums of ``dtau`` and ``dsigma``; the shares are then added in
  key-tile order (in chunks of key tiles when they would take more than
  `DQ_SHARES_BYTES`). No two tasks write the same memory and every sum runs
  in a fixed order, so results are the same bits on every run and for every
  thread count.

The number of threads follows `numba.set_num_threads`.
"""

import collections
import math

import numpy as np
from numba import njit, prange

from elastic_np._tiles import exp_inplace, exp_shift_sum, matmul_nn, matmul_nn_max, matmul_tn

__all__ = ["dtypes", "is_available", "check_available", "forward", "backward"]

dtypes = (np.dtype(np.float32), np.dtype(np.float64))

#: Queries per tile (the vector axis of every tile) and keys per tile.
BLOCK_Q = 128
BLOCK_K = 128
#: The backward's key tiles are this many times BLOCK_K long: every key tile
#: reads all the query-side tiles (q, dout, both layouts) once, so longer key
#: tiles halve that traffic and the dq shares.
BACKWARD_K_FACTOR = 2
#: Memory for the backward's per-key-tile shares of dq (chunks of key tiles beyond it).
DQ_SHARES_BYTES = 1 << 25

# Reassociation lets LLVM vectorise the row sums; no flag that assumes
# finite values, since -inf marks every removed entry.
_FASTMATH = {"nsz", "arcp", "contract", "reassoc"}

# Everything the njit code needs to know about the options, as runtime values:
# one compiled specialisation per dtype whatever the options are.
_Options = collections.namedtuple(
    "_Options",
    [
        "scale",  # float
        "causal",  # bool
        "left",  # int, -1 unbounded
        "right",  # int, -1 unbounded
        "nvm",  # bool
        "has_mask",  # bool
        "has_gate",  # bool
        "tau",  # float64 (H,)
        "beta",  # float64 (H,)
        "kv_lengths",  # int64 (B,)
        "mask",  # bool, 1-D: the mask's distinct entries, C order
        "mask_strides",  # int64 (4,): element strides of (b, h, i, j) into `mask`, 0 when broadcast
        "log_gate",  # float64 (B, H, N + M - 1): log G by offset j - i - (M - N), + M - 1
        "dlog_gate",  # float64, same shape: d log G / d sigma (0 where G = 0)
        "band",  # int64 (B, H, 2): offsets [lo, hi] where the gate is open
    ],
)


def is_available():
    """True: the CPU kernels need only NumPy and Numba."""
    return True


def check_available():
    """Raise nothing: the CPU backend is always usable once imported."""
    return None


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------


def forward(problem):
    """Attention forward for a validated problem: ``(out, lse)`` in the input dtype.

    Parameters
    ----------
    problem : elastic_np._options.AttentionProblem

    Returns
    -------
    out : ndarray, shape (B, H, N, Dv)
    lse : ndarray, shape (B, H, N)
    """
    B, H, Hkv, N, M, D, Dv = problem.shape
    q, k, v = (_kernel_array(a) for a in (problem.q, problem.k, problem.v))
    out = np.empty((B, H, N, Dv), dtype=q.dtype)
    lse = np.empty((B, H, N), dtype=q.dtype)
    opt = _options(problem, with_sigma_grad=False)
    _forward_kernel(q, k, v, opt, BLOCK_Q, BLOCK_K, out, lse)
    return out, lse


def backward(problem, dout, out, lse):
    """Gradients of the attention for ``q, k, v, tau, beta, sigma``.

    Parameters
    ----------
    problem : elastic_np._options.AttentionProblem
    dout, out : ndarray, shape (B, H, N, Dv)
    lse : ndarray, shape (B, H, N)
        In the problem's dtype, as `forward` returned them.

    Returns
    -------
    AttentionGrads
    """
    B, H, Hkv, N, M, D, Dv = problem.shape
    dtype = problem.dtype
    q, k, v, dout, out, lse = (
        _kernel_array(a) for a in (problem.q, problem.k, problem.v, dout, out, lse)
    )
    opt = _options(problem, with_sigma_grad=True)
    n_qt = -(-N // BLOCK_Q)

    # Per-head scaled queries q * scale / tau_h, row-major and as Q^T tiles,
    # dout^T tiles, and delta_i = dout_i . out_i.
    q_scaled = np.empty((B, H, N, D), dtype=dtype)
    q_scaled_t = np.zeros((B, H, n_qt, D, BLOCK_Q), dtype=dtype)
    dout_t = np.zeros((B, H, n_qt, Dv, BLOCK_Q), dtype=dtype)
    delta = np.empty((B, H, N), dtype=np.float64)
    dbeta_bh = np.empty((B, H))
    _backward_prepare(
        q, dout, out, lse, opt, BLOCK_Q, q_scaled, q_scaled_t, dout_t, delta, dbeta_bh
    )

    # One pass over key tiles gives dk, dv and each key tile's share of dq;
    # the shares are summed in key-tile order afterwards (no racing writes).
    # Key tiles go in chunks so that the shares take at most DQ_SHARES_BYTES.
    block_k = BLOCK_K * BACKWARD_K_FACTOR
    n_kt = -(-M // block_k)
    share_bytes = max(B * H * N * D * q.itemsize, 1)
    chunk = int(min(max(DQ_SHARES_BYTES // share_bytes, 1), max(n_kt, 1)))
    dq_shares = np.empty((chunk, B, H, N, D), dtype=dtype)
    share_rows = np.zeros((chunk, B, H, 2), dtype=np.int64)
    dq = np.zeros_like(q)
    dk = np.empty_like(k)
    dv = np.empty_like(v)
    dtau_part = np.zeros((B, H, n_kt))
    dsigma_part = np.zeros((B, H, n_kt))
    for kt0 in range(0, n_kt, chunk):
        kt1 = min(kt0 + chunk, n_kt)
        _backward_kernel(
            k, v, q_scaled, q_scaled_t, dout, dout_t, lse, delta, opt, BLOCK_Q, block_k,
            kt0, kt1, dk, dv, dq_shares, share_rows, dtau_part, dsigma_part,
        )
        _sum_dq_shares(dq_shares, share_rows, kt1 - kt0, BLOCK_Q, dq)
    # dq = (scale / tau_h) * sum_j ds_ij k_j, in float64 then rounded, as a kernel would
    factor = (problem.scale / problem.tau)[None, :, None, None]
    np.multiply(dq, factor, out=dq, casting="unsafe")
    return problem.reduce_grads(
        dq, dk, dv,
        dtau_part.sum(axis=2),
        dbeta_bh,
        dsigma_part.sum(axis=2) if problem.sigma is not None else None,
    )


def _kernel_array(a):
    """``a`` itself when C-contiguous and writable, else a copy that is.

    The kernels never write to their inputs, but a read-only or strided array
    is another Numba type, and every new type compiles every kernel again.
    """
    if a.flags.c_contiguous and a.flags.writeable:
        return a
    return np.array(a, order="C", copy=True)


def _options(p, with_sigma_grad):
    B, H, Hkv, N, M, D, Dv = p.shape
    if p.mask is None:
        mask = np.ones(1, dtype=np.bool_)
        mask_strides = np.zeros(4, dtype=np.int64)
    else:
        mask, mask_strides = _compact_mask(p.mask)
    if p.sigma is None:
        log_gate = dlog_gate = np.zeros((1, 1, 1))
        band = np.zeros((1, 1, 2), dtype=np.int64)
    else:
        width = max(N + M - 1, 1)
        log_gate = np.empty((B, H, width))
        dlog_gate = np.empty((B, H, width) if with_sigma_grad else (1, 1, 1))
        band = np.empty((B, H, 2), dtype=np.int64)
        _window_tables(
            p.sigma, float(p.sharpness), float(p.threshold), N, M,
            with_sigma_grad, log_gate, dlog_gate, band,
        )
    return _Options(
        scale=float(p.scale),
        causal=bool(p.causal),
        left=int(p.window[0]),
        right=int(p.window[1]),
        nvm=bool(p.nvm),
        has_mask=p.mask is not None,
        has_gate=p.sigma is not None,
        tau=np.ascontiguousarray(p.tau, dtype=np.float64),
        beta=np.ascontiguousarray(p.beta, dtype=np.float64),
        kv_lengths=np.ascontiguousarray(p.kv_lengths, dtype=np.int64),
        mask=mask,
        mask_strides=mask_strides,
        log_gate=log_gate,
        dlog_gate=dlog_gate,
        band=band,
    )


def _compact_mask(mask):
    """The distinct entries of a broadcast boolean view, flat, with element strides.

    ``mask[b, h, i, j] == flat[b*s0 + h*s1 + i*s2 + j*s3]``; broadcast axes
    have stride 0, so a ``(N, M)`` mask stays ``N * M`` booleans.
    """
    index = tuple(slice(0, 1) if s == 0 else slice(None) for s in mask.strides)
    compact = _kernel_array(mask[index])
    strides = [
        0 if s == 0 or n == 1 else cs // compact.itemsize
        for s, n, cs in zip(mask.strides, compact.shape, compact.strides)
    ]
    return compact.reshape(-1), np.array(strides, dtype=np.int64)


# ---------------------------------------------------------------------------
# Shared njit helpers
# ---------------------------------------------------------------------------


@njit(cache=True)
def _window_tables(sigma, sharpness, threshold, N, M, with_grad, log_gate, dlog_gate, band):
    """Tabulate the dynamic-window gate by offset ``off = j - i - (M - N)``.

    Fills ``log_gate[b, h, off + M - 1] = log G`` (``-inf`` where the gate is
    closed) and, with ``with_grad``, ``dlog_gate`` with ``d log G / d sigma``
    (0 where closed); ``band[b, h] = [lo, hi]``, the offsets between the first
    and the last open entry (``lo > hi`` when none is open).

    The band is first bounded analytically, ``f > threshold`` only where
    ``x^2 < 2 sigma^2 log(1 / (threshold sigma sqrt(2 pi)))`` (where ``f``
    does not underflow to 0 for ``threshold = 0``), widened by a margin; the
    table is evaluated only there, and the band is then trimmed to the entries
    that are exactly open.
    """
    B, H = sigma.shape
    width = log_gate.shape[2]
    root_2pi = math.sqrt(2 * math.pi)
    for b in range(B):
        for h in range(H):
            s = sigma[b, h]
            for t in range(width):
                log_gate[b, h, t] = -np.inf
                if with_grad:
                    dlog_gate[b, h, t] = 0.0
            # Analytic bound on |x| where f > threshold (or f > 0).
            if threshold > 0.0:
                c = threshold * s * root_2pi
                y_max = -math.log(c) if c < 1.0 else -1.0
            else:
                y_max = 746.0  # exp(-y) underflows to 0 beyond about 745.13
            if y_max < 0.0:
                band[b, h, 0] = 1
                band[b, h, 1] = 0
                continue
            if M > 1:
                x_max = s * math.sqrt(2.0 * y_max) * (1.0 + 1e-6) + 1e-12
                reach = min(x_max * (M - 1) / 2.0 + 2.0, float(N + M + 1))
                off_reach = int(reach)
            else:
                off_reach = N + M + 1
            lo_t = max(-off_reach + M - 1, 0)
            hi_t = min(off_reach + M - 1, width - 1)
            first = width
            last = -1
            for t in range(lo_t, hi_t + 1):
                off = t - (M - 1)
                x = 2.0 * off / (M - 1) if M > 1 else 0.0
                f = math.exp(-(x * x) / (2 * s * s)) / (s * root_2pi)
                g = math.tanh(sharpness * (f if f > threshold else 0.0))
                if g > 0.0:
                    log_gate[b, h, t] = math.log(g)
                    if with_grad:
                        dlog_gate[b, h, t] = (
                            sharpness * (1 - g * g) / g * f * (x * x / (s * s * s) - 1 / s)
                        )
                    first = min(first, t)
                    last = max(last, t)
            band[b, h, 0] = first - (M - 1)
            band[b, h, 1] = last - (M - 1)


@njit(cache=True)
def _zigzag(t, n):
    """Visit tiles 0, n-1, 1, n-2, ...: cheap and costly causal tiles alternate."""
    return t // 2 if t % 2 == 0 else n - 1 - t // 2


@njit(cache=True)
def _offset_range(opt, b, h, N, M):
    """Offsets ``off = j - i - (M - N)`` that causal, the window and the gate band allow: ``[lo, hi]``."""
    lo = -(M + 1)
    hi = N + 1
    if opt.causal:
        hi = min(hi, 0)
    if opt.left >= 0:
        lo = max(lo, -opt.left)
    if opt.right >= 0:
        hi = min(hi, opt.right)
    if opt.has_gate:
        lo = max(lo, opt.band[b, h, 0])
        hi = min(hi, opt.band[b, h, 1])
    return lo, hi


@njit(cache=True)
def _key_range(opt, b, i0, bq, N, M, off_lo, off_hi):
    """Keys ``[j_lo, j_hi)`` that queries ``i0 .. i0 + bq - 1`` may keep."""
    shift = M - N
    j_lo = max(i0 + shift + off_lo, 0)
    j_hi = min(i0 + bq + shift + off_hi, opt.kv_lengths[b])
    return j_lo, max(j_hi, j_lo)


@njit(cache=True)
def _query_range(j0, bk, N, M, off_lo, off_hi):
    """Queries ``[i_lo, i_hi)`` that keys ``j0 .. j0 + bk - 1`` may be kept by."""
    shift = M - N
    i_lo = max(j0 - shift - off_hi, 0)
    i_hi = min(j0 + bk - shift - off_lo, N)
    return i_lo, max(i_hi, i_lo)


@njit(cache=True)
def _logits_untouched(opt, i0, bq, j0, bk, N, M, off_lo, off_hi, nvm):
    """True when `_logits_tile` leaves the tile as it is (and returns True)."""
    shift = M - N
    # Whole tile inside [off_lo, off_hi]: the last key with the first query
    # and the first key with the last query are the extreme offsets.
    inside = (j0 + bk - 1 - i0 - shift <= off_hi) and (j0 - (i0 + bq - 1) - shift >= off_lo)
    return inside and not (nvm or opt.has_mask or opt.has_gate)


@njit(cache=True)
def _logits_tile(st, opt, b, h, i0, bq, j0, bk, N, M, off_lo, off_hi, nvm):
    """Turn ``st[c, r] = s_ij / tau_h`` (key ``j0 + c``, query ``i0 + r``) into logits.

    Removed entries become ``-inf``: outside the offset range, ``s < 0`` under
    NVM (when ``nvm``, which the forward leaves to its own first pass when it
    can), a closed gate or a false mask entry; the others get ``log G`` added.
    Returns False when the mask leaves nothing in the tile (so the caller
    may skip it); True otherwise.
    """
    if _logits_untouched(opt, i0, bq, j0, bk, N, M, off_lo, off_hi, nvm):
        return True
    shift = M - N
    neg_inf = -np.inf
    s_b, s_h, s_i, s_j = opt.mask_strides[0], opt.mask_strides[1], opt.mask_strides[2], opt.mask_strides[3]
    any_kept = False
    for c in range(bk):
        j = j0 + c
        row = st[c]
        # off = j - (i0 + r) - shift in [off_lo, off_hi]
        r_lo = min(max(j - shift - off_hi - i0, 0), bq)
        r_hi = max(min(j - shift - off_lo - i0 + 1, bq), r_lo)
        for r in range(r_lo):
            row[r] = neg_inf
        for r in range(r_hi, bq):
            row[r] = neg_inf
        if nvm:
            for r in range(r_lo, r_hi):
                x = row[r]
                row[r] = x if x >= 0 else neg_inf
        if opt.has_gate:
            base = j - shift - i0 + M - 1  # table index of (j, i0 + r) is base - r
            for r in range(r_lo, r_hi):
                row[r] += opt.log_gate[b, h, base - r]
        if opt.has_mask:
            start = b * s_b + h * s_h + j * s_j + i0 * s_i
            for r in range(r_lo, r_hi):
                if not opt.mask[start + r * s_i]:
                    row[r] = neg_inf
            if not any_kept:
                for r in range(r_lo, r_hi):
                    if row[r] > neg_inf:
                        any_kept = True
                        break
        elif r_hi > r_lo:
            any_kept = True
    return any_kept


@njit(cache=True)
def _log_add_exp(a, b):
    if b == -np.inf:
        return a
    if a == -np.inf:
        return b
    hi = max(a, b)
    return hi + math.log1p(math.exp(-abs(a - b)))


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _forward_kernel(q, k, v, opt, block_q, block_k, out, lse):
    B, H, N, D = q.shape
    Hkv, M, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = H // Hkv
    n_qt = (N + block_q - 1) // block_q
    for task in prange(B * H * n_qt):
        bh = task // n_qt
        b = bh // H
        h = bh % H
        hk = h // group
        i0 = _zigzag(task % n_qt, n_qt) * block_q
        bq = min(block_q, N - i0)

        factor = opt.scale / opt.tau[h]
        q_t = np.empty((D, block_q), dtype=q.dtype)  # scaled Q^T of the tile
        for r in range(bq):
            for d in range(D):
                q_t[d, r] = q[b, h, i0 + r, d] * factor
        st = np.empty((block_k, block_q), dtype=q.dtype)
        acc = np.zeros((block_q, Dv), dtype=q.dtype)
        row_max = np.full(block_q, -np.inf, dtype=q.dtype)
        tile_max = np.empty(block_q, dtype=q.dtype)
        shift_by = np.empty(block_q, dtype=q.dtype)
        rescale_by = np.empty(block_q, dtype=q.dtype)
        tile_sum = np.empty(block_q, dtype=q.dtype)
        row_sum = np.zeros(block_q)

        # NVM tests s before log G is added: with a gate it stays in the
        # logits pass, otherwise it joins the row-max and shift passes.
        nvm_in_logits = opt.nvm and opt.has_gate
        nvm_in_max = opt.nvm and not opt.has_gate
        neg_inf = -np.inf
        off_lo, off_hi = _offset_range(opt, b, h, N, M)
        j_lo, j_hi = _key_range(opt, b, i0, bq, N, M, off_lo, off_hi)
        for j0 in range(j_lo, j_hi, block_k):
            bk = min(block_k, j_hi - j0)
            for r in range(bq):
                tile_max[r] = -np.inf
            if _logits_untouched(opt, i0, bq, j0, bk, N, M, off_lo, off_hi, nvm_in_logits):
                # scores are the logits: their maxima come with the product
                matmul_nn_max(k[b, hk, j0 : j0 + bk], q_t, st, bk, bq, D, tile_max, nvm_in_max)
            else:
                matmul_nn(k[b, hk, j0 : j0 + bk], q_t, st, bk, bq, D, False)
                if not _logits_tile(
                    st, opt, b, h, i0, bq, j0, bk, N, M, off_lo, off_hi, nvm_in_logits
                ):
                    continue
                if nvm_in_max:
                    for c in range(bk):
                        row = st[c]
                        for r in range(bq):
                            x = row[r]
                            tile_max[r] = x if (x > tile_max[r] and x >= 0) else tile_max[r]
                else:
                    for c in range(bk):
                        row = st[c]
                        for r in range(bq):
                            x = row[r]
                            tile_max[r] = x if x > tile_max[r] else tile_max[r]
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
                    for d in range(Dv):
                        acc[r, d] *= alpha
            for r in range(bq):
                tile_sum[r] = 0.0
            exp_shift_sum(st, bk, bq, shift_by, nvm_in_max, tile_sum)
            for r in range(bq):
                row_sum[r] += tile_sum[r]
            matmul_tn(st, v[b, hk, j0 : j0 + bk], acc, bq, Dv, bk, True)

        # lse = m + log(l + beta exp(-m)) = logaddexp(m + log l, log beta)
        log_beta = math.log(opt.beta[h]) if opt.beta[h] > 0 else -np.inf
        for r in range(bq):
            i = i0 + r
            if row_sum[r] > 0.0:
                m = float(row_max[r])
                lse_r = _log_add_exp(m + math.log(row_sum[r]), log_beta)
                weight = math.exp(m - lse_r)
                for d in range(Dv):
                    out[b, h, i, d] = acc[r, d] * weight
                lse[b, h, i] = lse_r
            else:
                for d in range(Dv):
                    out[b, h, i, d] = 0.0
                lse[b, h, i] = log_beta


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _backward_prepare(
    q, dout, out, lse, opt, block_q, q_scaled, q_scaled_t, dout_t, delta, dbeta
):
    """Scaled queries (rows and Q^T tiles), dout^T tiles, delta and dbeta per (b, h)."""
    B, H, N, D = q.shape
    Dv = dout.shape[3]
    for bh in prange(B * H):
        b = bh // H
        h = bh % H
        factor = opt.scale / opt.tau[h]
        dbeta_bh = 0.0
        for i in range(N):
            it = i // block_q
            r = i - it * block_q
            acc = 0.0
            for d in range(Dv):
                acc += float(dout[b, h, i, d]) * float(out[b, h, i, d])
                dout_t[b, h, it, d, r] = dout[b, h, i, d]
            delta[b, h, i] = acc
            # dbeta = -sum_i delta_i exp(-lse_i); 0 for an empty row with beta = 0
            if acc != 0.0:
                dbeta_bh -= acc * math.exp(-float(lse[b, h, i]))
            for d in range(D):
                x = q[b, h, i, d] * factor
                q_scaled[b, h, i, d] = x
                q_scaled_t[b, h, it, d, r] = x
        dbeta[b, h] = dbeta_bh


@njit(cache=True)
def _row_stats(lse, delta, b, h, i0, bq, lse_t, delta_t):
    for r in range(bq):
        value = lse[b, h, i0 + r]
        # An empty row with beta = 0 has lse = -inf and only -inf logits:
        # shift by +inf so that exp(z - lse) = 0 rather than NaN.
        lse_t[r] = np.inf if value == -np.inf else value
        delta_t[r] = delta[b, h, i0 + r]


@njit(parallel=True, cache=True)
def _backward_kernel(
    k, v, q_scaled, q_scaled_t, dout, dout_t, lse, delta, opt, block_q, block_k,
    kt0, kt1, dk, dv, dq_shares, share_rows, dtau_part, dsigma_part,
):
    """Key tiles ``kt0 .. kt1 - 1``: dk, dv, the tile's share of dq, dtau and dsigma sums.

    ``dq_shares[t, b, h]`` receives, for rows ``share_rows[t, b, h]`` (a range
    of whole query tiles), ``sum_j dz_ij k_j`` over the keys of tile
    ``kt0 + t``; rows outside the range are not written.
    """
    B, Hkv, M, D = k.shape
    Dv = v.shape[3]
    H, N = q_scaled.shape[1], q_scaled.shape[2]
    group = H // Hkv
    shift = M - N
    n_chunk = kt1 - kt0
    for task in prange(B * Hkv * n_chunk):
        bhk = task // n_chunk
        b = bhk // Hkv
        hk = bhk % Hkv
        t = _zigzag(task % n_chunk, n_chunk)
        kt = kt0 + t
        j0 = kt * block_k
        bk_all = min(block_k, M - j0)
        bk = max(min(bk_all, opt.kv_lengths[b] - j0), 0)  # keys past kv_lengths get 0

        st = np.empty((block_k, block_q), dtype=k.dtype)  # logits z
        pt = np.empty((block_k, block_q), dtype=k.dtype)  # probabilities
        dpt = np.empty((block_k, block_q), dtype=k.dtype)  # dP, then dz
        lse_t = np.empty(block_q, dtype=k.dtype)
        delta_t = np.empty(block_q, dtype=k.dtype)
        dtau_acc = np.empty(block_q)
        dsigma_acc = np.empty(block_q)
        dk_acc = np.zeros((block_k, D), dtype=k.dtype)
        dv_acc = np.zeros((block_k, Dv), dtype=k.dtype)
        k_j = k[b, hk, j0 : j0 + bk]
        v_j = v[b, hk, j0 : j0 + bk]
        # NVM tests s before log G is added: with a gate it stays in the
        # logits pass, otherwise it joins the pass that forms z - lse (the
        # logits z themselves are read only where p != 0).
        nvm_in_logits = opt.nvm and opt.has_gate
        nvm_in_exp = opt.nvm and not opt.has_gate
        neg_inf = -np.inf
        for g in range(group):
            h = hk * group + g
            off_lo, off_hi = _offset_range(opt, b, h, N, M)
            i_lo, i_hi = _query_range(j0, bk, N, M, off_lo, off_hi)
            if bk == 0 or i_lo >= i_hi:
                share_rows[t, b, h, 0] = 0
                share_rows[t, b, h, 1] = 0
                continue
            it_lo = i_lo // block_q
            it_hi = (i_hi - 1) // block_q + 1
            share_rows[t, b, h, 0] = it_lo * block_q
            share_rows[t, b, h, 1] = min(it_hi * block_q, N)
            for r in range(block_q):
                dtau_acc[r] = 0.0
                dsigma_acc[r] = 0.0
            for it in range(it_lo, it_hi):
                i0 = it * block_q
                bq = min(block_q, N - i0)
                share = dq_shares[t, b, h, i0 : i0 + bq]
                matmul_nn(k_j, q_scaled_t[b, h, it], st, bk, bq, D, False)
                if not _logits_tile(
                    st, opt, b, h, i0, bq, j0, bk, N, M, off_lo, off_hi, nvm_in_logits
                ):
                    for r in range(bq):
                        for d in range(D):
                            share[r, d] = 0.0
                    continue
                _row_stats(lse, delta, b, h, i0, bq, lse_t, delta_t)
                delta_r = delta[b, h, i0 : i0 + bq]
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
                matmul_nn(pt, dout[b, h, i0 : i0 + bq], dv_acc, bk, Dv, bq, True)
                matmul_nn(v_j, dout_t[b, h, it], dpt, bk, bq, Dv, False)
                # dz in the working dtype feeds the products; the dtau and
                # dsigma sums take dz in float64 against the float64 delta.
                for c in range(bk):
                    if opt.has_gate:
                        base = j0 + c - shift - i0 + M - 1
                        for r in range(bq):
                            p = pt[c, r]
                            dp = dpt[c, r]
                            dpt[c, r] = p * (dp - delta_t[r])
                            if p != 0:
                                dz = float(p) * (float(dp) - delta_r[r])
                                dtau_acc[r] += dz * (
                                    float(st[c, r]) - opt.log_gate[b, h, base - r]
                                )
                                dsigma_acc[r] += dz * opt.dlog_gate[b, h, base - r]
                    else:
                        for r in range(bq):
                            p = pt[c, r]
                            dp = dpt[c, r]
                            dpt[c, r] = p * (dp - delta_t[r])
                            s = float(st[c, r]) if p != 0 else 0.0
                            dtau_acc[r] += float(p) * (float(dp) - delta_r[r]) * s
                # dk_j = scale/tau_h sum_i dz_ij q_i = sum_i dz_ij q_scaled_i
                matmul_nn(dpt, q_scaled[b, h, i0 : i0 + bq], dk_acc, bk, D, bq, True)
                # this key tile's share of dq_i = scale/tau_h sum_j dz_ij k_j
                matmul_tn(dpt, k_j, share, bq, D, bk, False)
            dtau = 0.0
            dsigma = 0.0
            for r in range(block_q):
                dtau += dtau_acc[r]
                dsigma += dsigma_acc[r]
            # dtau_h = -(1/tau^2) sum dz s = -(1/tau) sum dz (s / tau)
            dtau_part[b, h, kt] = -dtau / opt.tau[h]
            dsigma_part[b, h, kt] = dsigma
        for c in range(bk_all):
            for d in range(D):
                dk[b, hk, j0 + c, d] = dk_acc[c, d]
            for d in range(Dv):
                dv[b, hk, j0 + c, d] = dv_acc[c, d]


@njit(parallel=True, cache=True)
def _sum_dq_shares(dq_shares, share_rows, n_shares, block_q, dq):
    """``dq += sum_t dq_shares[t]`` over each share's rows, in the order of ``t``."""
    B, H, N, D = dq.shape
    n_qt = (N + block_q - 1) // block_q
    for task in prange(B * H * n_qt):
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
