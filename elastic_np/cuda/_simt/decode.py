"""The SIMT decode kernels: a few queries against a long key/value cache, split-KV, then a merge.

`elastic_np.cuda.forward` sends them a forward of 1 to
``DECODE_MAX_QUERIES`` queries per sequence and at most
``DECODE_MAX_ROWS`` stacked rows (`elastic_np.cuda._launch.plan`:
``takes_decode``, ``decode_geometry``, ``decode_splits``). Imports
``numba.cuda``; imported on first use by its launch,
`elastic_np.cuda._launch.decode`. The plan is the CPU backend's decode
kernel's (`elastic_np.cpu`):

- **Stacked rows.** The ``group = H / Hkv`` query heads of a kv head share
  its keys: row ``r = g N + i`` of kv head ``hk`` is query ``i`` of head
  ``hk group + g``. A block takes a chunk of ``rows_blk`` consecutive stacked
  rows (all of them unless there are more than fit a block), so each K/V tile
  it stages in shared memory serves every head of the group.
- **Threads.** Stacked row ``rho`` of the chunk is served by the ``tpr``
  consecutive lanes ``rho tpr + c`` (a power of two, inside one warp); lane
  ``c`` holds, of each K/V tile of ``block_k = tpr DECODE_REG_N`` keys, the
  scores of keys ``c + tpr n`` in registers, and output columns ``c + tpr e``
  (``DECODE_ACC_COLS`` accumulators). One row per thread: its running max and
  sum are scalars. The row max over the lanes is a shuffle butterfly
  (`group_max`), the row sum a shuffle butterfly at the end (`group_sum`,
  the same bits in every lane, run after run). Value heads wider than
  ``tpr DECODE_ACC_COLS`` take several passes over the keys.
- **Copies.** The K and V tiles are double-buffered in shared memory
  (`_decode_tiles`) and arrive by ``cp.async`` (`stage_kv`): the next tile
  is in flight while this one is scored and summed.
- **Split-KV.** The keys the chunk's rows can keep (the union of their
  ranges: causal, window, ``kv_lengths``, the dynamic window's band) are cut
  into ``n_split`` runs of whole K/V tiles, one block each, when the
  (batch, kv head, row chunk) blocks alone are fewer than
  ``DECODE_MIN_BLOCKS`` (``plan.decode_splits``: from the shape and the config only, never
  from timing, so every run gives the same bits). Each block writes the
  partial ``(max, sum, acc)`` of its rows: ``acc`` and ``sum`` relative to
  ``exp(max)``, unnormalised.
- **Merge.** `_decode_merge_kernel`, one block per stacked row, combines the
  splits in split order: ``m = max_s m_s``, ``l = sum_s l_s exp(m_s - m)``,
  ``acc = sum_s acc_s exp(m_s - m)``, then `finish_row` adds ``beta`` once
  (``lse = log(l exp(m) + beta)``, ``out = (acc num) / den``) exactly as the
  flash forward finishes a row; with one split it gives the forward's
  formula.

The scores go through the shared per-entry pipeline (`entry`), so the
backward, which recomputes them, sees the ``lse`` of the same logits. Options
are runtime values and the kernels compute in the input dtype: one compiled
specialisation per dtype.
"""

import math

from numba import cuda

from elastic_np.cuda._device import async_copy
from elastic_np.cuda._device.basics import constants, inline_device, problem_dims
from elastic_np.cuda._device.indices import F_NEG_INF, F_ONE, O_BETA, O_FOPTS, O_KV_LENGTHS
from elastic_np.cuda._device.score import bh_params, block_key_range, entry
from elastic_np.cuda._device.softmax import finish_row, group_sum, lane_mask, row_step
from elastic_np.cuda._device.tiles import carve, fill, stage_kv
from elastic_np.cuda._runtime.config import DECODE_ACC_COLS, DECODE_REG_N


@inline_device
def _row_dot(q_tile, q_at, k_tile, k_stride, c, tpr, D, zero, scores):
    """``scores[n] = q_tile[q_at:q_at + D] . k_tile[c + tpr n]``, ``DECODE_REG_N`` dot products in registers."""
    for n in range(DECODE_REG_N):
        scores[n] = zero
    for d in range(D):
        qd = q_tile[q_at + d]
        for n in range(DECODE_REG_N):
            scores[n] += qd * k_tile[(c + tpr * n) * k_stride + d]


@inline_device
def _row_pv(p_tile, p_at, v_tile, v_stride, jn, c, tpr, wn, zero, acc):
    """``acc[e] += sum_jj p_tile[p_at + jj] v_tile[jj, c + tpr e]`` for the thread's output columns."""
    vv = cuda.local.array(DECODE_ACC_COLS, p_tile.dtype)
    for jj in range(jn):
        p = p_tile[p_at + jj]
        for e in range(DECODE_ACC_COLS):
            col = c + tpr * e
            vv[e] = v_tile[jj * v_stride + col] if col < wn else zero
        for e in range(DECODE_ACC_COLS):
            acc[e] += p * vv[e]


@cuda.jit(device=True)
def _chunk_keys(b, hk, group, r0, r1, N, M, opts):
    """Keys ``[lo, hi)`` that stacked rows ``[r0, r1)`` of kv head ``hk`` can keep (the union of their ranges)."""
    lo = opts[O_KV_LENGTHS][b]
    hi = 0
    for g in range(r0 // N, (r1 - 1) // N + 1):
        i0 = max(r0 - g * N, 0)
        i1 = min(r1 - g * N, N)
        g_lo, g_hi = block_key_range(i0, i1, b, hk * group + g, N, M, opts)
        if g_hi > g_lo:
            lo = min(lo, g_lo)
            hi = max(hi, g_hi)
    if hi <= lo:
        return 0, 0
    return lo, hi


@inline_device
def _decode_block(tpr, rows, Hkv, n_split):
    """The place of a decode block and thread: ``(threads, t, rows_blk, s, b, hk, r0, r1, rho, c)``.

    The block holds split ``s`` of stacked rows ``[r0, r1)`` (a chunk of
    ``rows_blk``) of kv head ``hk``, batch ``b``; thread ``t`` of ``threads``
    is lane ``c`` of the ``tpr`` that serve the chunk's row ``rho``.
    """
    threads = cuda.blockDim.x
    t = cuda.threadIdx.x
    rows_blk = threads // tpr
    chunks = (rows + rows_blk - 1) // rows_blk
    s = cuda.blockIdx.x % n_split
    chunk = cuda.blockIdx.x // n_split % chunks
    hk = cuda.blockIdx.x // (n_split * chunks) % Hkv
    b = cuda.blockIdx.x // (n_split * chunks * Hkv)
    r0 = chunk * rows_blk
    return threads, t, rows_blk, s, b, hk, r0, min(r0 + rows_blk, rows), t // tpr, t % tpr


@inline_device
def _stage_rows(q_b, h0, N, r0, r1, q_tile, q_stride, t, threads):
    """Copy stacked rows ``[r0, r1)`` (row ``g N + i``: query ``i`` of head ``h0 + g`` of ``q_b``) to ``q_tile``."""
    D = q_b.shape[2]
    for idx in range(t, (r1 - r0) * D, threads):
        row = r0 + idx // D
        q_tile[(idx // D) * q_stride + idx % D] = q_b[h0 + row // N, row % N, idx % D]


@inline_device
def _split_keys(lo, hi, block_k, s, n_split):
    """Keys ``[a, e)`` of split ``s``: a run of whole tiles of ``[lo, hi)``."""
    n_tiles = (hi - lo + block_k - 1) // block_k
    return min(lo + n_tiles * s // n_split * block_k, hi), min(lo + n_tiles * (s + 1) // n_split * block_k, hi)


@cuda.jit(device=True)
def _row_logits(p_tile, p_at, c, tpr, row, keys, prm, opts):
    """The lane's logits of one key tile, in place, and their max.

    ``p_tile[p_at + c + tpr n]`` holds the lane's dot products; each becomes
    its logit (`entry`), ``-inf`` when removed, past the tile's ``jn`` keys
    or on a padding thread. ``row = (valid, b, h, i)``, ``keys = (j0, jn)``.
    The pipeline is long: the loop stays a loop.
    """
    valid, b, h, i = row
    j0, jn = keys
    neg_inf = opts[O_FOPTS][F_NEG_INF]
    tile_max = neg_inf
    for n in range(DECODE_REG_N):
        jj = c + tpr * n
        z = neg_inf
        if valid and jj < jn:
            z = entry(p_tile[p_at + jj], b, h, i, j0 + jj, prm, opts)[0]
        p_tile[p_at + jj] = z
        tile_max = max(tile_max, z)
    return tile_max


@inline_device
def _decode_tiles(smem, rows_blk, D, width, block_k):
    """The decode block's shared memory: ``(q_tile, k_tiles, v_tiles, p_tile)``.

    ``rows_blk`` query rows (row stride ``D + 1``), two K tiles of
    ``block_k`` keys (row stride ``D + 1``: the lanes of a row read
    different keys at one column, each in its own bank), two V tiles (row
    stride ``width``) and the ``rows_blk x block_k`` tile of ``p`` (row
    stride ``block_k + 1``). Two of each K and V tile: the next tile is
    copied while this one is used.
    """
    q_tile, at = carve(smem, 0, rows_blk * (D + 1))
    k_tiles, at = carve(smem, at, 2 * block_k * (D + 1))
    v_tiles, at = carve(smem, at, 2 * block_k * width)
    p_tile, at = carve(smem, at, rows_blk * (block_k + 1))
    return q_tile, k_tiles, v_tiles, p_tile


@cuda.jit(cache=True)
def _decode_kernel(q, k, v, opts, tpr, part_ms, part_acc):
    """One block per (batch, kv head, chunk of stacked rows, key split); split fastest.

    Writes the partial ``(max, sum)`` of each of its rows to ``part_ms[b, hk,
    s, r]`` and the unnormalised ``acc`` to ``part_acc[b, hk, s, r]``, a split
    with no key kept giving ``(-inf, 0, 0)``. The K and V tiles are
    double-buffered: tile ``n + 1`` is copied while tile ``n`` is used.
    """
    B, H, Hkv, N, M, D, Dv = problem_dims(q, k, v)
    group = H // Hkv
    n_split = part_ms.shape[2]
    threads, t, rows_blk, s, b, hk, r0, r1, rho, c = _decode_block(tpr, group * N, Hkv, n_split)
    block_k = tpr * DECODE_REG_N
    r = r0 + rho
    valid = r < r1
    rr = min(r, r1 - 1)  # padding threads take the chunk's last row (and write nothing)
    h = hk * group + rr // N
    i = rr % N
    width = min(max(Dv, 1), tpr * DECODE_ACC_COLS)

    smem = cuda.shared.array(0, dtype=q.dtype)
    q_tile, k_tiles, v_tiles, p_tile = _decode_tiles(smem, rows_blk, D, width, block_k)
    k_size = block_k * (D + 1)
    v_size = block_k * width

    fopts, zero, neg_inf = constants(opts)
    fill(q_tile, rows_blk * (D + 1), zero, t, threads)  # padding rows and the padding column
    cuda.syncthreads()
    _stage_rows(q[b], hk * group, N, r0, r1, q_tile, D + 1, t, threads)
    lo, hi = _chunk_keys(b, hk, group, r0, r1, N, M, opts)
    a, e = _split_keys(lo, hi, block_k, s, n_split)

    prm = bh_params(b, h, N, M, opts)
    lanes = lane_mask(t, threads)
    scores = cuda.local.array(DECODE_REG_N, q.dtype)
    acc = cuda.local.array(DECODE_ACC_COLS, q.dtype)
    q_at = rho * (D + 1)
    p_at = rho * (block_k + 1)
    k_bh = k[b, hk]
    v_bh = v[b, hk]
    for c0 in range(0, max(Dv, 1), width):
        wn = min(width, Dv - c0)
        run_max = neg_inf
        run_sum = zero
        for col in range(DECODE_ACC_COLS):
            acc[col] = zero
        cuda.syncthreads()  # the previous pass is done with the tiles
        if a < e:
            stage_kv(k_bh[a:], v_bh[a:, c0:], min(block_k, e - a), k_tiles[:k_size], v_tiles[:v_size], (D, D + 1, D),
                     (wn, width, wn), block_k, 1)
        n = 0
        for j0 in range(a, e, block_k):
            jn = min(block_k, e - j0)
            at = n % 2
            k_tile = k_tiles[at * k_size : (at + 1) * k_size]
            v_tile = v_tiles[at * v_size : (at + 1) * v_size]
            if j0 + block_k < e:  # the next tile into the other buffers, which the last iteration finished
                nxt = 1 - at
                stage_kv(k_bh[j0 + block_k :], v_bh[j0 + block_k :, c0:], min(block_k, e - j0 - block_k),
                         k_tiles[nxt * k_size : (nxt + 1) * k_size], v_tiles[nxt * v_size : (nxt + 1) * v_size],
                         (D, D + 1, D), (wn, width, wn), block_k, 1)
                async_copy.wait_prior()
            else:
                async_copy.wait_all()
            cuda.syncthreads()  # this tile (and q_tile) visible to the block
            _row_dot(q_tile, q_at, k_tile, D + 1, c, tpr, D, zero, scores)
            for m in range(DECODE_REG_N):
                p_tile[p_at + c + tpr * m] = scores[m]
            tile_max = _row_logits(p_tile, p_at, c, tpr, (valid, b, h, i), (j0, jn), prm, opts)
            consts = (zero, fopts[F_ONE], neg_inf)
            run_max, run_sum, alpha = row_step(p_tile, p_at + c, tpr, DECODE_REG_N, (run_max, run_sum), tile_max,
                                               lanes, consts)
            for col in range(DECODE_ACC_COLS):
                acc[col] *= alpha
            cuda.syncthreads()  # the row's p, written by its lanes, read by each
            _row_pv(p_tile, p_at, v_tile, width, jn, c, tpr, wn, zero, acc)
            cuda.syncthreads()  # every thread is done with this tile's buffers before they are refilled
            n += 1
        row_sum = group_sum(run_sum, tpr, lanes)
        if valid:
            if c0 == 0 and c == 0:
                part_ms[b, hk, s, r, 0] = run_max
                part_ms[b, hk, s, r, 1] = row_sum
            for col in range(DECODE_ACC_COLS):
                if c + tpr * col < wn:
                    part_acc[b, hk, s, r, c0 + c + tpr * col] = acc[col]


@cuda.jit(cache=True)
def _decode_merge_kernel(part_ms, part_acc, opts, out, lse):
    """One block per stacked row ``(b, hk, r)``: merge its splits in split order, ``beta`` added once.

    The split weights ``exp(m_s - m)`` go to shared memory (0 for a split
    that kept nothing); every thread computes the same ``m`` and ``l`` in the
    same order, and thread ``t`` finishes output columns ``t, t + blockDim, ...``.
    """
    B, H, N, Dv = out.shape
    Hkv = part_ms.shape[1]
    n_split = part_ms.shape[2]
    rows = part_ms.shape[3]
    group = H // Hkv
    threads = cuda.blockDim.x
    t = cuda.threadIdx.x
    r = cuda.blockIdx.x % rows
    hk = cuda.blockIdx.x // rows % Hkv
    b = cuda.blockIdx.x // (rows * Hkv)
    h = hk * group + r // N
    i = r % N

    fopts, zero, neg_inf = constants(opts)
    weight = cuda.shared.array(0, dtype=out.dtype)
    m = neg_inf
    for s in range(n_split):
        m = max(m, part_ms[b, hk, s, r, 0])
    for s in range(t, n_split, threads):
        w = zero
        if part_ms[b, hk, s, r, 0] > neg_inf:
            w = math.exp(part_ms[b, hk, s, r, 0] - m)
        weight[s] = w
    cuda.syncthreads()
    total = zero
    for s in range(n_split):
        total += part_ms[b, hk, s, r, 1] * weight[s]
    row_lse, num, den = finish_row(m, total, opts[O_BETA][h], fopts)
    if t == 0:
        lse[b, h, i] = row_lse
    for d in range(t, Dv, threads):
        x = zero
        for s in range(n_split):
            x += part_acc[b, hk, s, r, d] * weight[s]
        out[b, h, i, d] = (x * num) / den


KERNELS = {
    "_decode_kernel": _decode_kernel,
    "_decode_merge_kernel": _decode_merge_kernel,
}
