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

from elastic_np.cuda._runtime import config
from elastic_np.cuda._launch import forward as forward_launch
from elastic_np.cuda._runtime.config import REG_M, REG_N
from elastic_np.cuda._device.indices import P_COUNT
from elastic_np.cuda._runtime.gpu import blocks, configured, cuda_module, kernel_module, shared_limit


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


def tc_shared_elements(kind, warps, tile, width):
    """Elements of dynamic shared memory of a tensor-core backward block (`elastic_np.cuda._backward_tc`).

    ``dq``: Q and dO of its ``16 warps`` rows, two each of K and V; ``dkdv``:
    K and V of its ``16 warps`` keys, two each of Q, dO and of ``lse`` with
    ``delta``. Rows of ``width + TC_PAD``.
    """
    stride = width + config.TC_PAD
    rows = 16 * warps
    if kind == "dq":
        return 2 * rows * stride + 4 * tile * stride
    return 2 * rows * stride + 4 * tile * stride + 4 * tile


def tensor_core_plan(p):
    """``(dq, dkdv)``, each ``(kernel key, warps, shared bytes)``, or None where the SIMT backward runs.

    The tensor cores take the backward (``TC_BACKWARD``) where the forward
    ran on them without the general score pipeline
    (`elastic_np.cuda.forward.tensor_core_plan`), except with
    ``precision="tf32"``, whose backward keeps float32 (the contract); heads
    up to 128 columns. The warps per block halve from ``TC_BACKWARD_WARPS``
    until the shared memory fits.
    """
    if not config.TC_BACKWARD or p.precision == "tf32":
        return None
    forward = forward_launch.tensor_core_plan(p)
    if forward is None or forward[0][2]:
        return None
    B, H, Hkv, N, M, D, Dv = p.shape
    itemsize = p.dtype.itemsize
    width = next((w for w in (64, 128) if max(D, Dv) <= w), None)
    if width is None:
        return None
    limit = shared_limit()
    plans = []
    for kind in ("dq", "dkdv"):
        tile = config.TC_BACKWARD_TILES[kind, itemsize, width]
        warps = config.TC_BACKWARD_WARPS
        while warps > 1 and tc_shared_elements(kind, warps, tile, width) * itemsize > limit:
            warps //= 2
        shared = tc_shared_elements(kind, warps, tile, width) * itemsize
        if shared > limit:
            return None
        plans.append(((kind, tile, width), warps, shared))
    return tuple(plans)


def outputs(p):
    """The backward's outputs before any launch: ``dq``, ``dk``, ``dv``, ``delta`` on the device.

    Also ``"partials"``, the dq blocks' ``P_COUNT`` sums per (batch, head,
    query tile), zeros on the host until `launch` fills them, and
    ``"dbias"``, None until `launch` allocates it.
    """
    cuda = cuda_module()
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    plan = tensor_core_plan(p)
    dq_rows = tiles("dq", dtype.itemsize, D, Dv)[1] if plan is None else 16 * plan[0][1]
    return {
        "dq": cuda.device_array((B, H, N, D), dtype=dtype),
        "dk": cuda.device_array((B, Hkv, M, D), dtype=dtype),
        "dv": cuda.device_array((B, Hkv, M, Dv), dtype=dtype),
        "delta": cuda.device_array((B, H, N), dtype=dtype),
        "partials": np.zeros((B, H, blocks(N, dq_rows), P_COUNT), dtype=dtype),
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
    cuda = cuda_module()
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
    kernels = kernel_module("_simt.backward")
    B, H, Hkv, N, M, D, Dv = p.shape
    itemsize = p.dtype.itemsize
    q, k, v, dout, out, lse, dlse = arrays
    dout_lse_delta = (dout, lse, grads["delta"])
    if N > 0:
        threads = max(1, min(config.DELTA_THREADS, B * H * N))
        kernels.KERNELS["_backward_delta_kernel"][blocks(B * H * N, threads), threads](dout, out, dlse, opts, grads["delta"])
    plan = tensor_core_plan(p)
    if plan is not None:
        _launch_tensor_cores(p, opts, plan, arrays, grads)
        return
    if N > 0:
        threads, rows, cols = tiles("dq", itemsize, D, Dv)
        shared = shared_elements("dq", rows, cols, D, Dv) * itemsize
        configured(kernels.KERNELS["_backward_dq_kernel"], blocks(N, rows) * B * H, threads, shared)(
            q, k, v, opts, cols, dout_lse_delta, grads["dq"], grads["partials"], grads["dbias"]
        )
    if M > 0:
        threads, rows, cols = tiles("dkdv", itemsize, D, Dv)
        shared = shared_elements("dkdv", rows, cols, D, Dv) * itemsize
        configured(kernels.KERNELS["_backward_dkdv_kernel"], blocks(M, rows) * B * Hkv, threads, shared)(
            q, k, v, opts, cols, dout_lse_delta, grads["dk"], grads["dv"]
        )


def _launch_tensor_cores(p, opts, plan, arrays, grads):
    """Launch the tensor-core dq and dk/dv kernels (`tensor_core_plan`), after the delta kernel."""
    kernel = kernel_module("_tensor_core.backward").kernel
    B, H, Hkv, N, M, D, Dv = p.shape
    q, k, v, dout, out, lse, dlse = arrays
    dout_lse_delta = (dout, lse, grads["delta"])
    vector = forward_launch.vector_copies(p.dtype.itemsize, D, Dv, (q, k, v, dout))
    (dq_key, dq_warps, dq_shared), (kv_key, kv_warps, kv_shared) = plan
    if N > 0:
        configured(kernel(*dq_key), blocks(N, 16 * dq_warps) * B * H, 32 * dq_warps, dq_shared)(
            q, k, v, opts, vector, dout_lse_delta, grads["dq"], grads["partials"]
        )
    if M > 0:
        configured(kernel(*kv_key), blocks(M, 16 * kv_warps) * B * Hkv, 32 * kv_warps, kv_shared)(
            q, k, v, opts, vector, dout_lse_delta, grads["dk"], grads["dv"]
        )


def _launch_dbias(p, opts, bias_compact, arrays, grads):
    """Launch the dbias kernel of a broadcast bias, one block per entry of ``bias_compact``, after delta."""
    kernels = kernel_module("_simt.backward")
    B, H, Hkv, N, M, D, Dv = p.shape
    itemsize = p.dtype.itemsize
    q, k, v, dout, out, lse, dlse = arrays
    entries = math.prod(bias_compact)
    # the broadcast entries one compact entry stands for
    spans = (B * H * N * M) // entries
    threads = max(1, min(config.DBIAS_THREADS, spans))
    kernels.KERNELS["_backward_dbias_kernel"][entries, threads, 0, threads * itemsize](
        q, k, v, opts, (dout, lse, grads["delta"]), grads["dbias"]
    )
