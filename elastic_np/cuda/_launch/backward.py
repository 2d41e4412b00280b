"""The backward's launches: its outputs, the delta kernel, then the dq and dk/dv kernels the plan picks, and dbias.

Imports no ``numba.cuda``: the kernel modules are imported on first use
(`elastic_np.cuda._runtime.gpu.kernel_module`). The entry point,
`elastic_np.cuda._launch.api.backward`, allocates with `outputs`, launches
with `launch` and forms the scalar gradients on the host.
"""

import math

import numpy as np

from elastic_np.cuda._device.indices import P_COUNT
from elastic_np.cuda._launch import layouts, plan
from elastic_np.cuda._runtime import config
from elastic_np.cuda._runtime.gpu import blocks, configured, cuda_module, kernel_module


def outputs(p):
    """The backward's outputs before any launch: ``dq``, ``dk``, ``dv``, ``delta`` on the device.

    Also ``"partials"``, the dq blocks' ``P_COUNT`` sums per (batch, head,
    query tile), zeros on the host until `launch` fills them, and
    ``"dbias"``, None until `launch` allocates it.
    """
    cuda = cuda_module()
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    tensor_cores = plan.tensor_core_backward(p)
    dq_rows = plan.backward_tiles("dq", dtype.itemsize, D, Dv)[1] if tensor_cores is None else 16 * tensor_cores[0][1]
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

    ``opts`` and ``bias_compact`` come from `launch_options`,
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
        delta_kernel = kernels.KERNELS["_backward_delta_kernel"]
        delta_kernel[blocks(B * H * N, threads), threads](dout, out, dlse, opts, grads["delta"])
    tensor_cores = plan.tensor_core_backward(p)
    if tensor_cores is not None:
        _launch_tensor_cores(p, opts, tensor_cores, arrays, grads)
        return
    if N > 0:
        threads, rows, cols = plan.backward_tiles("dq", itemsize, D, Dv)
        shared = layouts.backward_elements("dq", rows, cols, D, Dv) * itemsize
        configured(kernels.KERNELS["_backward_dq_kernel"], blocks(N, rows) * B * H, threads, shared)(
            q, k, v, opts, cols, dout_lse_delta, grads["dq"], grads["partials"], grads["dbias"]
        )
    if M > 0:
        threads, rows, cols = plan.backward_tiles("dkdv", itemsize, D, Dv)
        shared = layouts.backward_elements("dkdv", rows, cols, D, Dv) * itemsize
        configured(kernels.KERNELS["_backward_dkdv_kernel"], blocks(M, rows) * B * Hkv, threads, shared)(
            q, k, v, opts, cols, dout_lse_delta, grads["dk"], grads["dv"]
        )


def _launch_tensor_cores(p, opts, tensor_cores, arrays, grads):
    """Launch the tensor-core dq and dk/dv kernels (`plan.tensor_core_backward`), after the delta kernel."""
    kernel = kernel_module("_tensor_core.backward").kernel
    B, H, Hkv, N, M, D, Dv = p.shape
    q, k, v, dout, out, lse, dlse = arrays
    dout_lse_delta = (dout, lse, grads["delta"])
    vector = plan.vector_copies(p.dtype.itemsize, D, Dv, (q, k, v, dout))
    (dq_key, dq_warps, dq_shared), (kv_key, kv_warps, kv_shared) = tensor_cores
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
