"""Single-threaded tile primitives for the Numba CPU attention kernels.

Small dense building blocks that the ``@njit(parallel=True)`` kernels of
`elastic_np.cpu` call once per tile, inside a ``prange`` task. They are plain
loops (no BLAS), so that they never start threads of their own.

All arrays are 2-D, C-contiguous and of one dtype (float32 or float64); they may
be larger than the ``m x n x k`` block actually used, which is always the
top-left corner.
"""

import math

from numba import njit

__all__ = ["matmul_nn", "matmul_tn", "exp_inplace"]


@njit(cache=True)
def matmul_nn(a, b, c, m, n, k, accumulate):
    """``c[:m, :n] (+)= a[:m, :k] @ b[:k, :n]``.

    Parameters
    ----------
    a, b, c : ndarray
        2-D C-contiguous arrays of one dtype.
    m, n, k : int
        Block sizes.
    accumulate : bool
        Add to ``c`` if true, overwrite it otherwise.
    """
    for i in range(m):
        if not accumulate:
            for j in range(n):
                c[i, j] = 0.0
        for p in range(k):
            aip = a[i, p]
            for j in range(n):
                c[i, j] += aip * b[p, j]


@njit(cache=True)
def matmul_tn(a, b, c, m, n, k, accumulate):
    """``c[:m, :n] (+)= a[:k, :m].T @ b[:k, :n]``.

    Parameters
    ----------
    a, b, c : ndarray
        2-D C-contiguous arrays of one dtype.
    m, n, k : int
        Block sizes.
    accumulate : bool
        Add to ``c`` if true, overwrite it otherwise.
    """
    for i in range(m):
        if not accumulate:
            for j in range(n):
                c[i, j] = 0.0
        for p in range(k):
            api = a[p, i]
            for j in range(n):
                c[i, j] += api * b[p, j]


@njit(cache=True)
def exp_inplace(x, m, n):
    """``x[:m, :n] = exp(x[:m, :n])`` in place; ``exp(-inf) = 0``.

    Parameters
    ----------
    x : ndarray
        2-D C-contiguous array, float32 or float64.
    m, n : int
        Block sizes.
    """
    for i in range(m):
        for j in range(n):
            x[i, j] = math.exp(x[i, j])
