"""The backward's host side: its tiles, its shared memory, its launches.

The host half of `elastic_np.cuda._backward` (the kernels). Imports no
``numba.cuda``: `tiles` and `shared_elements` are plain arithmetic on the
config (`elastic_np.cuda._config`), which the resource report
(`elastic_np.cuda._compile`) and the tests use without a GPU; `launch`
imports the kernel module on first use
(`elastic_np.cuda._host._kernel_module`). The backend's entry point,
`elastic_np.cuda._api.backward`, allocates with `outputs`, launches with
`launch` and forms the scalar gradients on the host.

Tile sizes are runtime values (`tiles`, from the config, halved until the
shared memory fits `elastic_np.cuda._host.shared_limit`); the micro-tile
sizes are the forward's compile-time ``REG_M``, ``REG_N``, ``ACC_COLS``.
"""

import math

import numpy as np

from elastic_np.cuda import _config as config
from elastic_np.cuda._config import REG_M, REG_N
from elastic_np.cuda._host import _cuda, _kernel_module, blocks, configured, shared_limit


def shared_elements(kind, rows, cols, D, Dv):
    """Dynamic shared memory of a ``"dq"`` or ``"dkdv"`` block, in elements.

    ``rows`` is the block's own tile (queries for ``dq``, keys for ``dkdv``),
    ``cols`` the tile it loops over.
    """
    tpr = cols // REG_N
    if kind == "dq":
        # q, dout, s/ds, dp tiles; lse, delta; four compensated sums per (row, lane); K, V tiles
        return rows * (D + 1 + Dv + 1 + 2 * (cols + 1) + 2 + 4 * tpr) + cols * (D + 1 + Dv + 1)
    # K, V tiles; p, ds tiles; Q, dout tiles; lse, delta
    return rows * (D + 1 + Dv + 1 + 2 * (cols + 1)) + cols * (D + 1 + Dv + 1 + 2)


def tiles(kind, itemsize, D, Dv):
    """``(threads, rows, cols)`` of a ``"dq"`` or ``"dkdv"`` block, the larger tile halved until it fits.

    ``dq``: ``rows = DQ_BLOCK_Q`` queries, ``cols = DQ_BLOCK_K`` keys per tile;
    ``dkdv``: ``rows = DKDV_BLOCK_K`` keys, ``cols = DKDV_BLOCK_Q`` queries per
    tile. ``rows`` must be a multiple of ``REG_M``, ``cols`` of ``REG_N``;
    the block has ``(rows / REG_M) (cols / REG_N)`` threads.
    """
    names = ("DQ_BLOCK_Q", "DQ_BLOCK_K") if kind == "dq" else ("DKDV_BLOCK_K", "DKDV_BLOCK_Q")
    rows, cols = (getattr(config, name) for name in names)
    if rows % REG_M or rows < REG_M:
        raise ValueError(f"{names[0]}={rows} must be a positive multiple of REG_M={REG_M}")
    if cols % REG_N or cols < REG_N:
        raise ValueError(f"{names[1]}={cols} must be a positive multiple of REG_N={REG_N}")
    limit = shared_limit()
    while shared_elements(kind, rows, cols, D, Dv) * itemsize > limit:
        if cols > REG_N and cols % (2 * REG_N) == 0 and (cols >= rows or rows % (2 * REG_M)):
            cols //= 2
        elif rows > REG_M and rows % (2 * REG_M) == 0:
            rows //= 2
        else:
            raise config.shared_memory_error(D, Dv, limit)
    return (rows // REG_M) * (cols // REG_N), rows, cols


def outputs(p):
    """The backward's outputs before any launch: ``dq``, ``dk``, ``dv``, ``delta`` on the device.

    Also ``"partials"``, the dq blocks' ``P_COUNT`` sums per (batch, head,
    query tile), zeros on the host until `launch` fills them, and
    ``"dbias"``, None until `launch` allocates it.
    """
    cuda = _cuda()
    partial_sums = _kernel_module("_device").P_COUNT
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    dq_rows = tiles("dq", dtype.itemsize, D, Dv)[1]
    return {
        "dq": cuda.device_array((B, H, N, D), dtype=dtype),
        "dk": cuda.device_array((B, Hkv, M, D), dtype=dtype),
        "dv": cuda.device_array((B, Hkv, M, Dv), dtype=dtype),
        "delta": cuda.device_array((B, H, N), dtype=dtype),
        "partials": np.zeros((B, H, blocks(N, dq_rows), partial_sums), dtype=dtype),
        "dbias": None,
    }


def launch(p, opts, bias_compact, arrays, grads):
    """Launch the backward's kernels on a non-empty problem, filling ``grads`` (from `outputs`).

    ``opts`` and ``bias_compact`` come from ``_api._launch_options``,
    ``arrays = (q, k, v, dout, out, lse, dlse)`` are on the device. A full
    bias's ``dbias`` is written by the dq kernel; a broadcast bias's by the
    dbias kernel (`_launch_dbias`), flat, in its compact shape. The
    ``"partials"`` come back to the host.
    """
    cuda = _cuda()
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    full = bias_compact == (B, H, N, M)
    if bias_compact is not None:
        # full: the dq kernel writes every entry; broadcast: one entry per block (`_launch_dbias`)
        grads["dbias"] = cuda.device_array(bias_compact if full else math.prod(bias_compact), dtype=dtype)
    partials = cuda.device_array(grads["partials"].shape, dtype=dtype)
    written = dict(grads, partials=partials,
                   dbias=grads["dbias"] if full else cuda.device_array((1, 1, 1, 1), dtype=dtype))
    _launch_kernels(p, opts, arrays, written)
    if N > 0:
        grads["partials"] = partials.copy_to_host()
    if bias_compact is not None and not full:
        if N * M > 0:
            _launch_dbias(p, opts, bias_compact, arrays, grads)
        else:
            grads["dbias"] = None


def _launch_kernels(p, opts, arrays, grads):
    """Launch the delta, dq and dk/dv kernels.

    ``grads`` holds the device arrays they write: ``"delta"``, ``"dq"``,
    ``"dk"``, ``"dv"``, ``"partials"`` (the dq blocks' sums) and ``"dbias"``
    (a full bias's, else a dummy).
    """
    kernels = _kernel_module("_backward")
    B, H, Hkv, N, M, D, Dv = p.shape
    itemsize = p.dtype.itemsize
    q, k, v, dout, out, lse, dlse = arrays
    dout_lse_delta = (dout, lse, grads["delta"])
    if N > 0:
        threads = max(1, min(config.DELTA_THREADS, B * H * N))
        kernels._backward_delta_kernel[blocks(B * H * N, threads), threads](dout, out, dlse, opts, grads["delta"])
        threads, rows, cols = tiles("dq", itemsize, D, Dv)
        shared = shared_elements("dq", rows, cols, D, Dv) * itemsize
        configured(kernels._backward_dq_kernel, blocks(N, rows) * B * H, threads, shared)(
            q, k, v, opts, cols, dout_lse_delta, grads["dq"], grads["partials"], grads["dbias"]
        )
    if M > 0:
        threads, rows, cols = tiles("dkdv", itemsize, D, Dv)
        shared = shared_elements("dkdv", rows, cols, D, Dv) * itemsize
        configured(kernels._backward_dkdv_kernel, blocks(M, rows) * B * Hkv, threads, shared)(
            q, k, v, opts, cols, dout_lse_delta, grads["dk"], grads["dv"]
        )


def _launch_dbias(p, opts, bias_compact, arrays, grads):
    """Launch the dbias kernel of a broadcast bias, one block per entry of ``bias_compact``, after delta."""
    kernels = _kernel_module("_backward")
    B, H, Hkv, N, M, D, Dv = p.shape
    itemsize = p.dtype.itemsize
    q, k, v, dout, out, lse, dlse = arrays
    entries = math.prod(bias_compact)
    # the broadcast entries one compact entry stands for
    spans = (B * H * N * M) // entries
    threads = max(1, min(config.DBIAS_THREADS, spans))
    kernels._backward_dbias_kernel[entries, threads, 0, threads * itemsize](
        q, k, v, opts, (dout, lse, grads["delta"]), grads["dbias"]
    )
