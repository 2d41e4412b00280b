"""The kernels' ``(B, H, N, D)`` operands, read and written in place in either of two layouts.

An array's storage is C-contiguous, ``(B, H, N, D)`` in `BHND`, or
``(B, N, H, D)`` in `BNHD` (FlashAttention's), whose ``transpose(0, 2, 1, 3)``
view is the ``(B, H, N, D)`` array. Its operand is ``(rows, layout, shape)``:
the storage as a 3-D C-contiguous view, ``(B * H, N, D)`` or ``(B, N, H * D)``,
the layout (a runtime int) and the ``(B, H, N, D)`` shape. Both layouts are
one Numba type, so one compiled kernel per dtype serves both. A bfloat16 or
float16 storage is its bits' view (`elastic_np.cpu._tiles.halves.bits`). The kernels take
a head's rows with `head` and `head_rows`: whole rows of ``rows`` (the
leading dimension ``D``, or ``H * D``) and the column where the head's
entries start, the form the tile products read in place
(`elastic_np.cpu._tiles.products`); a row's ``D`` entries are contiguous in both layouts.
Any other array the kernels read (``lse``, say) goes through `kernel_array`.
"""

import numpy as np

from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._tiles.halves import bits

#: The layouts of an operand's storage.
BHND, BNHD = 0, 1


def kernel_array(a):
    """``a``'s memory as a C-contiguous writeable array the kernels read: ``a`` itself, a view of it, or a copy.

    A read-only, strided or unaligned array is another Numba type, and every
    new type compiles every kernel again (and a kernel called through its
    entry point, `elastic_np.cpu._runtime.numba_private.direct_call`, must
    get the types it was compiled for): a C-contiguous read-only ``a`` is
    read in place through a writeable view of its memory
    (`_ReadOnlyMemory`), any other layout, or memory not aligned to the
    dtype, is copied.
    """
    if not (a.flags.c_contiguous and a.flags.aligned):
        return np.array(a, order="C", copy=True)
    if a.flags.writeable:
        return a
    view = np.asarray(_ReadOnlyMemory(a))
    return view if view.dtype == a.dtype else view.view(a.dtype)  # a bfloat16's interface says only "V2"


class _ReadOnlyMemory:
    """A read-only C-contiguous array's ``__array_interface__`` marked writeable, holding the array (and so its memory).

    Safe because the kernels only read their inputs (they write only the
    arrays the backends allocate for their results), and the view never
    leaves the call: nothing writes through it, so a read-only mapping
    (``np.load(..., mmap_mode="r")``) is read where it lies, never faulted on.
    """

    def __init__(self, array):
        self.array = array
        interface = dict(array.__array_interface__)
        interface["data"] = (interface["data"][0], False)  # (address, read-only flag)
        self.__array_interface__ = interface


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
    (`BNHD`), read-only or not (`kernel_array`); any other array is copied
    as `kernel_array` copies it.
    """
    flags = a.flags
    if flags.c_contiguous and flags.writeable and flags.aligned and a.dtype.char in "fd":  # the common case, fast
        B, H, N, D = a.shape
        return a.reshape(B * H, N, D), BHND, (B, H, N, D)
    if not flags.c_contiguous:
        storage = a.transpose(0, 2, 1, 3)
        if storage.flags.c_contiguous:
            return _operand(kernel_array(storage), BNHD)
    return _operand(kernel_array(a), BHND)


def new(shape, dtype, layout, fill=np.empty, storage=None):
    """A new ``(B, H, N, D)`` array stored in ``layout``: ``(array, operand)``.

    ``fill`` makes the storage (`numpy.empty` or `numpy.zeros`); ``storage``,
    where given, is the caller's C-contiguous writeable array to use instead,
    of the layout's storage shape and ``dtype``.
    """
    B, H, N, D = shape
    if layout == BNHD:
        storage = fill((B, N, H, D), dtype=dtype) if storage is None else storage
        return storage.transpose(0, 2, 1, 3), _operand(storage, BNHD)
    storage = fill((B, H, N, D), dtype=dtype) if storage is None else storage
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
