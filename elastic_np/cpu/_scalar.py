"""Scalar arithmetic the kernels share: the key, query and offset ranges a tile may keep, and dtype helpers.
"""

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from elastic_np.cpu._config import _FASTMATH


@njit(cache=True, fastmath=False)
def _offset_range(opt, b, h, N, M):
    """Offsets ``off = j - i - (kv_ends[b] - N)`` that causal, the window and the gate band allow: ``[lo, hi]``."""
    lo = -(M + 1)
    hi = N + 1
    if opt.causal:
        hi = min(hi, 0)
    if opt.left >= 0:
        lo = max(lo, -opt.left)
    if opt.right >= 0:
        hi = min(hi, opt.right)
    if opt.has_gate:
        lo = max(lo, opt.band[b, h, 0])
        hi = min(hi, opt.band[b, h, 1])
    return lo, hi


@njit(cache=True, fastmath=False)
def _key_range(opt, b, i0, bq, N, M, off_lo, off_hi):
    """Keys ``[j_lo, j_hi)`` that queries ``i0 .. i0 + bq - 1`` may keep."""
    shift = opt.kv_ends[b] - N
    j_lo = max(i0 + shift + off_lo, 0)
    j_hi = min(i0 + bq + shift + off_hi, opt.kv_lengths[b])
    return j_lo, max(j_hi, j_lo)


@njit(cache=True, fastmath=False)
def _query_range(opt, b, j0, bk, N, off_lo, off_hi):
    """Queries ``[i_lo, i_hi)`` that keys ``j0 .. j0 + bk - 1`` may be kept by."""
    shift = opt.kv_ends[b] - N
    i_lo = max(j0 - shift - off_hi, 0)
    i_hi = min(j0 + bk - shift - off_lo, N)
    return i_lo, max(i_hi, i_lo)


@njit(cache=True, fastmath=False)
def _removes_nothing(opt, b, i0, bq, j0, bk, N, off_lo, off_hi, nvm):
    """True when no entry of the tile is removed (inside the offset range, no NVM, mask or gate)."""
    shift = opt.kv_ends[b] - N
    # Whole tile inside [off_lo, off_hi]: the last key with the first query
    # and the first key with the last query are the extreme offsets.
    inside = (j0 + bk - 1 - i0 - shift <= off_hi) and (j0 - (i0 + bq - 1) - shift >= off_lo)
    return inside and not (nvm or opt.has_mask or opt.has_gate)


def _like(x, arr):
    """``x`` as a scalar of the dtype of the array ``arr`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_like, inline="always")
def _like_overload(x, arr):
    if isinstance(arr, types.Array) and arr.dtype == types.float32:
        return lambda x, arr: np.float32(x)
    if isinstance(arr, types.Array) and arr.dtype == types.float64:
        return lambda x, arr: np.float64(x)
    return None


@njit(cache=True, fastmath=_FASTMATH)
def _log_add_exp(a, b):
    if b == -np.inf:
        return a
    if a == -np.inf:
        return b
    hi = max(a, b)
    return hi + math.log1p(math.exp(-abs(a - b)))
