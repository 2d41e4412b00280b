"""The compact mask and bias of the kernel plan, for every backend (NumPy only).

A mask or bias reaches the backends as a ``(B, H, N, M)`` broadcast view of
the caller's array. The kernels read only its distinct entries, through
element strides: ``x[b, h, i, j] == flat[b*s0 + h*s1 + i*s2 + j*s3]``, the
stride 0 on each axis the entries do not vary along (broadcast, or of length
1). The CPU kernels read the flat arrays in host memory; the CUDA host
copies them to the device as they are (the strides stay valid).
"""

import numpy as np

from elastic_np._contract import _validation


def element_strides(shape, byte_strides, itemsize):
    """Element strides of an array's axes, 0 on an axis of length 1 or a broadcast one."""
    return np.array([0 if s == 0 or n == 1 else s // itemsize for n, s in zip(shape, byte_strides)], dtype=np.int64)


def _distinct(a):
    """``a`` with each broadcast (zero-stride) axis cut to length 1: its distinct entries, not copied."""
    return a[tuple(slice(0, 1) if s == 0 else slice(None) for s in a.strides)]


def compact_mask(mask):
    """``(entries, strides)`` of a boolean mask view: its distinct entries, C-contiguous and writable.

    ``entries`` keeps four dims (1 on each broadcast axis), so a ``(N, M)``
    mask stays ``N * M`` booleans; ``strides`` are its element strides
    (`element_strides`). A copy only when the distinct entries are not
    C-contiguous and writable already (a read-only array would be another
    Numba type, compiling every CPU kernel again).
    """
    entries = _distinct(mask)
    if not (entries.flags.c_contiguous and entries.flags.writeable):
        entries = np.array(entries, order="C", copy=True)
    return entries, element_strides(entries.shape, entries.strides, entries.itemsize)


def compact_bias(bias, dtype, check):
    """``(flat, strides)`` of a bias view: its distinct entries, flat and read-only, with element strides.

    The caller's memory is read as it is, at its strides (no copy), when it
    has the kernel ``dtype``, is aligned and has no negative stride: C or
    Fortran order, the last two axes transposed (``.mT``), a slice of a
    larger array. Otherwise the distinct entries are copied, converted, in C
    order. ``flat`` spans the memory from the first entry to the last
    (the gaps of a slice included), always read-only, so that the kernels
    see one array type.

    With ``check``, the distinct entries are checked first (no NaN, no
    ``+inf``: `elastic_np._contract._validation.check_bias_values`), then, when
    converted, the converted ones (a float64 entry beyond the float32 range
    becomes ``+inf``).
    """
    compact = _distinct(bias)
    if check:
        _validation.check_bias_values(compact)
    itemsize = np.dtype(dtype).itemsize
    readable = (
        compact.dtype == dtype
        and compact.flags.aligned
        and all(s >= 0 and s % itemsize == 0 for s, n in zip(compact.strides, compact.shape) if n > 1)
    )
    if not readable:
        with np.errstate(over="ignore"):  # beyond the range: -inf removes, +inf raises (below)
            compact = np.ascontiguousarray(compact, dtype=dtype)
        if check:
            _validation.check_bias_values(
                compact, f"`bias` has finite entries beyond the range of {dtype}, the kernels' dtype"
            )
    span = 0
    if compact.size:
        span = 1 + sum((n - 1) * s for n, s in zip(compact.shape, compact.strides) if n > 1) // itemsize
    flat = np.lib.stride_tricks.as_strided(compact, (span,), (itemsize,), writeable=False)
    return flat, element_strides(compact.shape, compact.strides, itemsize)
