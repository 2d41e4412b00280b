"""The flash forward's host side: its tiles, its shared memory, its launch.

The host half of `elastic_np.cuda._forward` (the kernel). Imports no
``numba.cuda``: `tiles`, `geometry` and `shared_elements` are plain
arithmetic on the config (`elastic_np.cuda._config`), which the resource
report (`elastic_np.cuda._compile`) and the tests use without a GPU;
`launch` imports the kernel module on first use
(`elastic_np.cuda._host._kernel_module`). The backend's entry point,
`elastic_np.cuda._api.forward`, calls `launch` for every forward that is not
a decoding shape (those go to `elastic_np.cuda._decode_launch`).
"""

from elastic_np.cuda._runtime import config
from elastic_np.cuda._runtime.gpu import (
    blocks, compute_capability, configured, kernel_module, pow2_at_least, shared_limit, simulator,
)


def geometry(threads, tile):
    """``(block_q, tpr)`` of a forward block of ``threads`` threads and key tile ``tile``."""
    tpr = tile // config.REG_N
    return threads // tpr * config.REG_M, tpr


def shared_elements(threads, tile, D, Dv):
    """Elements of dynamic shared memory one forward block uses (see its layout)."""
    block_q, tpr = geometry(threads, tile)
    width = min(max(Dv, 1), tpr * config.ACC_COLS)
    return block_q * (D + 1) + tile * max(D + 1, width) + block_q * (tile + 1) + 3 * block_q * tpr


def tiles(itemsize, D, Dv):
    """``(threads, key tile)`` of the forward, from the config, shrunk until the shared memory fits.

    The key tile gives a row the fewest lanes whose accumulators hold the value
    head in one pass, between ``FORWARD_MIN_BLOCK_K`` and ``FORWARD_BLOCK_K`` keys.
    """
    block_q, block_k = config.FORWARD_BLOCK_Q, config.FORWARD_BLOCK_K
    tpr = block_k // config.REG_N
    if block_k % config.REG_N or tpr < 1 or tpr > 32 or tpr & (tpr - 1):
        raise ValueError(
            f"FORWARD_BLOCK_K={block_k} must be REG_N={config.REG_N} times a power of two of at most 32"
        )
    if block_q % config.REG_M or block_q < config.REG_M:
        raise ValueError(f"FORWARD_BLOCK_Q={block_q} must be a multiple of REG_M={config.REG_M}")

    def threads():
        return (block_q // config.REG_M) * (block_k // config.REG_N)

    one_pass = config.REG_N * pow2_at_least(-(-max(Dv, 1) // config.ACC_COLS))
    block_k = min(block_k, max(one_pass, config.FORWARD_MIN_BLOCK_K))
    limit = shared_limit()
    while shared_elements(threads(), block_k, D, Dv) * itemsize > limit:
        if block_k > config.REG_N and (block_k >= block_q or block_q <= config.REG_M):
            block_k //= 2
        elif block_q > config.REG_M and block_q % (2 * config.REG_M) == 0:
            block_q //= 2
        else:
            raise config.shared_memory_error(D, Dv, limit)
    return threads(), block_k


def tc_shared_elements(warps, block_k, width_v, D):
    """Elements of dynamic shared memory of a tensor-core forward block (Q, two of K or the scratch, two of V)."""
    stride = -(-max(D, 1) // 8) * 8 + config.TC_PAD
    block_q = 16 * warps
    return block_q * stride + 2 * max(block_k * stride, block_q * (block_k + 1)) + 2 * block_k * (width_v + config.TC_PAD)


def needs_general(p):
    """Whether problem ``p`` has an option the simple tensor-core kernels do not take (mask, bias, NVM, ...)."""
    return (p.mask is not None or p.bias is not None or p.nvm or p.sigma is not None or p.alibi is not None
            or p.softcap is not None)


def tensor_core_geometry(itemsize, D, Dv, general=False):
    """``(kernel key, warps, shared bytes)`` of the tensor-core forward, or None where its tiles cannot fit.

    The key is ``(keys per tile, value columns per pass, general)`` of
    `elastic_np.cuda._forward_tc.KERNELS`: key tiles of ``TC_KEYS[dtype]``
    (32 with the general pipeline, whose calls cost registers), value columns
    in passes of 128 for float32 heads over 64, else 64. The warps per block
    (16 query rows each) halve from ``TC_FORWARD_WARPS`` until the shared
    memory fits.
    """
    block_k = 32 if general else config.TC_KEYS[itemsize]
    width_v = 128 if Dv > 64 and itemsize == 4 else 64
    warps = config.TC_FORWARD_WARPS
    limit = shared_limit()
    while warps >= 1:
        shared = tc_shared_elements(warps, block_k, width_v, D) * itemsize
        if shared <= limit:
            return (block_k, width_v, bool(general)), warps, shared
        warps //= 2
    return None


def tensor_core_plan(p):
    """The tensor-core forward's `tensor_core_geometry` for problem ``p``, or None where the SIMT kernel runs.

    The tensor cores take float64 and ``precision="tf32"`` (the float32
    default only with ``TC_FLOAT32``), on sm_80 and later (and the
    simulator), unless ``TENSOR_CORES`` is off or the tiles cannot fit.
    """
    itemsize = p.dtype.itemsize
    if not config.TENSOR_CORES or not (itemsize == 8 or p.precision == "tf32" or config.TC_FLOAT32):
        return None
    if compute_capability() < (8, 0):
        return None
    B, H, Hkv, N, M, D, Dv = p.shape
    return tensor_core_geometry(itemsize, D, Dv, needs_general(p))


def vector_copies(itemsize, D, Dv, arrays):
    """Whether the tensor-core forward copies 16 bytes at a time: rows of whole, 16-byte aligned units.

    ``arrays`` are the device arrays ``q``, ``k``, ``v`` (C-contiguous);
    ``TC_VECTOR_COPY`` False copies element by element.
    """
    unit = 16 // itemsize
    if not config.TC_VECTOR_COPY or D % unit or Dv % unit:
        return False
    if simulator():
        return True
    return all(a.__cuda_array_interface__["data"][0] % 16 == 0 for a in arrays)


def launch(p, opts, q, k, v, out, lse):
    """Launch the flash forward of problem ``p`` into ``out``, ``lse`` (``opts`` from ``_api._launch_options``)."""
    B, H, Hkv, N, M, D, Dv = p.shape
    itemsize = p.dtype.itemsize
    plan = tensor_core_plan(p)
    if plan is not None:
        key, warps, shared = plan
        kernel = kernel_module("_tensor_core.forward").KERNELS[key]
        vector = vector_copies(itemsize, D, Dv, (q, k, v))
        configured(kernel, blocks(N, 16 * warps) * B * H, 32 * warps, shared)(q, k, v, opts, vector, out, lse)
        return
    threads, tile = tiles(itemsize, D, Dv)
    shared = shared_elements(threads, tile, D, Dv) * itemsize
    block_q, _ = geometry(threads, tile)
    kernel = kernel_module("_simt.forward").KERNELS["_forward_kernel"]
    configured(kernel, blocks(N, block_q) * B * H, threads, shared)(q, k, v, opts, tile, out, lse)
