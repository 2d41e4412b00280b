"""The kernels' ``(B, H, N, D)`` operands, read and written in place in either of two layouts.

An operand is a pair ``(storage, layout)``: ``storage`` is C-contiguous,
``(B, H, N, D)`` in `BHND`, or ``(B, N, H, D)`` in `BNHD` (FlashAttention's),
whose ``transpose(0, 2, 1, 3)`` view is the ``(B, H, N, D)`` array. Both
storages are one Numba type and the layout a runtime value, so one compiled
kernel per dtype serves both. The kernels take a head's rows with `head_rows`:
whole rows of the storage (the leading dimension ``D``, or ``H * D``) and
the column where the head's entries start, the form the tile products read
in place (`elastic_np.cpu._products`); one row with `head_row`, contiguous in
both layouts.
"""

import numpy as np

from elastic_np.cpu._numba_private import inner
from elastic_np.cpu._plan import _kernel_array

#: The layouts of an operand's storage.
BHND, BNHD = 0, 1


def operand(a):
    """The operand of a ``(B, H, N, D)`` array: its own memory, or a C-contiguous copy.

    ``a`` itself when C-contiguous (`BHND`), its ``(B, N, H, D)`` storage when
    ``a`` is the ``transpose(0, 2, 1, 3)`` view of a C-contiguous array
    (`BNHD`); any other array (or a read-only one) is copied as
    `_kernel_array` copies it.
    """
    if not a.flags.c_contiguous:
        storage = a.transpose(0, 2, 1, 3)
        if storage.flags.c_contiguous and storage.flags.writeable:
            return storage, BNHD
    return _kernel_array(a), BHND


def new(shape, dtype, layout, fill=np.empty):
    """A new ``(B, H, N, D)`` array stored in ``layout``: ``(array, operand)``.

    ``fill`` makes the storage (`numpy.empty` or `numpy.zeros`).
    """
    B, H, N, D = shape
    if layout == BNHD:
        storage = fill((B, N, H, D), dtype=dtype)
        return storage.transpose(0, 2, 1, 3), (storage, BNHD)
    storage = fill((B, H, N, D), dtype=dtype)
    return storage, (storage, BHND)


@inner(fastmath=False)
def shape(x):
    """``(B, H, N, D)`` of operand ``x``."""
    s, layout = x
    if layout == BNHD:
        return s.shape[0], s.shape[2], s.shape[1], s.shape[3]
    return s.shape[0], s.shape[1], s.shape[2], s.shape[3]


@inner(fastmath=False)
def head_rows(x, b, h, r0, nr):
    """Rows ``r0 .. r0 + nr - 1`` of head ``h`` of batch entry ``b`` of operand ``x``: ``(whole, col)``.

    ``whole`` is a C-contiguous ``(nr, D)`` array (``(nr, H * D)`` in
    `BNHD`: the rows of every head), row ``r0 + r`` is ``whole[r, col : col + D]``.
    """
    s, layout = x
    if layout == BNHD:
        return s[b, r0 : r0 + nr].reshape((nr, s.shape[2] * s.shape[3])), h * s.shape[3]
    return s[b, h, r0 : r0 + nr], 0


@inner(fastmath=False)
def head_row(x, b, h, i):
    """Row ``i`` of head ``h`` of batch entry ``b`` of operand ``x``: a C-contiguous ``(D,)`` array."""
    s, layout = x
    if layout == BNHD:
        return s[b, i, h]
    return s[b, h, i]
