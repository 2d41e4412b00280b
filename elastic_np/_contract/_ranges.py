"""Which offsets, keys and queries a tile may keep: the range arithmetic of every kernel, written once.

Entry ``(i, j)`` of batch entry ``b`` sits at offset ``off = j - i - diag_shift``,
``diag_shift = E_b - N`` (``E_b``: ``M``, or ``kv_lengths[b]`` with
``align="kv_lengths"``). Causal attention, the window and the dynamic
window's band each keep an interval of offsets; `offset_band` (NumPy, on the
host) intersects them per ``(b, h)`` for the kernel plan of every backend.
`key_range` and `query_range` turn that interval into the keys a block of
queries may keep and the queries a block of keys may be kept by; they are
compiled by Numba for the CPU kernels and, called from the ``numba.cuda``
kernels, compiled for the GPU too.
"""

import numpy as np
from numba import njit


def offset_band(p, gate_band=None):
    """Offsets ``[lo, hi]`` that causal, the window and the gate leave, per ``(b, h)``.

    Parameters
    ----------
    p : elastic_np._contract._problem.AttentionProblem
        The validated problem (its shape, ``causal`` and ``window``).
    gate_band : ndarray of int64, shape (B, H, 2), optional
        Offsets outside of which the dynamic window's gate is closed.

    Returns
    -------
    ndarray of int64, shape (B, H, 2)
        ``lo > hi`` where nothing is kept. Without any limit the interval is
        ``[-(M + 1), N + 1]``, wider than every offset of the problem.
    """
    B, H, Hkv, N, M, D, Dv = p.shape
    left, right = (int(w) for w in p.window)
    lo = -(M + 1) if left < 0 else max(-(M + 1), -left)
    hi = N + 1 if right < 0 else min(N + 1, right)
    if p.causal:
        hi = min(hi, 0)
    band = np.empty((B, H, 2), dtype=np.int64)
    band[..., 0] = lo
    band[..., 1] = hi
    if gate_band is not None:
        np.maximum(band[..., 0], gate_band[..., 0], out=band[..., 0])
        np.minimum(band[..., 1], gate_band[..., 1], out=band[..., 1])
    return band


@njit(cache=True, fastmath=False)
def key_range(diag_shift, i0, i1, off_lo, off_hi, kv_length):
    """Keys ``[j_lo, j_hi)`` that queries ``i0 .. i1 - 1`` may keep (``j_lo == j_hi`` when none)."""
    j_lo = max(i0 + diag_shift + off_lo, 0)
    j_hi = min(i1 + diag_shift + off_hi, kv_length)
    if off_lo > off_hi:  # no offset at all: the formula above would span the queries' gaps
        j_hi = j_lo
    return j_lo, max(j_hi, j_lo)


@njit(cache=True, fastmath=False)
def query_range(diag_shift, j0, j1, off_lo, off_hi, N):
    """Queries ``[i_lo, i_hi)`` that keys ``j0 .. j1 - 1`` may be kept by (``i_lo == i_hi`` when none)."""
    i_lo = max(j0 - diag_shift - off_hi, 0)
    i_hi = min(j1 - diag_shift - off_lo, N)
    if off_lo > off_hi:
        i_hi = i_lo
    return i_lo, max(i_hi, i_lo)
