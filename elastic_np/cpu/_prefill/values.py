"""Checks of arrays' values in one compiled pass each: no temporaries, a few microseconds for a small call's arrays.

NumPy's ``np.isfinite(a).all()`` makes a boolean array and reads it again,
a few microseconds for each of a small backward's six arrays. `finite` and
`below_inf` read a C-contiguous float32 or float64 array once (a read-only
one through a writeable view, `kernel_array`: no specialisation of its own);
any other array goes through NumPy. `compile_for` compiles both for a dtype,
so that a path that uses them later (a plan's) compiles nothing.
"""

import numpy as np
from numba import njit

from elastic_np._contract import _validation
from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._tiles.halves import checked
from elastic_np.cpu._tiles.operands import kernel_array


def finite(a):
    """Whether every entry of the float array ``a`` is finite (`elastic_np._contract._validation.all_finite`)."""
    if a.dtype.char in "fd" and a.flags.c_contiguous and a.flags.aligned:
        return _finite(kernel_array(a).reshape(-1))
    return _validation.all_finite(a)


def below_inf(a):
    """Whether no entry of the float array ``a`` is NaN or ``+inf`` (``-inf`` passes: an ``lse`` of a row with no
    key)."""
    if a.dtype.char in "fd" and a.flags.c_contiguous and a.flags.aligned:
        return _below_inf(kernel_array(a).reshape(-1))
    return bool((a < np.inf).all())


def compile_for(dtype):
    """Compile (or load) `finite`'s and `below_inf`'s loops for ``dtype``, once."""
    if dtype not in _COMPILED:
        one = np.zeros(1, dtype=dtype)
        finite(one), below_inf(one)
        _COMPILED.add(dtype)


_COMPILED = set()


@njit(nogil=True, cache=True, fastmath=False)
def _finite(a):
    """Whether the 1-D array ``a`` holds no NaN and no inf: the decode kernels' check of a tile's rows (`checked`,
    the sum of ``x * 0``), of ``a`` as one row."""
    return checked((a.reshape((1, a.shape[0])), 0), a.shape[0]) == 0


# ``FASTMATH`` leaves out ``nnan`` and ``ninf``: ``x * 0`` stays NaN for a NaN or an inf ``x``, and the sum may be
# vectorised.
@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _below_inf(a):
    """Whether the 1-D array ``a`` holds no NaN and no ``+inf``: `checked`'s sum of ``x * 0``, the negative entries
    taken as 0."""
    zero = a.dtype.type(0.0)
    check = zero
    for i in range(a.shape[0]):
        x = a[i]
        check += (zero if x < zero else x) * zero
    return check == 0
