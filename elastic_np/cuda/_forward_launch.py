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

from elastic_np.cuda import _config as config
from elastic_np.cuda._host import _kernel_module, blocks, configured, pow2_at_least, shared_limit


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


def launch(p, opts, q, k, v, out, lse):
    """Launch the flash forward of problem ``p`` into ``out``, ``lse`` (``opts`` from ``_api._launch_options``)."""
    B, H, Hkv, N, M, D, Dv = p.shape
    itemsize = p.dtype.itemsize
    threads, tile = tiles(itemsize, D, Dv)
    shared = shared_elements(threads, tile, D, Dv) * itemsize
    block_q, _ = geometry(threads, tile)
    kernel = _kernel_module("_forward")._forward_kernel
    configured(kernel, blocks(N, block_q) * B * H, threads, shared)(q, k, v, opts, tile, out, lse)
