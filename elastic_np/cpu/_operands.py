"""The kernels' ``(B, H, N, D)`` operands, read and written in place in either of two layouts.

An array's storage is C-contiguous, ``(B, H, N, D)`` in `BHND`, or
``(B, N, H, D)`` in `BNHD` (FlashAttention's), whose ``transpose(0, 2, 1, 3)``
view is the ``(B, H, N, D)`` array. Its operand is ``(rows, layout, shape)``:
the storage as a 3-D C-contiguous view, ``(B * H, N, D)`` or ``(B, N, H * D)``,
the layout (a runtime int) and the ``(B, H, N, D)`` shape. Both layouts are
one Numba type, so one compiled kernel per dtype serves both. A bfloat16 or
float16 storage is its bits' view (`elastic_np.cpu._halves.bits`). The kernels take
a head's rows with `head` and `head_rows`: whole rows of ``rows`` (the
leading dimension ``D``, or ``H * D``) and the column where the head's
entries start, the form the tile products read in place
(`elastic_np.cpu._products`); a row's ``D`` entries are contiguous in both layouts.
"""

import numpy as np

from elastic_np.cpu._halves import bits
from elastic_np.cpu._numba_private import inner
from elastic_np.cpu._plan import _kernel_array

#: The layouts of an operand's storage.
BHND, BNHD = 0, 1


def _operand(storage, layout):
    """The operand of a storage array in ``layout``."""
    storage = bits(storage)
    if layout == BNHD:
        B, N, H, D = storage.shape
        return storage.reshape(B, N, H * D), BNHD, (B, H, N, D)
    B, H, N, D = storage.shape
    return storage.reshape(B * H, N, D), BHND, (B, H, N, D)


def operand(a):
    """The operand of a ``(B, H, N, D)`` array: its own memory, or a C-contiguous copy.

    ``a`` itself when C-contiguous (`BHND`), its ``(B, N, H, D)`` storage when
    ``a`` is the ``transpose(0, 2, 1, 3)`` view of a C-contiguous array
    (`BNHD`), read-only or not (`_kernel_array`); any other array is copied
    as `_kernel_array` copies it.
    """
    if not a.flags.c_contiguous:
        storage = a.transpose(0, 2, 1, 3)
        if storage.flags.c_contiguous:
            return _operand(_kernel_array(storage), BNHD)
    return _operand(_kernel_array(a), BHND)


def new(shape, dtype, layout, fill=np.empty):
    """A new ``(B, H, N, D)`` array stored in ``layout``: ``(array, operand)``.

    ``fill`` makes the storage (`numpy.empty` or `numpy.zeros`).
    """
    B, H, N, D = shape
    if layout == BNHD:
        storage = fill((B, N, H, D), dtype=dtype)
        return storage.transpose(0, 2, 1, 3), _operand(storage, BNHD)
    storage = fill((B, H, N, D), dtype=dtype)
    return storage, _operand(storage, BHND)


@inner(fastmath=False)
def shape(x):
    """``(B, H, N, D)`` of operand ``x``."""
    return x[2]


@inner(fastmath=False)
def head(x, b, h):
    """Head ``h`` of batch entry ``b`` of operand ``x``: ``(whole, col)``.

    ``whole`` is a C-contiguous ``(N, D)`` array (``(N, H * D)`` in `BNHD`:
    the rows of every head), row ``i`` is ``whole[i, col : col + D]``.
    """
    rows, layout, (B, H, N, D) = x
    if layout == BNHD:
        return rows[b], h * D
    return rows[b * H + h], 0


@inner(fastmath=False)
def head_rows(x, b, h, r0, nr):
    """Rows ``r0 .. r0 + nr - 1`` of head ``h`` of batch entry ``b`` of operand ``x``: ``(whole, col)`` as `head`'s."""
    whole, col = head(x, b, h)
    return whole[r0 : r0 + nr], col
