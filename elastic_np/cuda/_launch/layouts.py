"""Each kernel's block as the host sizes it: its rows and lanes, and the dynamic shared memory its tiles take.

Plain arithmetic on tile sizes and the config
(`elastic_np.cuda._runtime.config`) that mirrors how each kernel carves its
one dynamic shared-memory array (`elastic_np.cuda._simt`,
`elastic_np.cuda._tensor_core`), in elements of the kernel's dtype. The plan
(`elastic_np.cuda._launch.plan`) shrinks tiles until these fit, the launches
ask for them, and the resource report (`elastic_np.cuda._compile.report`)
prints them.
"""

from elastic_np.cuda._runtime import config


def forward_geometry(threads, tile):
    """``(block_q, tpr)`` of a SIMT forward block of ``threads`` threads and key tile ``tile``."""
    tpr = tile // config.REG_N
    return threads // tpr * config.REG_M, tpr


def forward_elements(threads, tile, D, Dv):
    """A SIMT forward block's shared memory: Q, the K/V tile, the ``p`` tile, three statistics per (row, lane)."""
    block_q, tpr = forward_geometry(threads, tile)
    width = min(max(Dv, 1), tpr * config.ACC_COLS)
    return block_q * (D + 1) + tile * max(D + 1, width) + block_q * (tile + 1) + 3 * block_q * tpr


def tensor_core_forward_elements(warps, block_k, width_v, D):
    """A tensor-core forward block's shared memory: Q, two of K (or the scratch), two of V."""
    stride = -(-max(D, 1) // 8) * 8 + config.TC_PAD
    block_q = 16 * warps
    k_or_scratch = max(block_k * stride, block_q * (block_k + 1))
    return block_q * stride + 2 * k_or_scratch + 2 * block_k * (width_v + config.TC_PAD)


def decode_kv_elements(tpr, D, Dv):
    """The two K and two V tiles of a decode block."""
    block_k = tpr * config.DECODE_REG_N
    width = min(max(Dv, 1), tpr * config.DECODE_ACC_COLS)
    return 2 * block_k * (D + 1 + width)


def decode_elements(rows_blk, tpr, D, Dv):
    """A decode block's shared memory: queries, two K and two V tiles, the ``p`` tile (`_simt.decode._decode_tiles`)."""
    return rows_blk * (D + 1) + decode_kv_elements(tpr, D, Dv) + rows_blk * (tpr * config.DECODE_REG_N + 1)


def backward_elements(kind, rows, cols, D, Dv):
    """A SIMT ``"dq"`` or ``"dkdv"`` block's shared memory.

    ``rows`` is the block's own tile (queries for ``dq``, keys for
    ``dkdv``), ``cols`` the tile it loops over.
    """
    tpr = cols // config.REG_N
    if kind == "dq":
        # q, dout, s/ds, dp tiles; lse, delta; four compensated sums per (row, lane); K, V tiles
        return rows * (D + 1 + Dv + 1 + 2 * (cols + 1) + 2 + 4 * tpr) + cols * (D + 1 + Dv + 1)
    # K, V tiles; p, ds tiles; Q, dout tiles; lse, delta
    return rows * (D + 1 + Dv + 1 + 2 * (cols + 1)) + cols * (D + 1 + Dv + 1 + 2)


def tensor_core_backward_elements(kind, warps, tile, width):
    """A tensor-core ``"dq"`` or ``"dkdv"`` block's shared memory, rows of ``width + TC_PAD``.

    ``dq``: Q and dO of its ``16 warps`` rows, two each of K and V; ``dkdv``:
    K and V of its ``16 warps`` keys, two each of Q, dO and of ``lse`` with
    ``delta``.
    """
    stride = width + config.TC_PAD
    rows = 16 * warps
    if kind == "dq":
        return 2 * rows * stride + 4 * tile * stride
    return 2 * rows * stride + 4 * tile * stride + 4 * tile
