"""The SIMT kernels' register micro-tiles: the block's place, the products on registers, the scored entries.

A block's threads form row groups of ``tpr`` lanes (`tile_block`); each
thread holds a ``REG_M x REG_N`` micro-tile of scores and ``REG_M x
ACC_COLS`` accumulators in registers (the config's compile-time sizes).
"""

from numba import cuda

from elastic_np.cuda._device.basics import inline_device
from elastic_np.cuda._device.indices import F_NEG_INF, F_ZERO, O_FOPTS
from elastic_np.cuda._device.score import entry
from elastic_np.cuda._device.tiles import carve
from elastic_np.cuda._runtime.config import ACC_COLS, REG_M, REG_N


@inline_device
def tile_block(rows, heads, cols):
    """The place of a micro-tile kernel's block and thread: a block per (batch * head, tile of rows), tiles fastest.

    ``rows`` are what the block owns a tile of (queries for the forward and
    ``dq`` kernels, keys for ``dk``/``dv``), ``heads`` the heads of its grid,
    ``cols`` the length of the tiles it loops over. The block's threads form
    groups of ``tpr = cols / REG_N`` lanes; each group owns ``REG_M`` rows.
    Returns ``(threads, t, tpr, block_rows, row0, c, tile, b, h, r0, r1)``:
    thread ``t`` of ``threads`` is lane ``c`` of the group whose rows start at
    ``row0`` in the block's ``block_rows``, and the block holds rows ``[r0,
    r1)``, tile ``tile``, of batch ``b``, head ``h``.
    """
    threads = cuda.blockDim.x
    t = cuda.threadIdx.x
    tpr = cols // REG_N
    block_rows = threads // tpr * REG_M
    row0 = t // tpr * REG_M
    c = t % tpr
    n_tiles = (rows + block_rows - 1) // block_rows
    tile = cuda.blockIdx.x % n_tiles
    b = cuda.blockIdx.x // n_tiles // heads
    h = cuda.blockIdx.x // n_tiles % heads
    r0 = tile * block_rows
    return threads, t, tpr, block_rows, row0, c, tile, b, h, r0, min(r0 + block_rows, rows)


@inline_device
def flash_tiles(smem, rows, D, width, block_k):
    """The tiles the forward and decode kernels start their shared memory with, and their strides.

    ``(q_tile, q_stride, kv_tile, kv_stride, p_tile, p_stride, end)``: ``rows``
    query rows (row stride ``D + 1``), the K/V tile of ``block_k`` keys (K,
    then V's ``width`` columns of a pass, in the same buffer; row stride
    ``max(D + 1, width)``) and the ``rows x block_k`` tile of ``p`` (row
    stride ``block_k + 1``); ``end`` is the offset past them.
    """
    q_stride = D + 1
    kv_stride = max(D + 1, width)
    p_stride = block_k + 1
    q_tile, at = carve(smem, 0, rows * q_stride)
    kv_tile, at = carve(smem, at, block_k * kv_stride)
    p_tile, at = carve(smem, at, rows * p_stride)
    return q_tile, q_stride, kv_tile, kv_stride, p_tile, p_stride, at


@cuda.jit(device=True)
def tile_entry(tile, stride, micro, queries, keys, r, n, prm, opts):
    """Entry ``(r, n)`` of the thread's micro-tile of a key tile, scored: ``(at, i, j, z, s, cap_slope, f, u)``.

    ``micro = (row0, c, tpr)`` (`tile_block`), ``queries = (b, h, i_first,
    N)``, ``keys = (j0, jn)``: the entry is row ``row0 + r`` and key ``c +
    tpr n`` of the tile, query ``i = i_first + r`` and key ``j``; ``tile[at]``
    holds its dot product. The rest is `entry`'s tuple, with ``z = -inf``
    past the tile's ``jn`` keys or the ``N`` queries. The forward's softmax
    and the ``dq`` kernel's recomputation score their entries here alike.
    """
    row0, c, tpr = micro
    b, h, i_first, N = queries
    j0, jn = keys
    jj = c + tpr * n
    at = (row0 + r) * stride + jj
    i = i_first + r
    j = j0 + jj
    if jj < jn and i < N:
        z, s, cap_slope, f, u = entry(tile[at], b, h, i, j, prm, opts)
        return at, i, j, z, s, cap_slope, f, u
    fopts = opts[O_FOPTS]
    zero = fopts[F_ZERO]
    return at, i, j, fopts[F_NEG_INF], zero, zero, zero, zero


@inline_device
def store_tile(scores, tile, stride, micro):
    """``tile[row0 + r, c + tpr n] = scores[r, n]`` (row stride ``stride``): a register micro-tile to shared memory.

    ``micro = (row0, c, tpr)`` is the thread's place in the block's micro-tiles (`tile_block`).
    """
    row0, c, tpr = micro
    for r in range(REG_M):
        for n in range(REG_N):
            tile[(row0 + r) * stride + c + tpr * n] = scores[r, n]


@inline_device
def _load_rows(dst, tile, stride, row0, col):
    """``dst[r] = tile[row0 + r, col]`` for the thread's ``REG_M`` rows (row stride ``stride``)."""
    for r in range(REG_M):
        dst[r] = tile[(row0 + r) * stride + col]


@inline_device
def _outer_add(acc, a, b, cols):
    """``acc[r, e] += a[r] b[e]`` for ``r < REG_M``, ``e < cols``: a rank-one update of a register micro-tile."""
    for r in range(REG_M):
        for e in range(cols):
            acc[r, e] += a[r] * b[e]


@inline_device
def tile_dot(q_tile, q_stride, k_tile, k_stride, D, micro, zero, scores):
    """``scores[r, n] = q_tile[row0 + r] . k_tile[c + tpr n]``: a ``REG_M x REG_N`` register micro-tile.

    ``micro = (row0, c, tpr)``. Per step of ``d`` a thread reads ``REG_M``
    query and ``REG_N`` key values from shared memory and does ``REG_M REG_N``
    multiply-adds on registers.
    """
    row0, c, tpr = micro
    for r in range(REG_M):
        for n in range(REG_N):
            scores[r, n] = zero
    qv = cuda.local.array(REG_M, q_tile.dtype)
    kv = cuda.local.array(REG_N, q_tile.dtype)
    for d in range(D):
        _load_rows(qv, q_tile, q_stride, row0, d)
        for n in range(REG_N):
            kv[n] = k_tile[(c + tpr * n) * k_stride + d]
        _outer_add(scores, qv, kv, REG_N)


@inline_device
def tile_pv(p_tile, p_stride, v_tile, v_stride, jn, wn, micro, zero, acc):
    """``acc[r, e] += sum_jj p_tile[row0 + r, jj] v_tile[jj, c + tpr e]``, a ``REG_M x ACC_COLS`` micro-tile.

    ``micro = (row0, c, tpr)``; ``jn`` rows of ``v_tile``, columns past ``wn`` read as 0.
    """
    row0, c, tpr = micro
    pv = cuda.local.array(REG_M, p_tile.dtype)
    vv = cuda.local.array(ACC_COLS, p_tile.dtype)
    for jj in range(jn):
        _load_rows(pv, p_tile, p_stride, row0, jj)
        for e in range(ACC_COLS):
            col = c + tpr * e
            vv[e] = v_tile[jj * v_stride + col] if col < wn else zero
        _outer_add(acc, pv, vv, ACC_COLS)
