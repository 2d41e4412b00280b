"""Scratch arrays that a call's kernels fill anew, kept between the calls of one shape on each thread.

A fresh array of more than about 128 KiB is mapped fresh by the C library,
and every page faults on its first write: a small backward's query and
``dout`` tiles, padded to `BLOCK_Q` rows (256 KiB each at ``(1, 8, 16,
64)``), would fault anew on every call, a noticeable share of its time. A
kept array is written in the same entries by every call of its shape, so
what the first call's ``fill`` set elsewhere (the zeros of a tile's
padding) stays so.
"""

import math
import threading

import numpy as np

from elastic_np._contract._problem import Kept

#: Arrays of at most this many bytes are kept; a larger call's arithmetic dwarfs its faults.
KEPT_BYTES = 1 << 22
#: Arrays kept per thread: the latest of as many (role, shape, dtype).
KEPT_ARRAYS = 32

_local = threading.local()


def scratch(role, shape, dtype, fill=np.empty):
    """An array of ``shape`` and ``dtype`` for ``role``: the one this thread last used for them, or a new ``fill``.

    ``role`` names what the array holds within a call, so that no two live
    arrays of one call are the same. ``fill`` (`numpy.empty` or
    `numpy.zeros`) makes a new one; the caller's kernels must write, on
    every call, every entry they read that ``fill`` did not set, and the
    array must not outlive the call (it is never returned to the user).
    """
    dtype = np.dtype(dtype)
    if math.prod(shape) * dtype.itemsize > KEPT_BYTES:
        return fill(shape, dtype=dtype)
    kept = getattr(_local, "arrays", None)
    if kept is None:
        kept = _local.arrays = Kept(KEPT_ARRAYS)
    return kept.get_or_make((role, shape, dtype), lambda: fill(shape, dtype=dtype))
