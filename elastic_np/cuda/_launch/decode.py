"""The decode kernels' launch: the geometry and key splits the plan gives, the partials, the merge.

Imports no ``numba.cuda``: the kernel module is imported on first use
(`elastic_np.cuda._runtime.gpu.kernel_module`). The entry point,
`elastic_np.cuda._launch.api.forward`, calls `launch` when
`elastic_np.cuda._launch.plan.takes_decode` says so.
"""

from elastic_np.cuda._launch import layouts, plan
from elastic_np.cuda._runtime import config
from elastic_np.cuda._runtime.gpu import configured, cuda_module, kernel_module


def launch(p, opts, q, k, v, out, lse):
    """Launch the decode and merge kernels of problem ``p`` into ``out``, ``lse``; return the key splits.

    ``opts`` comes from `launch_options`.
    """
    cuda = cuda_module()
    kernels = kernel_module("_simt.decode")
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    rows = (H // Hkv) * N
    rows_blk, tpr = plan.decode_geometry(rows, D, Dv, dtype.itemsize)
    chunks = -(-rows // rows_blk)
    n_split = plan.decode_splits(B * Hkv * chunks, M)
    part_ms = cuda.device_array((B, Hkv, n_split, rows, 2), dtype=dtype)
    part_acc = cuda.device_array((B, Hkv, n_split, rows, max(Dv, 1)), dtype=dtype)
    shared = layouts.decode_elements(rows_blk, tpr, D, Dv) * dtype.itemsize
    blocks = B * Hkv * chunks * n_split
    configured(kernels.KERNELS["_decode_kernel"], blocks, rows_blk * tpr, shared)(q, k, v, opts, tpr, part_ms, part_acc)
    threads = max(1, min(config.DECODE_MERGE_THREADS, Dv))
    kernels.KERNELS["_decode_merge_kernel"][B * Hkv * rows, threads, 0, n_split * dtype.itemsize](
        part_ms, part_acc, opts, out, lse
    )
    return n_split
