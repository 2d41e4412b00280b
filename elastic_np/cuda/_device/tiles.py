"""Shared-memory tiles: the block's dynamic shared memory carved into tiles, filled, and staged from global memory.

`stage` copies a tile with the block's threads, synchronously (the SIMT
forward and backward); `stage_kv` starts the asynchronous copies
(``cp.async``, `elastic_np.cuda._device.async_copy`) of a key tile's K and
V, the next tile arriving while the block works on this one (the decode
kernel and the tensor-core forward). Imports ``numba.cuda``: imported by the
kernel modules only.
"""

from elastic_np.cuda._device.async_copy import commit, copy_tile
from elastic_np.cuda._device.basics import inline_device


@inline_device
def carve(smem, at, size):
    """``(smem[at:at + size], at + size)``: the next tile of the block's dynamic shared memory, and its end."""
    return smem[at : at + size], at + size


@inline_device
def fill(tile, size, value, t, threads):
    """``tile[:size] = value``, thread ``t`` of the block's ``threads`` taking every ``threads``-th entry."""
    for idx in range(t, size, threads):
        tile[idx] = value


@inline_device
def stage(src, r0, rows, c0, cols, dst, stride, t, threads):
    """Copy ``src[r0:r0 + rows, c0:c0 + cols]`` to ``dst`` (row stride ``stride``), coalesced.

    ``src`` is one (batch, head) of an operand: ``q[b, h]``, ``k[b, hk]``.
    """
    for idx in range(t, rows * cols, threads):
        dst[(idx // cols) * stride + idx % cols] = src[r0 + idx // cols, c0 + idx % cols]


@inline_device
def stage_kv(k_rows, v_rows, rows, k_tile, v_tile, k_shape, v_shape, tile_rows, unit):
    """Start copying a key tile's K and V into their shared-memory tiles, as one group of the thread's copies.

    ``k_rows`` holds a (batch, kv head)'s keys from the tile's first,
    ``v_rows`` its values from the same key and the pass's first column;
    ``rows`` of them are copied. ``k_shape = (cols, stride, width)``: K's
    ``cols`` columns go to a ``tile_rows x width`` tile of row stride
    ``stride``, zeros past ``rows`` and ``cols``; ``v_shape`` likewise, and a
    V tile of ``width`` 0 (a pass over a value head of no column) is left
    alone. ``unit``: the elements one copy moves (`copy_tile`). The thread
    commits the group; ``wait_prior`` or ``wait_all`` and a ``syncthreads``
    make it visible to the block.
    """
    cols, stride, width = k_shape
    copy_tile(k_rows, rows, cols, k_tile, stride, tile_rows, width, unit)
    cols, stride, width = v_shape
    if width > 0:
        copy_tile(v_rows, rows, cols, v_tile, stride, tile_rows, width, unit)
    commit()
