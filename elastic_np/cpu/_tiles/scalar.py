"""Scalar helpers of the CPU kernels: whether a tile removes nothing, dtype casts, ``log(e^a + e^b)``.

The key and query ranges are `elastic_np._contract._ranges`, shared with the CUDA kernels.
"""

import math

import numpy as np
from numba import types
from numba.extending import overload

from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._runtime.numba_private import inner


@inner(fastmath=False)
def _removes_nothing(opt, tile, bk, nvm):
    """True when no entry of the tile is removed (inside the offset band, no NVM, mask or gate)."""
    b, h, i0, bq, j0 = tile
    diag_shift = opt.diag_shift[b]
    # Whole tile inside the band: the last key with the first query and the
    # first key with the last query are the extreme offsets.
    inside = (
        j0 + bk - 1 - i0 - diag_shift <= opt.band[b, h, 1] and j0 - (i0 + bq - 1) - diag_shift >= opt.band[b, h, 0]
    )
    return inside and not (nvm or opt.has_mask or opt.has_gate)


def scalar_like(x, arr):
    """``x`` as a scalar of the dtype of the array ``arr`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(scalar_like, inline="always")
def _like_overload(x, arr):
    if isinstance(arr, types.Array) and arr.dtype == types.float32:
        return lambda x, arr: np.float32(x)
    if isinstance(arr, types.Array) and arr.dtype == types.float64:
        return lambda x, arr: np.float64(x)
    return None


@inner(fastmath=FASTMATH)
def log_add_exp(a, b):
    if b == -np.inf:
        return a
    if a == -np.inf:
        return b
    hi = max(a, b)
    return hi + math.log1p(math.exp(-abs(a - b)))
