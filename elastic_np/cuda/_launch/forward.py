"""The flash forward's launch: the tensor-core kernel or the SIMT one, as the plan says.

Imports no ``numba.cuda``: the kernel modules are imported on first use
(`elastic_np.cuda._runtime.gpu.kernel_module`). The entry point,
`elastic_np.cuda._launch.api.forward`, calls `launch` for every forward that
is not a decoding shape (those go to `elastic_np.cuda._launch.decode`).
"""

from elastic_np.cuda._launch import layouts, plan
from elastic_np.cuda._runtime.gpu import blocks, configured, kernel_module


def launch(p, opts, q, k, v, out, lse):
    """Launch the flash forward of problem ``p`` into ``out``, ``lse`` (``opts`` from `launch_options`)."""
    B, H, Hkv, N, M, D, Dv = p.shape
    itemsize = p.dtype.itemsize
    tensor_cores = plan.tensor_core_forward(p)
    if tensor_cores is not None:
        key, warps, shared = tensor_cores
        kernel = kernel_module("_tensor_core.forward").KERNELS[key]
        vector = plan.vector_copies(itemsize, D, Dv, (q, k, v))
        configured(kernel, blocks(N, 16 * warps) * B * H, 32 * warps, shared)(q, k, v, opts, vector, out, lse)
        return
    threads, tile = plan.forward_tiles(itemsize, D, Dv)
    shared = layouts.forward_elements(threads, tile, D, Dv) * itemsize
    block_q, _ = layouts.forward_geometry(threads, tile)
    kernel = kernel_module("_simt.forward").KERNELS["_forward_kernel"]
    configured(kernel, blocks(N, block_q) * B * H, threads, shared)(q, k, v, opts, tile, out, lse)
