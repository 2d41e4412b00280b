"""The SIMT backward: FlashAttention-2 partitioning with register micro-tiles, deterministic, without atomics.

The backward recomputes the probabilities ``p = exp(z - lse)`` from the
forward's ``lse`` with the shared score pipeline (`entry_keep`,
`entry_logit`), so it sees the logits the forward saw. Three kernels,
launched in this order (and a fourth for a broadcast bias's ``dbias``):

- ``_backward_delta_kernel``: ``delta = dout . out - dlse`` per query row (one
  thread a row; ``dlse``, the cotangent of ``lse``, zeros when none is
  given), read by the two kernels below and by the host (``dbeta``).
- ``_backward_dkdv_kernel``: a block per (batch x kv head, key tile of
  ``DKDV_BLOCK_K`` keys), key tiles fastest. Its K and V tiles stay in shared
  memory while it loops over the query heads of the GQA group and, for each,
  over the query tiles (``DKDV_BLOCK_Q`` queries) that can see the key tile
  (causal, window, ``kv_lengths``, the dynamic window's band). The threads
  form key groups of ``tpr = DKDV_BLOCK_Q / REG_N`` lanes; thread ``(g, c)``
  owns keys ``g REG_M + r`` and, of each query tile, queries ``c + tpr n``:
  ``s = k . q`` and ``dp = v . dout`` as ``REG_M x REG_N`` register
  micro-tiles, then ``p`` and ``ds`` per entry into shared memory, then
  ``dv += p dout`` and ``dk += ds q`` as ``REG_M x ACC_COLS`` register
  accumulators (output columns ``c + tpr e``; heads wider than ``tpr
  ACC_COLS`` take several passes). Each ``dk``/``dv`` entry has one owner
  thread that adds its terms in a fixed order (heads, then query tiles, then
  queries): no atomics, the same bits every run.
- ``_backward_dq_kernel``: a block per (batch x head, query tile of
  ``DQ_BLOCK_Q`` rows), laid out like the flash forward (row groups of
  ``tpr = DQ_BLOCK_K / REG_N`` lanes, ``REG_M`` rows a thread); per key tile
  it recomputes ``s`` and ``dp`` as micro-tiles and accumulates ``dq += ds k``
  in registers. A kernel of its own costs a second recomputation of the
  scores but keeps ``dq`` free of atomics too (float atomics would make
  ``dq`` depend on scheduling) and needs no ``(B, H, N, D)`` buffer per key
  tile.

``dtau``, ``dsigma``: the ``dq`` kernel keeps compensated sums per (row,
lane), adds them in a fixed order and writes one partial per (batch, head,
query tile); the host sums these few numbers in float64 in a fixed order.
``dbeta`` is formed on the host from ``delta`` and ``lse``. The soft-cap's
slope ``1 - tanh^2`` multiplies ``ds`` before it enters ``dq`` and ``dk``.
``dbias`` is ``ds`` summed over the bias's broadcast axes, without atomics:
a full ``(B, H, N, M)`` bias is written by the ``dq`` kernel, whose threads
own query rows (one writer per entry, under GQA too); a broadcast bias by
``_backward_dbias_kernel``, launched after the delta kernel, one block per
entry of the bias's compact shape, whose threads recompute ``ds`` for the
entries it stands for in a fixed assignment and add their sums in thread
order (a third recomputation of the scores, read from global memory; a bias
broadcast over every axis is summed by a single block).

Tile sizes are runtime values (`elastic_np.cuda._launch.plan.backward_tiles`,
from `elastic_np.cuda._runtime.config`, halved until the shared memory
fits); the micro-tile sizes are the forward's compile-time ``REG_M``,
``REG_N``, ``ACC_COLS``. Imports ``numba.cuda``; imported on first use by
its launch, `elastic_np.cuda._launch.backward`.
"""

import math

from numba import cuda

from elastic_np.cuda._device.basics import compensated_add, constants, inline_device, problem_dims
from elastic_np.cuda._device.indices import (
    C_INV_SIGMA, F_NEG_INF, F_ONE, F_SCALE, F_SHARPNESS, F_ZERO, I_BIAS_SB, I_BIAS_SH, I_BIAS_SI, I_BIAS_SJ,
    I_DBIAS_B, I_DBIAS_FULL, I_DBIAS_H, I_DBIAS_I, I_DBIAS_J, I_HAS_GATE, O_FOPTS, O_TAU, P_DSIGMA, P_DTAU,
)
from elastic_np.cuda._device.score import bh_params, block_key_range, block_query_range, entry, entry_keep, entry_logit
from elastic_np.cuda._device.tiles import carve, fill, stage
from elastic_np.cuda._runtime.config import ACC_COLS, REG_M, REG_N
from elastic_np.cuda._simt.micro_tiles import store_tile, tile_block, tile_dot, tile_entry, tile_pv

@cuda.jit(cache=True)
def _backward_delta_kernel(dout, out, dlse, opts, delta):
    """``delta[b, h, i] = dout[b, h, i] . out[b, h, i] - dlse[b, h, i]``, one thread a row."""
    B, H, N, Dv = out.shape
    row = cuda.grid(1)
    if row >= B * H * N:
        return
    b = row // (H * N)
    h = row // N % H
    i = row % N
    total = opts[O_FOPTS][F_ZERO]
    for d in range(Dv):
        total += dout[b, h, i, d] * out[b, h, i, d]
    delta[b, h, i] = total - dlse[b, h, i]


@cuda.jit(device=True)
def _dq_tile_grads(score_tiles, scalar_sums, dbias_out, micro, queries, keys, prm, opts, tau_h, first_pass):
    """``s_tile`` (dot products) becomes ``ds_raw = ds * cap_slope`` for the thread's entries.

    ``score_tiles = (s_tile, dp_tile, p_stride, stats, block_q)``: ``dp``
    comes from ``dp_tile``, ``lse`` and ``delta`` of row ``row`` from
    ``stats[row]``, ``stats[block_q + row]``. ``micro = (row0, c, tpr)``
    (`tile_block`), ``queries = (b, h, i_first, N)``, ``keys = (j0, jn)``.
    ``ds = p (dp - delta) / tau_h``, 0 where the entry is removed, past the
    tile or past ``N``. On the first pass over the keys it also writes a full
    bias's ``dbias`` (``dbias_out = (dbias_full, dbias)``) and adds to the
    (row, lane) compensated sums of ``dz s`` and ``dz dlogG/dsigma`` in
    ``scalar_sums = (sums, slots, has_gate, g_inv_sigma)`` (``sums``:
    sections of ``slots``: sum, carry, sum, carry). A loop, not unrolled: the
    pipeline is long.
    """
    s_tile, dp_tile, p_stride, stats, block_q = score_tiles
    sums, slots, has_gate, g_inv_sigma = scalar_sums
    dbias_full, dbias = dbias_out
    row0, c, tpr = micro
    b, h = queries[0], queries[1]
    fopts, zero, neg_inf = constants(opts)
    sharpness = fopts[F_SHARPNESS]
    for r in range(REG_M):
        row = row0 + r
        slot = row * tpr + c
        row_lse = stats[row]
        row_delta = stats[block_q + row]
        for n in range(REG_N):
            at, i, j, z, s, cap_slope, f, u = tile_entry(s_tile, p_stride, micro, queries, keys, r, n, prm, opts)
            ds_raw = zero
            if z != neg_inf:  # in the tile, kept, and not removed by NVM or a closed gate
                dz = math.exp(z - row_lse) * (dp_tile[at] - row_delta)
                ds = dz / tau_h  # d loss / d s, the final score: dbias[b, h, i, j]
                ds_raw = ds * cap_slope
                if first_pass:
                    if dbias_full:
                        dbias[b, h, i, j] = ds
                    total, carry = compensated_add(sums[slot], sums[slots + slot], dz * s)
                    sums[slot] = total
                    sums[slots + slot] = carry
                    if has_gate:
                        # d log G / d sigma = (d log G / d log y) (d log f / d sigma), y = sharpness f
                        sigma_term = (u * u - fopts[F_ONE]) * g_inv_sigma  # x^2 / sigma^3 - 1 / sigma
                        dlogg = _log_tanh_elasticity(sharpness * f, zero) * sigma_term
                        total, carry = compensated_add(sums[2 * slots + slot], sums[3 * slots + slot], dz * dlogg)
                        sums[2 * slots + slot] = total
                        sums[3 * slots + slot] = carry
            s_tile[at] = ds_raw


@cuda.jit(device=True)
def _log_tanh_elasticity(y, zero):
    """``d log tanh(y) / d log y = 2y / sinh(2y)`` for ``y > 0`` in ``y``'s dtype (``zero``: a 0 of it).

    ``(w / (1 - e^2)) e`` with ``w = 4y``, ``e = exp(-2y)``, ``1 - e^2`` from
    ``expm1``, as the oracle's `elastic_np.reference._attention.log_tanh_elasticity`:
    no cancellation as ``tanh(y)`` rounds to 1, no ``1 / y`` to overflow as
    ``y`` reaches the subnormals (exactly 1 there); 0 where ``e`` underflows.
    """
    e = math.exp(-(y + y))
    if not e > zero:
        return zero
    w = (y + y) + (y + y)
    return w / -math.expm1(-w) * e


@inline_device
def _dq_tiles(smem, block_q, block_k, D, Dv, slots):
    """The dq block's shared memory: ``(q_tile, do_tile, s_tile, dp_tile, stats, sums, k_tile, v_tile)``.

    Row strides ``D + 1`` (q, K), ``Dv + 1`` (dout, V) and ``block_k + 1``
    (``s``, ``dp``); ``stats`` holds the rows' ``lse`` then ``delta``,
    ``sums`` four sections of ``slots`` (`_dq_tile_grads`).
    """
    q_tile, at = carve(smem, 0, block_q * (D + 1))
    do_tile, at = carve(smem, at, block_q * (Dv + 1))
    s_tile, at = carve(smem, at, block_q * (block_k + 1))
    dp_tile, at = carve(smem, at, block_q * (block_k + 1))
    stats, at = carve(smem, at, 2 * block_q)
    sums, at = carve(smem, at, 4 * slots)
    k_tile, at = carve(smem, at, block_k * (D + 1))
    v_tile, at = carve(smem, at, block_k * (Dv + 1))
    return q_tile, do_tile, s_tile, dp_tile, stats, sums, k_tile, v_tile


@inline_device
def _load_row_stats(stats, block_q, lse_bh, delta_bh, i0, N, zero, t, threads):
    """``stats[:block_q]``, ``stats[block_q:]``: ``lse`` and ``delta`` of queries ``i0 + idx`` (0 past ``N``)."""
    for idx in range(t, block_q, threads):
        stats[idx] = zero
        stats[block_q + idx] = zero
        if i0 + idx < N:
            stats[idx] = lse_bh[i0 + idx]
            stats[block_q + idx] = delta_bh[i0 + idx]


@inline_device
def _zero_rows(dst, b, h, i0, i1, M, zero, t, threads):
    """``dst[b, h, i0:i1, :M] = 0``, thread ``t`` of ``threads`` taking every ``threads``-th entry (coalesced)."""
    for idx in range(t, (i1 - i0) * M, threads):
        dst[b, h, i0 + idx // M, idx % M] = zero


@inline_device
def _zero_acc(acc, zero):
    """``acc[:, :] = 0``: a ``REG_M x ACC_COLS`` register accumulator."""
    for r in range(REG_M):
        for e in range(ACC_COLS):
            acc[r, e] = zero


@inline_device
def _store_acc(dst, acc, first, n, c0, wn, micro, scale):
    """``dst[first + r, c0 + c + tpr e] = scale acc[r, e]`` for rows before ``n`` and columns before ``wn``."""
    row0, c, tpr = micro
    for r in range(REG_M):
        i = first + r
        for e in range(ACC_COLS):
            col = c + tpr * e
            if i < n and col < wn:
                dst[i, c0 + col] = scale * acc[r, e]


@inline_device
def _sum_slots(sums, base, slots, zero):
    """The compensated sum of the (row, lane) sums and carries at ``sums[base:]``, in slot order."""
    total = zero
    carry = zero
    for slot in range(slots):
        total, carry = compensated_add(total, carry, sums[base + slot])
        total, carry = compensated_add(total, carry, sums[base + slots + slot])
    return total + carry


@cuda.jit(cache=True)
def _backward_dq_kernel(q, k, v, opts, block_k, dout_lse_delta, dq, partials, dbias):
    """One block per (batch * head, query tile), query tiles fastest; ``dq`` in register micro-tiles.

    Thread ``(g, c)`` (row group ``g`` of ``tpr = block_k / REG_N`` lanes) owns
    query rows ``g REG_M + r`` and, of each key tile, keys ``c + tpr n``. Per
    key tile: stage K and V, recompute ``s = q . k`` and ``dp = dout . v`` as
    micro-tiles, ``ds`` per entry (`_dq_tile_grads`), ``dq += ds k`` into the
    ``REG_M x ACC_COLS`` accumulators. Writes ``partials[b, h, tile]`` (the
    sums of ``dtau``, ``dsigma``), and, with a full bias
    (``iopts[I_DBIAS_FULL]``), every entry of the block's rows of ``dbias``
    (0 where nothing is kept).
    """
    # the shapes are read here, not through `problem_dims`, whose tuple changes the compiled code of
    # this kernel and the dk/dv one (python -m elastic_np.cuda --resources)
    mask, kv_lengths, band, iopts, fopts, tau, beta, bh_consts, bias = opts
    dout, lse, delta = dout_lse_delta
    _B, H, N, D = q.shape
    Hkv = k.shape[1]
    M = k.shape[2]
    Dv = v.shape[3]
    threads, t, tpr, block_q, row0, c, tile, b, h, i0, i1 = tile_block(N, H, block_k)
    micro = (row0, c, tpr)
    hk = h // (H // Hkv)
    width = min(max(D, 1), tpr * ACC_COLS)
    q_stride = D + 1
    do_stride = Dv + 1
    p_stride = block_k + 1
    slots = block_q * tpr
    smem = cuda.shared.array(0, dtype=q.dtype)
    q_tile, do_tile, s_tile, dp_tile, stats, sums, k_tile, v_tile = _dq_tiles(smem, block_q, block_k, D, Dv, slots)

    zero = fopts[F_ZERO]
    fill(q_tile, block_q * q_stride, zero, t, threads)  # rows past N and the padding column
    fill(do_tile, block_q * do_stride, zero, t, threads)
    fill(sums, 4 * slots, zero, t, threads)
    _load_row_stats(stats, block_q, lse[b, h], delta[b, h], i0, N, zero, t, threads)
    dbias_full = iopts[I_DBIAS_FULL] != 0
    if dbias_full:  # the block's rows of dbias, zeroed (coalesced) before the tile loop's first syncthreads
        _zero_rows(dbias, b, h, i0, i1, M, zero, t, threads)
    cuda.syncthreads()
    stage(q[b, h], i0, i1 - i0, 0, D, q_tile, q_stride, t, threads)
    stage(dout[b, h], i0, i1 - i0, 0, Dv, do_tile, do_stride, t, threads)

    g_inv_sigma = zero
    has_gate = iopts[I_HAS_GATE] != 0
    if has_gate:
        g_inv_sigma = bh_consts[b, h, C_INV_SIGMA]
    tau_h = tau[h]
    scalar_sums = (sums, slots, has_gate, g_inv_sigma)
    dbias_out = (dbias_full, dbias)
    prm = bh_params(b, h, N, M, opts)
    lo, hi = block_key_range(i0, i1, b, h, N, M, opts)
    scores = cuda.local.array((REG_M, REG_N), q.dtype)
    acc = cuda.local.array((REG_M, ACC_COLS), q.dtype)
    i_first = i0 + row0
    queries = (b, h, i_first, N)
    score_tiles = (s_tile, dp_tile, p_stride, stats, block_q)
    for c0 in range(0, max(D, 1), width):
        wn = min(width, D - c0)
        _zero_acc(acc, zero)
        for j0 in range(lo, hi, block_k):
            jn = min(block_k, hi - j0)
            cuda.syncthreads()  # the previous tiles are consumed (and q, dout, stats written)
            stage(k[b, hk], j0, jn, 0, D, k_tile, q_stride, t, threads)
            stage(v[b, hk], j0, jn, 0, Dv, v_tile, do_stride, t, threads)
            cuda.syncthreads()
            # recompute s and dp; ds, the dq share of this key tile
            tile_dot(q_tile, q_stride, k_tile, q_stride, D, micro, zero, scores)
            store_tile(scores, s_tile, p_stride, micro)
            tile_dot(do_tile, do_stride, v_tile, do_stride, Dv, micro, zero, scores)
            store_tile(scores, dp_tile, p_stride, micro)
            _dq_tile_grads(score_tiles, scalar_sums, dbias_out, micro, queries, (j0, jn), prm, opts, tau_h, c0 == 0)
            cuda.syncthreads()  # ds written
            tile_pv(s_tile, p_stride, k_tile[c0:], q_stride, jn, wn, micro, zero, acc)
        _store_acc(dq[b, h], acc, i_first, N, c0, wn, micro, fopts[F_SCALE])
    cuda.syncthreads()
    if t == 0:  # the (row, lane) sums in slot order: the same result whatever the scheduling
        partials[b, h, tile, P_DTAU] = _sum_slots(sums, 0, slots, zero)
        partials[b, h, tile, P_DSIGMA] = _sum_slots(sums, 2 * slots, slots, zero)


@cuda.jit(device=True)
def _dkdv_tile_grads(score_tiles, micro, keys, queries, prm, opts, tau_h):
    """``p_tile`` (``k . q``) becomes ``p``, ``ds_tile`` (``v . dout``) becomes ``ds_raw``, for the thread's entries.

    ``score_tiles = (p_tile, ds_tile, p_stride, stats, block_q)``, ``micro =
    (row0, c, tpr)`` (`tile_block`), ``keys = (j0, j1)``: the block's keys,
    ``queries = (b, h, i0, im)``: the tile's ``im`` queries from ``i0``.
    Rows are keys ``j0 + row0 + r``, columns queries ``i0 + c + tpr n``; 0
    where the entry is removed or past the tiles. ``lse`` and ``delta`` of
    query column ``ii`` are ``stats[ii]`` and ``stats[block_q + ii]``;
    ``ds_raw = p (dp - delta) / tau_h cap_slope``.
    One loop over the ``REG_M REG_N`` entries, not two nested ones: NVVM
    unrolls the inner loop of the nested form (four copies of the score
    pipeline), and ptxas spills more. The entries are independent, so the
    order changes no bit.
    """
    p_tile, ds_tile, p_stride, stats, block_q = score_tiles
    row0, c, tpr = micro
    j0, j1 = keys
    b, h, i0, im = queries
    fopts, zero, neg_inf = constants(opts)
    for rn in range(REG_M * REG_N):
        row = row0 + rn // REG_N
        j = j0 + row
        ii = c + tpr * (rn % REG_N)
        at = row * p_stride + ii
        p = zero
        ds_raw = zero
        if j < j1 and ii < im:
            i = i0 + ii
            z, _s, cap_slope, _f, _u = entry(p_tile[at], b, h, i, j, prm, opts)
            if z != neg_inf:  # kept, and not removed by NVM or a closed gate
                p = math.exp(z - stats[ii])
                ds_raw = p * (ds_tile[at] - stats[block_q + ii]) / tau_h * cap_slope
        p_tile[at] = p
        ds_tile[at] = ds_raw


@inline_device
def _dkdv_tiles(smem, block_k, block_q, D, Dv):
    """The dk/dv block's shared memory: ``(k_tile, v_tile, p_tile, ds_tile, q_tile, do_tile, stats)``.

    Row strides ``D + 1`` (K, q), ``Dv + 1`` (V, dout) and ``block_q + 1``
    (``p``, ``ds``); ``stats`` holds the query tile's ``lse`` then ``delta``.
    """
    k_tile, at = carve(smem, 0, block_k * (D + 1))
    v_tile, at = carve(smem, at, block_k * (Dv + 1))
    p_tile, at = carve(smem, at, block_k * (block_q + 1))
    ds_tile, at = carve(smem, at, block_k * (block_q + 1))
    q_tile, at = carve(smem, at, block_q * (D + 1))
    do_tile, at = carve(smem, at, block_q * (Dv + 1))
    stats, at = carve(smem, at, 2 * block_q)
    return k_tile, v_tile, p_tile, ds_tile, q_tile, do_tile, stats


@cuda.jit(cache=True)
def _backward_dkdv_kernel(q, k, v, opts, block_q, dout_lse_delta, dk, dv):
    """One block per (batch * kv head, key tile), key tiles fastest; ``dk``, ``dv`` in register micro-tiles.

    Thread ``(g, c)`` (key group ``g`` of ``tpr = block_q / REG_N`` lanes) owns
    keys ``j0 + g REG_M + r`` and, of each query tile, queries ``c + tpr n``;
    its ``dk`` and ``dv`` accumulators hold output columns ``c0 + c + tpr e``
    of its keys. The loop runs over the query heads of the group and, for
    each, the query tiles that can see the key tile.
    """
    fopts, tau = opts[O_FOPTS], opts[O_TAU]
    dout, lse, delta = dout_lse_delta
    _B, H, N, D = q.shape  # not through `problem_dims`: see `_backward_dq_kernel`
    Hkv = k.shape[1]
    M = k.shape[2]
    Dv = v.shape[3]
    group = H // Hkv
    threads, t, tpr, block_k, row0, c, _tile, b, hk, j0, j1 = tile_block(M, Hkv, block_q)
    micro = (row0, c, tpr)
    widest = max(D, Dv, 1)
    width = min(widest, tpr * ACC_COLS)

    k_stride = D + 1
    v_stride = Dv + 1
    p_stride = block_q + 1
    smem = cuda.shared.array(0, dtype=q.dtype)
    k_tile, v_tile, p_tile, ds_tile, q_tile, do_tile, stats = _dkdv_tiles(smem, block_k, block_q, D, Dv)
    score_tiles = (p_tile, ds_tile, p_stride, stats, block_q)

    zero = fopts[F_ZERO]
    fill(k_tile, block_k * k_stride, zero, t, threads)  # keys past M and the padding column
    fill(v_tile, block_k * v_stride, zero, t, threads)
    fill(q_tile, block_q * k_stride, zero, t, threads)
    fill(do_tile, block_q * v_stride, zero, t, threads)
    cuda.syncthreads()
    stage(k[b, hk], j0, j1 - j0, 0, D, k_tile, k_stride, t, threads)
    stage(v[b, hk], j0, j1 - j0, 0, Dv, v_tile, v_stride, t, threads)

    scores = cuda.local.array((REG_M, REG_N), q.dtype)
    dk_acc = cuda.local.array((REG_M, ACC_COLS), q.dtype)
    dv_acc = cuda.local.array((REG_M, ACC_COLS), q.dtype)
    for c0 in range(0, widest, width):
        wk = min(width, D - c0)
        wv = min(width, Dv - c0)
        _zero_acc(dk_acc, zero)
        _zero_acc(dv_acc, zero)
        for h in range(hk * group, (hk + 1) * group):
            tau_h = tau[h]
            prm = bh_params(b, h, N, M, opts)
            lo, hi = block_query_range(j0, j1, b, h, N, M, opts)
            for i0 in range(lo, hi, block_q):
                im = min(block_q, hi - i0)
                cuda.syncthreads()  # the previous query tile is consumed (and K, V written)
                stage(q[b, h], i0, im, 0, D, q_tile, k_stride, t, threads)
                stage(dout[b, h], i0, im, 0, Dv, do_tile, v_stride, t, threads)
                for idx in range(t, im, threads):
                    stats[idx] = lse[b, h, i0 + idx]
                    stats[block_q + idx] = delta[b, h, i0 + idx]
                cuda.syncthreads()
                # recompute s = k . q and dp = v . dout; p from lse, ds (`_dkdv_tile_grads`); dv += p dout, dk += ds q
                tile_dot(k_tile, k_stride, q_tile, k_stride, D, micro, zero, scores)
                store_tile(scores, p_tile, p_stride, micro)
                tile_dot(v_tile, v_stride, do_tile, v_stride, Dv, micro, zero, scores)
                store_tile(scores, ds_tile, p_stride, micro)
                _dkdv_tile_grads(score_tiles, micro, (j0, j1), (b, h, i0, im), prm, opts, tau_h)
                cuda.syncthreads()  # p and ds written
                if wv > 0:
                    tile_pv(p_tile, p_stride, do_tile[c0:], v_stride, im, wv, micro, zero, dv_acc)
                if wk > 0:
                    tile_pv(ds_tile, p_stride, q_tile[c0:], k_stride, im, wk, micro, zero, dk_acc)
        scale = fopts[F_SCALE]
        for r in range(REG_M):
            j = j0 + row0 + r
            for e in range(ACC_COLS):
                col = c + tpr * e
                if j < j1 and col < wk:
                    dk[b, hk, j, c0 + col] = scale * dk_acc[r, e]
                if j < j1 and col < wv:
                    dv[b, hk, j, c0 + col] = dv_acc[r, e]


@cuda.jit(cache=True)
def _backward_dbias_kernel(q, k, v, opts, dout_lse_delta, dbias):
    """``dbias`` of a broadcast bias: one block per entry of the bias's own compact shape.

    ``dbias`` is flat, in C order over the bias's compact shape (its own shape
    padded to four dims, ``iopts[I_DBIAS_B:I_DBIAS_J + 1]``), whatever strides
    the bias itself is read at. The block's entry stands for the ``R`` entries
    ``(b, h, i, j)`` along the broadcast axes; thread ``t`` takes the ``r``-th
    of them for ``r = t, t + blockDim, ...``, recomputes ``ds`` (the score,
    ``p = exp(z - lse)`` and ``dP = dout . v``, with ``delta`` from the dq
    kernel) and sums it, compensated; thread 0 then adds the threads' sums in
    thread order. The work per entry is fixed, so the result does not depend
    on scheduling, and no ``(B, H, N, M)`` temporary exists.
    """
    mask, kv_lengths, band, iopts, fopts, tau, beta, bh_consts, bias = opts
    dout, lse, delta = dout_lse_delta
    B, H, Hkv, N, M, D, Dv = problem_dims(q, k, v)
    group = H // Hkv
    threads = cuda.blockDim.x
    t = cuda.threadIdx.x
    e = cuda.blockIdx.x

    # dbias's layout (the compact dims, 1 where broadcast) and the spans of the broadcast axes
    cb_n = iopts[I_DBIAS_B]
    ch_n = iopts[I_DBIAS_H]
    ci_n = iopts[I_DBIAS_I]
    cj_n = iopts[I_DBIAS_J]
    rb_n = B // cb_n
    rh_n = H // ch_n
    ri_n = N // ci_n
    rj_n = M // cj_n
    cj = e % cj_n
    ci = e // cj_n % ci_n
    ch = e // (cj_n * ci_n) % ch_n
    cb = e // (cj_n * ci_n * ch_n)
    bias_at = cb * iopts[I_BIAS_SB] + ch * iopts[I_BIAS_SH] + ci * iopts[I_BIAS_SI] + cj * iopts[I_BIAS_SJ]
    bias_value = bias[bias_at]

    zero = fopts[F_ZERO]
    neg_inf = fopts[F_NEG_INF]
    total = zero
    carry = zero
    if bias_value != fopts[F_NEG_INF]:  # a -inf entry removes all it stands for: dbias 0
        for r in range(t, rb_n * rh_n * ri_n * rj_n, threads):
            b = cb + r // (rj_n * ri_n * rh_n)
            h = ch + r // (rj_n * ri_n) % rh_n
            i = ci + r // rj_n % ri_n
            j = cj + r % rj_n
            prm = bh_params(b, h, N, M, opts)
            kept, _entry_bias = entry_keep(b, h, i, j, prm, opts)  # entry_bias is bias_value
            if not kept:
                continue
            hk = h // group
            dot = zero
            for d in range(D):
                dot += q[b, h, i, d] * k[b, hk, j, d]
            z, _s, _cap_slope, _f, _u = entry_logit(dot, i, j, bias_value, prm, fopts)
            if z == neg_inf:  # removed by NVM or a closed gate
                continue
            tau_h = tau[h]
            p = math.exp(z - lse[b, h, i])
            dp = zero
            for d in range(Dv):
                dp += dout[b, h, i, d] * v[b, hk, j, d]
            ds = p * (dp - delta[b, h, i]) / tau_h
            total, carry = compensated_add(total, carry, ds)

    sums = cuda.shared.array(0, dtype=q.dtype)
    sums[t] = total + carry
    cuda.syncthreads()
    if t == 0:
        total = zero
        carry = zero
        for r in range(threads):
            total, carry = compensated_add(total, carry, sums[r])
        dbias[e] = total + carry


KERNELS = {
    "_backward_delta_kernel": _backward_delta_kernel,
    "_backward_dq_kernel": _backward_dq_kernel,
    "_backward_dkdv_kernel": _backward_dkdv_kernel,
    "_backward_dbias_kernel": _backward_dbias_kernel,
}
