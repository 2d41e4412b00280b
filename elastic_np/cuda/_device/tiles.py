"""Shared-memory tiles: the block's dynamic shared memory carved into tiles, filled, and staged from global memory.

Imports ``numba.cuda``: imported by the kernel modules only.
"""

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
