"""The SIMT flash forward, `_forward_kernel`: register micro-tiles, one online softmax per row, on any GPU.

One block per (batch * head, query tile of ``block_q`` rows); the block's
threads form row groups of ``tpr = block_k / REG_N`` consecutive lanes of
one warp, each thread owning ``REG_M`` query rows. Per K/V tile of
``block_k`` keys (staged in shared memory, K then V in the same buffer):
each thread computes a ``REG_M x REG_N`` micro-tile of dot products in
registers (``REG_M + REG_N`` shared loads per ``REG_M REG_N`` multiply-adds,
loops fully unrolled), the score pipeline turns them into logits
(`elastic_np.cuda._device.score.entry`, shared with the backward kernels),
the row max is combined across the row group with warp shuffles, the
running sums and the ``REG_M x ACC_COLS`` output accumulator are rescaled in
registers (`elastic_np.cuda._device.softmax.row_step`), and ``p`` goes
through shared memory to the ``p V`` micro-tile product. Each thread's
running max and partial row sum, and the rescale factor, sit in shared
memory (one slot per thread and row) rather than in local arrays: the score
pipeline is long, so its loop over the rows is not unrolled, and a local
array indexed by a loop counter would live in local memory. Only the key
tiles that the causal, window, ``kv_lengths`` and dynamic-window band can
reach are visited. A value head wider than ``tpr * ACC_COLS`` takes several
passes over the keys (each recomputing the same scores, hence the same
softmax). The row sums are combined in a fixed butterfly, so results are
bit-identical from run to run, and ``out = (acc num) / den``
(`elastic_np.cuda._device.softmax.finish_row`): one rounding, not two
through a reciprocal.

Imports ``numba.cuda``; imported on first use by its launch,
`elastic_np.cuda._launch.forward`, for the forwards that the plan sends
neither to the decode kernels nor to the tensor cores
(`elastic_np.cuda._launch.plan`).
"""


from numba import cuda

from elastic_np.cuda._device.basics import constants, problem_dims
from elastic_np.cuda._device.indices import F_ONE, O_BETA
from elastic_np.cuda._device.score import bh_params, block_key_range
from elastic_np.cuda._device.softmax import finish_row, group_sum, lane_mask, row_step
from elastic_np.cuda._device.tiles import carve, fill, stage
from elastic_np.cuda._runtime.config import ACC_COLS, REG_M, REG_N
from elastic_np.cuda._simt.micro_tiles import flash_tiles, store_tile, tile_block, tile_dot, tile_entry, tile_pv


@cuda.jit(device=True)
def _tile_step(p_tile, p_stride, stats, slots, micro, lanes, queries, keys, prm, opts):
    """The thread's rows over one key tile: their logits, then each row's online-softmax step, in place in ``p_tile``.

    ``micro = (row0, c, tpr)`` (`tile_block`), ``queries = (b, h, i_first,
    N)``: the thread's rows are queries ``i_first + r`` of ``N``, ``keys =
    (j0, jn)``: the tile holds keys ``[j0, j0 + jn)``. ``p_tile`` holds the
    thread's dot products (row ``row0 + r``, key ``c + tpr n``); each
    becomes its logit (`tile_entry`, ``-inf`` when removed, past the tile
    or past ``N``), then ``p`` (`row_step`). The thread's running max and
    partial sum of each row live in ``stats`` (slot ``row tpr + c`` of the
    sections at 0 and ``slots``, one writer each), and the row's rescale
    factor goes to the section at ``2 slots``, for the caller to apply to its
    accumulator registers. The loop over the rows is not unrolled (the score
    pipeline is long), so the rows' state lives in shared memory, not in
    local arrays.
    """
    row0, c, tpr = micro
    fopts, zero, neg_inf = constants(opts)
    consts = (zero, fopts[F_ONE], neg_inf)
    for r in range(REG_M):
        row = row0 + r
        slot = row * tpr + c
        tile_max = neg_inf
        for n in range(REG_N):
            at, _i, _j, z, _s, _cap_slope, _f, _u = tile_entry(p_tile, p_stride, micro, queries, keys, r, n, prm, opts)
            p_tile[at] = z
            tile_max = max(tile_max, z)
        state = (stats[slot], stats[slots + slot])
        new_max, total, alpha = row_step(p_tile, row * p_stride + c, tpr, REG_N, state, tile_max, lanes, consts)
        stats[slot] = new_max
        stats[slots + slot] = total
        stats[2 * slots + slot] = alpha


@cuda.jit(device=True)
def _finish_rows(stats, slots, micro, lanes, queries, c0, beta_h, fopts, lse):
    """Each row's ``lse`` (written once) and ``out = (acc num) / den`` (`finish_row`).

    ``micro``, ``queries`` as in `_tile_step`; ``c0`` is the pass's first
    output column. ``num`` is left in the section of ``stats`` at ``2 slots``,
    ``den`` in that at ``slots``.
    """
    row0, c, tpr = micro
    b, h, i_first, N = queries
    for r in range(REG_M):
        slot = (row0 + r) * tpr + c
        i = i_first + r
        row_lse, num, den = finish_row(stats[slot], group_sum(stats[slots + slot], tpr, lanes), beta_h, fopts)
        stats[2 * slots + slot] = num
        stats[slots + slot] = den
        if i < N and c0 == 0 and c == 0:
            lse[b, h, i] = row_lse


@cuda.jit(cache=True)
def _forward_kernel(q, k, v, opts, block_k, out, lse):
    """One block per (batch * head, query tile); a flash forward with register micro-tiles.

    The grid is one-dimensional, query tiles fastest, so that the blocks that
    share a head's K/V run side by side. The block's threads form row groups
    of ``tpr = block_k / REG_N`` consecutive lanes (a power of two, inside
    one warp); thread ``(g, c)`` owns query rows ``g REG_M + r`` and, of each
    key tile, keys ``c + tpr n`` (``REG_M x REG_N`` scores in registers) and
    output columns ``c + tpr e`` (``REG_M x ACC_COLS`` accumulators). Per key
    tile: stage K, scores, row max over the group by shuffles, rescale, ``p``
    to shared memory, stage V in the same buffer, ``acc += p V``. Heads wider
    than ``tpr ACC_COLS`` output columns take several passes over the keys
    (each recomputing the same scores, so every pass has the same softmax).
    """
    B, H, Hkv, N, M, D, Dv = problem_dims(q, k, v)
    threads, t, tpr, block_q, row0, c, tile, b, h, i0, i1 = tile_block(N, H, block_k)
    micro = (row0, c, tpr)
    hk = h // (H // Hkv)
    width = min(max(Dv, 1), tpr * ACC_COLS)

    smem = cuda.shared.array(0, dtype=q.dtype)
    q_tile, q_stride, kv_tile, kv_stride, p_tile, p_stride, at = flash_tiles(smem, block_q, D, width, block_k)
    stats, at = carve(smem, at, 3 * block_q * tpr)  # per (row, lane): max, sum, rescale

    fopts, zero, neg_inf = constants(opts)
    fill(q_tile, block_q * q_stride, zero, t, threads)  # rows past N and the padding column
    cuda.syncthreads()
    stage(q[b, h], i0, i1 - i0, 0, D, q_tile, q_stride, t, threads)
    prm = bh_params(b, h, N, M, opts)
    lanes = lane_mask(t, threads)
    lo, hi = block_key_range(i0, i1, b, h, N, M, opts)
    scores = cuda.local.array((REG_M, REG_N), q.dtype)
    acc = cuda.local.array((REG_M, ACC_COLS), q.dtype)
    slots = block_q * tpr
    i_first = i0 + row0
    queries = (b, h, i_first, N)
    for c0 in range(0, max(Dv, 1), width):
        wn = min(width, Dv - c0)
        for r in range(REG_M):
            stats[(row0 + r) * tpr + c] = neg_inf
            stats[slots + (row0 + r) * tpr + c] = zero
            for e in range(ACC_COLS):
                acc[r, e] = zero
        for j0 in range(lo, hi, block_k):
            jn = min(block_k, hi - j0)
            cuda.syncthreads()  # the previous V tile is consumed (and q_tile written)
            stage(k[b, hk], j0, jn, 0, D, kv_tile, kv_stride, t, threads)
            cuda.syncthreads()
            tile_dot(q_tile, q_stride, kv_tile, kv_stride, D, micro, zero, scores)
            store_tile(scores, p_tile, p_stride, micro)
            _tile_step(p_tile, p_stride, stats, slots, micro, lanes, queries, (j0, jn), prm, opts)
            for r in range(REG_M):
                alpha = stats[2 * slots + (row0 + r) * tpr + c]
                for e in range(ACC_COLS):
                    acc[r, e] *= alpha
            cuda.syncthreads()  # K consumed, p written
            stage(v[b, hk], j0, jn, c0, wn, kv_tile, kv_stride, t, threads)
            cuda.syncthreads()
            tile_pv(p_tile, p_stride, kv_tile, kv_stride, jn, wn, micro, zero, acc)
        _finish_rows(stats, slots, micro, lanes, queries, c0, opts[O_BETA][h], fopts, lse)
        for r in range(REG_M):
            i = i_first + r
            num = stats[2 * slots + (row0 + r) * tpr + c]
            den = stats[slots + (row0 + r) * tpr + c]
            for e in range(ACC_COLS):
                col = c + tpr * e
                if i < N and col < wn:
                    out[b, h, i, c0 + col] = (acc[r, e] * num) / den


#: The kernels of this module, by name.
KERNELS = {"_forward_kernel": _forward_kernel}
