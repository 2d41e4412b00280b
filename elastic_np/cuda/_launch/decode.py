"""The decode kernels' host side: when they run, with which geometry, their launch.

The host half of `elastic_np.cuda._decode` (the kernels, and the plan:
stacked rows, split-KV, the merge). Imports no ``numba.cuda``: `takes`,
`geometry`, `splits` and `shared_elements` are plain arithmetic on the
shape and the config (`elastic_np.cuda._config`), which the resource report
(`elastic_np.cuda._compile`) and the tests use without a GPU; `launch`
imports the kernel module on first use
(`elastic_np.cuda._host._kernel_module`). The backend's entry point,
`elastic_np.cuda._api.forward`, calls `launch` when `takes` says so.
"""

from elastic_np.cuda._runtime import config
from elastic_np.cuda._runtime.config import DECODE_ACC_COLS, DECODE_REG_N
from elastic_np.cuda._runtime.gpu import configured, cuda_module, kernel_module, pow2_at_least, shared_limit


def takes(p):
    """True when `elastic_np.cuda.forward` runs this problem through the decode kernel."""
    B, H, Hkv, N, M, D, Dv = p.shape
    return 1 <= N <= config.DECODE_MAX_QUERIES and (H // Hkv) * N <= config.DECODE_MAX_ROWS


def shared_elements(rows_blk, tpr, D, Dv):
    """Dynamic shared memory of a decode block, in elements: queries, two K and two V tiles, the p tile.

    The layout of `elastic_np.cuda._decode._decode_tiles`.
    """
    return rows_blk * (D + 1) + _kv_elements(tpr, D, Dv) + rows_blk * (tpr * DECODE_REG_N + 1)


def _kv_elements(tpr, D, Dv):
    """The shared memory of the two K and two V tiles of a decode block, in elements."""
    block_k = tpr * DECODE_REG_N
    width = min(max(Dv, 1), tpr * DECODE_ACC_COLS)
    return 2 * block_k * (D + 1 + width)


def geometry(rows, D, Dv, itemsize):
    """``(rows_blk, tpr)``: stacked rows per block and lanes per row.

    ``tpr`` starts as the fewest lanes whose accumulators hold the value head
    in one pass (at most ``DECODE_LANES``), the block takes as many rows as
    ``DECODE_THREADS`` allows, and spare threads go to more lanes per row
    (longer K/V tiles). Then, while the shared memory exceeds the limit
    (`elastic_np.cuda._host.shared_limit`, at most ``DECODE_MAX_SHARED_BYTES``),
    the larger of the K/V tiles and the query tile is halved.
    """
    lanes, threads = config.DECODE_LANES, config.DECODE_THREADS
    if lanes < 1 or lanes > 32 or lanes & (lanes - 1):
        raise ValueError(f"DECODE_LANES={lanes} must be a power of two of at most 32")
    if threads < 1:
        raise ValueError(f"DECODE_THREADS={threads} must be at least 1")
    tpr = min(lanes, pow2_at_least(-(-max(Dv, 1) // DECODE_ACC_COLS)))
    tpr = min(tpr, pow2_at_least(threads + 1) // 2)  # the largest power of two <= threads
    chunks = -(-rows // max(1, threads // tpr))
    rows_blk = -(-rows // chunks)  # as even as the chunks allow
    while 2 * tpr <= lanes and rows_blk * 2 * tpr <= threads:
        tpr *= 2
    limit = shared_limit()
    if config.DECODE_MAX_SHARED_BYTES is not None:
        limit = min(limit, config.DECODE_MAX_SHARED_BYTES)
    while shared_elements(rows_blk, tpr, D, Dv) * itemsize > limit:
        if tpr > 1 and (_kv_elements(tpr, D, Dv) >= rows_blk * (D + 1) or rows_blk == 1):
            tpr //= 2
        elif rows_blk > 1:
            rows_blk = -(-rows_blk // 2)
        else:
            raise config.shared_memory_error(D, Dv, limit)
    return rows_blk, tpr


def splits(blocks, M):
    """Key splits per (batch, kv head, row chunk) when ``blocks`` such blocks are too few (shape only)."""
    if blocks == 0 or blocks >= config.DECODE_MIN_BLOCKS:
        return 1
    wanted = -(-config.DECODE_MIN_BLOCKS // blocks)
    return max(1, min(wanted, M // max(1, config.DECODE_MIN_SPLIT_KEYS)))


def launch(p, opts, q, k, v, out, lse):
    """Launch the decode and merge kernels of problem ``p`` into ``out``, ``lse``; return the key splits.

    ``opts`` comes from ``_api._launch_options``.
    """
    cuda = cuda_module()
    kernels = kernel_module("_simt.decode")
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    rows = (H // Hkv) * N
    rows_blk, tpr = geometry(rows, D, Dv, dtype.itemsize)
    chunks = -(-rows // rows_blk)
    n_split = splits(B * Hkv * chunks, M)
    part_ms = cuda.device_array((B, Hkv, n_split, rows, 2), dtype=dtype)
    part_acc = cuda.device_array((B, Hkv, n_split, rows, max(Dv, 1)), dtype=dtype)
    shared = shared_elements(rows_blk, tpr, D, Dv) * dtype.itemsize
    blocks = B * Hkv * chunks * n_split
    configured(kernels.KERNELS["_decode_kernel"], blocks, rows_blk * tpr, shared)(q, k, v, opts, tpr, part_ms, part_acc)
    threads = max(1, min(config.DECODE_MERGE_THREADS, Dv))
    kernels.KERNELS["_decode_merge_kernel"][B * Hkv * rows, threads, 0, n_split * dtype.itemsize](
        part_ms, part_acc, opts, out, lse
    )
    return n_split
