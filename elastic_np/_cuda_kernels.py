"""The numba.cuda kernels of `elastic_np.cuda` (imported only by that module).

Importing this module imports ``numba.cuda``; `elastic_np.cuda` does so only
when the CUDA backend is asked for. The host functions that launch these
kernels, and the reasoning behind the design, are in `elastic_np.cuda`.

Conventions shared by every kernel:

- ``q, k, v`` are C-contiguous ``(B, H, N, D)``, ``(B, Hkv, M, D)``,
  ``(B, Hkv, M, Dv)`` arrays of one real dtype; every floating argument is in
  that dtype, so a float32 kernel computes in float32 throughout.
- Options travel as runtime values: ``iopts`` (int64, indexed by the ``I_*``
  constants), ``fopts`` (the dtype, indexed by ``F_*``), ``tau``/``beta``
  ``(H,)``, ``bh_consts`` ``(B, H, C_COUNT)`` (the per-(b, h) constants: the
  window's and the ALiBi slope; ``(1, 1, C_COUNT)`` when neither is given),
  ``band`` int64 ``(B, H)`` (half-width in keys of the window's open band, -1
  unbounded), ``kv_lengths`` int64 ``(B,)`` and ``mask`` uint8 with each of its
  four dims either full or 1 (broadcast).
- The additive ``bias`` is a flat array (the dtype) of the caller's distinct
  entries; entry ``(b, h, i, j)`` is ``bias[b sb + h sh + i si + j sj]`` with
  the element strides ``iopts[I_BIAS_SB:I_BIAS_SJ + 1]``, 0 on the axes it is
  broadcast along. Without a bias it is a one-element dummy, never read.
- The score of an entry is built in the contract's order (`_score`): scaled
  dot product, soft-cap (``fopts[F_SOFTCAP] > 0``), ALiBi, bias; a ``-inf``
  bias removes the entry like a false mask entry, and NVM tests the final score.
- Shared memory is one dynamic array, carved into tiles by offsets. A tile that
  a thread reads along its own row has a row stride of ``dim + 1`` so that the
  threads of a warp fall in different banks.
"""

import math

from numba import cuda

from elastic_np._cuda_device import *  # noqa: F401,F403  (the option indices and device functions)
from elastic_np._cuda_config import ACC_COLS, REG_M
from elastic_np._cuda_device import (
    F_NEG_INF, F_ONE, F_ZERO, I_BIAS_SB, I_BIAS_SH, I_BIAS_SI, I_BIAS_SJ, _bh_params, _compensated_add, _entry,
    _entry_keep, _entry_logit, _finish_row, _group_max, _group_sum, _key_range, _lane_mask, _stage, _tile_dot,
    _tile_pv,
)

@cuda.jit(device=True)
def _tile_softmax(p_tile, p_stride, stats, slots, row0, i_first, N, b, h, j0, jn, c, tpr, lanes, prm, mask, bias, fopts):
    """The online softmax step of the thread's rows over one key tile, in place in ``p_tile``.

    ``p_tile`` holds the thread's dot products (row ``row0 + r``, key ``c +
    tpr n``); each becomes its logit (`_entry`, ``-inf`` when removed), the
    row's tile max is combined over the ``tpr`` threads of the row group with
    shuffles, and each becomes ``p = exp(z - max)`` (0 where removed, past the
    tile or past ``N``). The thread's running max and partial sum of each row
    live in ``stats`` (slot ``row tpr + c`` of the sections at 0 and
    ``slots``, one writer each), and the row's rescale factor goes to the
    section at ``2 slots``, for the caller to apply to its accumulator
    registers. The loops here are not unrolled on purpose (the score pipeline
    is long), so they keep their data in shared memory, not in local arrays.
    """
    neg_inf = fopts[F_NEG_INF]
    zero = fopts[F_ZERO]
    one = fopts[F_ONE]
    for r in range(REG_M):
        row = row0 + r
        slot = row * tpr + c
        i = i_first + r
        tile_max = neg_inf
        for n in range(REG_N):
            jj = c + tpr * n
            z = neg_inf
            if jj < jn and i < N:
                z = _entry(p_tile[row * p_stride + jj], b, h, i, j0 + jj, prm, mask, bias, fopts)[0]
            p_tile[row * p_stride + jj] = z
            tile_max = max(tile_max, z)
        old_max = stats[slot]
        new_max = max(old_max, _group_max(tile_max, tpr, lanes))
        alpha = one
        if new_max > neg_inf:
            alpha = math.exp(old_max - new_max)  # 1 when the max stays, 0 from -inf
        total = stats[slots + slot] * alpha
        for n in range(REG_N):
            at = row * p_stride + c + tpr * n
            p = zero
            if p_tile[at] > neg_inf:
                p = math.exp(p_tile[at] - new_max)
            total += p
            p_tile[at] = p
        stats[slot] = new_max
        stats[slots + slot] = total
        stats[2 * slots + slot] = alpha


@cuda.jit(device=True)
def _finish_rows(stats, slots, row0, i_first, N, b, h, c, c0, tpr, lanes, beta_h, fopts, lse):
    """Each row's ``lse`` (written once) and ``out = (acc num) / den`` (`_finish_row`).

    ``num`` is left in the section of ``stats`` at ``2 slots``, ``den`` in that at ``slots``.
    """
    for r in range(REG_M):
        slot = (row0 + r) * tpr + c
        i = i_first + r
        row_lse, num, den = _finish_row(stats[slot], _group_sum(stats[slots + slot], tpr, lanes), beta_h, fopts)
        stats[2 * slots + slot] = num
        stats[slots + slot] = den
        if i < N and c0 == 0 and c == 0:
            lse[b, h, i] = row_lse


@cuda.jit(cache=True)
def _forward_kernel(q, k, v, mask, kv_lengths, band, iopts, fopts, tau, beta, bh_consts, bias, block_n, out, lse):
    """One block per (batch * head, query tile); a flash forward with register micro-tiles.

    The grid is one-dimensional, query tiles fastest, so that the blocks that
    share a head's K/V run side by side. The block's threads form row groups
    of ``tpr = block_n / REG_N`` consecutive lanes (a power of two, inside
    one warp); thread ``(g, c)`` owns query rows ``g REG_M + r`` and, of each
    key tile, keys ``c + tpr n`` (``REG_M x REG_N`` scores in registers) and
    output columns ``c + tpr e`` (``REG_M x ACC_COLS`` accumulators). Per key
    tile: stage K, scores, row max over the group by shuffles, rescale, ``p``
    to shared memory, stage V in the same buffer, ``acc += p V``. Heads wider
    than ``tpr ACC_COLS`` output columns take several passes over the keys
    (each recomputing the same scores, so every pass has the same softmax).
    """
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    M = k.shape[2]
    Dv = v.shape[3]
    threads = cuda.blockDim.x
    t = cuda.threadIdx.x
    tpr = block_n // REG_N
    block_m = threads // tpr * REG_M
    row0 = t // tpr * REG_M
    c = t % tpr
    n_tiles = (N + block_m - 1) // block_m
    tile = cuda.blockIdx.x % n_tiles
    b = cuda.blockIdx.x // n_tiles // H
    h = cuda.blockIdx.x // n_tiles % H
    hk = h // (H // Hkv)
    i0 = tile * block_m
    i1 = min(i0 + block_m, N)
    width = min(max(Dv, 1), tpr * ACC_COLS)

    q_stride = D + 1
    kv_stride = max(D + 1, width)
    p_stride = block_n + 1
    smem = cuda.shared.array(0, dtype=q.dtype)
    q_tile = smem[: block_m * q_stride]
    kv_base = block_m * q_stride
    kv_tile = smem[kv_base : kv_base + block_n * kv_stride]
    p_base = kv_base + block_n * kv_stride
    p_tile = smem[p_base : p_base + block_m * p_stride]
    stats_base = p_base + block_m * p_stride
    stats = smem[stats_base : stats_base + 3 * block_m * tpr]  # per (row, lane): max, sum, rescale

    zero = fopts[F_ZERO]
    neg_inf = fopts[F_NEG_INF]
    for idx in range(t, block_m * q_stride, threads):
        q_tile[idx] = zero  # rows past N and the padding column
    cuda.syncthreads()
    _stage(q, b, h, i0, i1 - i0, 0, D, q_tile, q_stride, t, threads)
    prm = _bh_params(b, h, N, M, iopts, fopts, tau, bh_consts, kv_lengths)
    lanes = _lane_mask(t, threads)
    lo, hi = _key_range(i0, i1, b, h, N, M, iopts, kv_lengths, band)
    scores = cuda.local.array((REG_M, REG_N), q.dtype)
    acc = cuda.local.array((REG_M, ACC_COLS), q.dtype)
    slots = block_m * tpr
    i_first = i0 + row0
    for c0 in range(0, max(Dv, 1), width):
        wn = min(width, Dv - c0)
        for r in range(REG_M):
            stats[(row0 + r) * tpr + c] = neg_inf
            stats[slots + (row0 + r) * tpr + c] = zero
            for e in range(ACC_COLS):
                acc[r, e] = zero
        for j0 in range(lo, hi, block_n):
            jn = min(block_n, hi - j0)
            cuda.syncthreads()  # the previous V tile is consumed (and q_tile written)
            _stage(k, b, hk, j0, jn, 0, D, kv_tile, kv_stride, t, threads)
            cuda.syncthreads()
            _tile_dot(q_tile, q_stride, row0, kv_tile, kv_stride, c, tpr, D, zero, scores)
            for r in range(REG_M):
                for n in range(REG_N):
                    p_tile[(row0 + r) * p_stride + c + tpr * n] = scores[r, n]
            _tile_softmax(p_tile, p_stride, stats, slots, row0, i_first, N, b, h, j0, jn, c, tpr, lanes, prm,
                          mask, bias, fopts)
            for r in range(REG_M):
                alpha = stats[2 * slots + (row0 + r) * tpr + c]
                for e in range(ACC_COLS):
                    acc[r, e] *= alpha
            cuda.syncthreads()  # K consumed, p written
            _stage(v, b, hk, j0, jn, c0, wn, kv_tile, kv_stride, t, threads)
            cuda.syncthreads()
            _tile_pv(p_tile, p_stride, row0, kv_tile, kv_stride, jn, c, tpr, wn, zero, acc)
        _finish_rows(stats, slots, row0, i_first, N, b, h, c, c0, tpr, lanes, beta[h], fopts, lse)
        for r in range(REG_M):
            i = i_first + r
            num = stats[2 * slots + (row0 + r) * tpr + c]
            den = stats[slots + (row0 + r) * tpr + c]
            for e in range(ACC_COLS):
                col = c + tpr * e
                if i < N and col < wn:
                    out[b, h, i, c0 + col] = (acc[r, e] * num) / den


@cuda.jit(cache=True)
def _backward_dbias_kernel(q, k, v, mask, kv_lengths, iopts, fopts, tau, bh_consts, bias, dout, lse, delta, dbias):
    """``dbias`` of a broadcast bias: one block per entry of the bias's own compact shape.

    ``dbias`` is flat, laid out like ``bias`` (C order over the compact shape,
    whose dims are the full ones where the bias's stride is nonzero and 1
    where it is broadcast). The block's entry stands for the ``R`` entries
    ``(b, h, i, j)`` along the broadcast axes; thread ``t`` takes the ``r``-th
    of them for ``r = t, t + blockDim, ...``, recomputes ``ds`` (the score,
    ``p = exp(z - lse)`` and ``dP = dout . v``, with ``delta`` from the dq
    kernel) and sums it, compensated; thread 0 then adds the threads' sums in
    thread order. The work per entry is fixed, so the result does not depend
    on scheduling, and no ``(B, H, N, M)`` temporary exists.
    """
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    M = k.shape[2]
    Dv = v.shape[3]
    group = H // Hkv
    threads = cuda.blockDim.x
    t = cuda.threadIdx.x
    e = cuda.blockIdx.x

    sb = iopts[I_BIAS_SB]
    sh = iopts[I_BIAS_SH]
    si = iopts[I_BIAS_SI]
    sj = iopts[I_BIAS_SJ]
    # compact dims (1 where broadcast) and the spans of the broadcast axes
    cb_n = B if sb != 0 else 1
    ch_n = H if sh != 0 else 1
    ci_n = N if si != 0 else 1
    cj_n = M if sj != 0 else 1
    rb_n = B // cb_n
    rh_n = H // ch_n
    ri_n = N // ci_n
    rj_n = M // cj_n
    cj = e % cj_n
    ci = e // cj_n % ci_n
    ch = e // (cj_n * ci_n) % ch_n
    cb = e // (cj_n * ci_n * ch_n)
    bias_value = bias[cb * sb + ch * sh + ci * si + cj * sj]

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
            prm = _bh_params(b, h, N, M, iopts, fopts, tau, bh_consts, kv_lengths)
            kept, entry_bias = _entry_keep(b, h, i, j, prm, mask, bias, fopts)  # entry_bias is bias_value
            if not kept:
                continue
            hk = h // group
            dot = zero
            for d in range(D):
                dot += q[b, h, i, d] * k[b, hk, j, d]
            z, s, cap_slope, f, u = _entry_logit(dot, i, j, bias_value, prm, fopts)
            if z == neg_inf:  # removed by NVM or a closed gate
                continue
            tau_h = tau[h]
            p = math.exp(z - lse[b, h, i])
            dp = zero
            for d in range(Dv):
                dp += dout[b, h, i, d] * v[b, hk, j, d]
            ds = p * (dp - delta[b, h, i]) / tau_h
            total, carry = _compensated_add(total, carry, ds)

    sums = cuda.shared.array(0, dtype=q.dtype)
    sums[t] = total + carry
    cuda.syncthreads()
    if t == 0:
        total = zero
        carry = zero
        for r in range(threads):
            total, carry = _compensated_add(total, carry, sums[r])
        dbias[e] = total + carry


from elastic_np._cuda_backward import KERNELS as _BACKWARD_KERNELS  # noqa: E402
from elastic_np._cuda_decode import KERNELS as _DECODE_KERNELS  # noqa: E402

#: Every kernel of the backend, by name (the PTX and resource reports go through these).
KERNELS = {
    "_forward_kernel": _forward_kernel,
    **_BACKWARD_KERNELS,
    "_backward_dbias_kernel": _backward_dbias_kernel,
    **_DECODE_KERNELS,
}
