"""The soft-cap's tangent and its slope for the tile kernels: vectorised, to the last bits.

``tanh_inplace(x, m, n)``, ``tanh_any(v)``, ``sech2_any(v)``
    ``tanh`` and ``1 - tanh^2``, from ``expm1(-2|v|)`` by the reduction and
    polynomials of `elastic_np.cpu._tiles.exp`
"""

import math

import numpy as np

from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._tiles.exp import (
    _LN2_HI, _LN2_HI_F32, _LN2_LO, _LN2_LO_F32, _LOG2E, _LOG2E_F32, _ONE_F32, _exp_f32_scalar, _exp_f64_scalar,
    _exp_q_f32, _exp_q_f64, _float_bits, _pow2_f64, by_dtype, float_from_bits,
)
from elastic_np.cpu._tiles.simd import _EXP_SIGNATURES, _INNER_OPTIONS, _OPTIONS, _typed

#: Below -64 = -2|v| (|v| > 32) tanh rounds to +-1 in float64 (1 - tanh|v| < 2**-90).
_TANH_LO_F64 = -64.0


@inner(**_INNER_OPTIONS)
def _tanh_f64_scalar(v):
    """Vectorisable ``tanh(v)``, float64 (see `tanh_inplace`)."""
    # u = expm1(-2|v|) from the reduction of _exp_f64_scalar: -2|v| = t ln 2 + r,
    # expm1 = (2**t - 1) + 2**t (r + r**2 q(r)), both terms exact or accurate
    # relative to themselves, without the cancellation of exp(.) - 1.
    x = -2.0 * abs(v)
    if x < _TANH_LO_F64:
        x = _TANH_LO_F64  # and no NaN from -inf
    t = np.floor(x * _LOG2E + 0.5)
    r = (x - t * _LN2_HI) - t * _LN2_LO
    q = _exp_q_f64(r)
    em1_r = q * r * r + r
    two_t = _pow2_f64(t)  # t in [-93, 0]
    u = (two_t - 1.0) + two_t * em1_r
    return math.copysign(abs(u) / (2.0 + u), v)


_TWO_F32 = np.float32(2.0)


_NEG_TWO_F32 = np.float32(-2.0)


#: Below -20 = -2|v| (|v| > 10) tanh rounds to +-1 in float32 (1 - tanh|v| < 5e-9).
_TANH_LO_F32 = np.float32(-20.0)


#: 1.5 * 2**23 + 127: adding it to a float y with |y| < 2**21 rounds y to an
#: integer n and leaves n + 127, the biased exponent of 2**n, in the low bits.
_ROUND_F32 = np.float32(12582912.0 + 127.0)


@inner(**_INNER_OPTIONS)
def _tanh_f32_scalar(v):
    """Vectorisable ``tanh(v)``, float32 (see `tanh_inplace`)."""
    x = _NEG_TWO_F32 * abs(v)
    if x < _TANH_LO_F32:
        x = _TANH_LO_F32
    # t = round(x / ln 2) in [-29, 0], and 2**t straight from the bits of k
    k = x * _LOG2E_F32 + _ROUND_F32
    t = k - _ROUND_F32
    r = (x - t * _LN2_HI_F32) - t * _LN2_LO_F32
    r2 = r * r
    q = _exp_q_f32(r, r2)
    em1_r = q * r2 + r
    two_t = float_from_bits(np.int32(_float_bits(k) << 23))
    u = (two_t - _ONE_F32) + two_t * em1_r
    # |u| / (2 + u) with the sign of v (copysign takes only the magnitude of u)
    return math.copysign(u / (_TWO_F32 + u), v)


tanh_any = by_dtype(
    "tanh_any", _tanh_f64_scalar, _tanh_f32_scalar,
    """``tanh(v)`` of the dtype of the float ``v``, vectorisable (jit code only).

    The scalar behind `tanh_inplace`, for kernels that fuse it into loops of
    their own.
    """,
)


_FOUR_F32 = np.float32(4.0)


@inner(**_INNER_OPTIONS)
def _sech2_f64_scalar(v):
    """Vectorisable ``1 - tanh(v)**2``, float64 (see `sech2_any`)."""
    e = _exp_f64_scalar(-2.0 * abs(v))
    d = 1.0 + e
    return 4.0 * e / (d * d)


@inner(**_INNER_OPTIONS)
def _sech2_f32_scalar(v):
    """Vectorisable ``1 - tanh(v)**2``, float32 (see `sech2_any`)."""
    e = _exp_f32_scalar(_NEG_TWO_F32 * abs(v))
    d = _ONE_F32 + e
    return _FOUR_F32 * e / (d * d)


sech2_any = by_dtype(
    "sech2_any", _sech2_f64_scalar, _sech2_f32_scalar,
    """``1 - tanh(v)**2`` of the dtype of the float ``v``, vectorisable (jit code only).

    Evaluated as ``4 e / (1 + e)**2`` with ``e = exp(-2|v|)``: accurate to a
    few units in the last place for every ``v``, where ``1 - tanh(v)**2``
    cancels to nothing once ``tanh(v)`` rounds to 1 (``|v|`` above about 9 in
    float32, 19 in float64).
    """,
)


@_typed(list(_EXP_SIGNATURES.values()), **_OPTIONS)
def tanh_inplace(x, m, n):
    r"""Hyperbolic tangent of the block ``x[:m, :n]``, in place.

    Parameters
    ----------
    x : ndarray, float32 or float64, shape (>= m, >= n)
        2-D C-contiguous array; only the block ``x[:m, :n]`` is changed.
    m, n : int
        Block sizes.

    Notes
    -----
    A vectorisable replacement for ``math.tanh`` (a scalar library call),
    built on the reduction and polynomial of `exp_inplace`:

    .. math:: \tanh|x| = \frac{-u}{2 + u}, \qquad u = e^{-2|x|} - 1 \in (-1, 0],

    with the sign of ``x`` restored. ``u`` is formed without cancellation:
    with :math:`-2|x| = t \ln 2 + r`,
    :math:`u = (2^t - 1) + 2^t (r + r^2 q(r))`, where :math:`2^t - 1` is
    exact and :math:`r + r^2 q(r)` is accurate relative to itself, so that
    small arguments keep full relative accuracy (``tanh(x) = x`` for tiny
    ``x``) and the quotient adds a few roundings. The tests bound the error
    at 4 ulp against mpmath (a scan of every float32 in
    :math:`[2^{-126}, 12]` measured 2.50 ulp at most) and check that the
    result never decreases from one float to the next: the forward kernel
    caps a tile's raw maxima rather than taking the maxima of the capped
    tile, which is the same only for a non-decreasing tangent.
    ``tanh(+-inf) = +-1``; ``nan`` gives ``nan``.

    See Also
    --------
    exp_inplace, numpy.tanh
    """
    for i in range(m):
        row = x[i]
        for j in range(n):
            row[j] = tanh_any(row[j])
