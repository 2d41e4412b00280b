"""Single-threaded tile primitives for the Numba CPU attention kernels.

Small dense building blocks that the ``@njit(parallel=True)`` kernels of
`elastic_np.cpu` call once per tile, inside a ``prange`` task. They are plain
loops (no BLAS, so they never start threads of their own), written so that LLVM
vectorises them with AVX-512/AVX2 and fused multiply-adds:

``matmul_nn(a, b, c, m, n, k, accumulate)``
    ``c[:m, :n] (+)= a[:m, :k] @ b[:k, :n]``
``matmul_tn(a, b, c, m, n, k, accumulate)``
    ``c[:m, :n] (+)= a[:k, :m].T @ b[:k, :n]``
``exp_inplace(x, m, n)``
    ``x[:m, :n] = exp(x[:m, :n])``, with ``exp(-inf) = 0``
``exp_shift_sum(x, m, n, shift, nvm, sums)``
    ``x[:m, :n] = exp(x[:m, :n] - shift[:n])`` (0 where NVM removes the
    entry) and ``sums[:n] += x[:m, :n].sum(axis=0)``, in one pass

All arrays are 2-D, C-contiguous and of one dtype (float32 or float64); they may
be larger than the block used, which is always the top-left corner (the row
length of the array is its leading dimension). Each function is compiled for
explicit signatures, one per dtype, when this module is imported (or loaded
from the cache): sizes and ``accumulate`` are runtime arguments, the factors
``a`` and ``b`` may be read-only, and any other layout (a column slice, for
instance) is a typing error rather than a slower extra specialisation.

The innermost loops run along the rows of ``b``, ``c`` and ``x`` (contiguous),
so the tiles are fastest with ``n`` a multiple of 16 (float32) or 8 (float64)
and ``n >= 64``; ``a`` is read one element at a time and may be in either
layout at no extra cost.
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

__all__ = ["matmul_nn", "matmul_tn", "exp_inplace", "exp_shift_sum", "tanh_inplace", "tanh_any"]

# Only contraction of a*b+c into fused multiply-adds is allowed: IEEE inf/NaN
# semantics and the written order of every sum are kept (full fastmath=True
# measured no faster for the matmuls, and would let LLVM reorder the exponential's
# Cody-Waite reduction).
_OPTIONS = dict(cache=True, fastmath={"contract"}, boundscheck=False, error_model="numpy")

# Explicit signatures: exactly one compiled version per dtype, whatever the
# caller passes (literal True/False or sizes, int32 sizes, read-only factors),
# and a clear typing error for anything that is not a 2-D C-contiguous array.
_DTYPES = (types.float32, types.float64)


def _matrix(dtype, readonly=False):
    return types.Array(dtype, 2, "C", readonly=readonly)


def _matmul_signature(dtype, *flags):
    ro, rw = _matrix(dtype, readonly=True), _matrix(dtype)
    return types.void(ro, ro, rw, types.intp, types.intp, types.intp, *flags)


_MATMUL_SIGNATURES = [_matmul_signature(dtype, types.boolean) for dtype in _DTYPES]
_EXP_SIGNATURES = {dtype: types.void(_matrix(dtype), types.intp, types.intp) for dtype in _DTYPES}


# ---------------------------------------------------------------------------
# Matrix products
# ---------------------------------------------------------------------------


@njit(inline="always")
def _a_at(a, row, col, transposed):
    """``a[row, col]``, or ``a[col, row]`` when ``a`` holds the transpose."""
    return a[col, row] if transposed else a[row, col]


@njit(**_OPTIONS)
def _matmul(a, b, c, m, n, k, accumulate, transposed):
    """``c[:m, :n] (+)= A @ b[:k, :n]`` with ``A = a[:m, :k]`` or ``a[:k, :m].T``.

    Register blocking: four rows of ``c`` are updated together with four rows
    of ``b`` at a time, so each vector of ``b`` loaded feeds four rows and each
    load/store of ``c`` carries four fused multiply-adds; the 16 elements of
    ``A`` involved stay in registers (broadcast) across the loop over ``n``.
    The update is written ``c = c + a0 x0 + a1 x1 + ...`` (left to right) so
    that it compiles to four FMAs, not a multiply, three FMAs and an add.
    Leftover rows and leftover ``k`` fall back to rank-1 updates.
    """
    if not accumulate:
        for i in range(m):
            ci = c[i]
            for j in range(n):
                ci[j] = 0.0
    m4 = m - m % 4
    k4 = k - k % 4
    for i in range(0, m4, 4):
        c0 = c[i]
        c1 = c[i + 1]
        c2 = c[i + 2]
        c3 = c[i + 3]
        for p in range(0, k4, 4):
            b0 = b[p]
            b1 = b[p + 1]
            b2 = b[p + 2]
            b3 = b[p + 3]
            a00 = _a_at(a, i, p, transposed)
            a01 = _a_at(a, i, p + 1, transposed)
            a02 = _a_at(a, i, p + 2, transposed)
            a03 = _a_at(a, i, p + 3, transposed)
            a10 = _a_at(a, i + 1, p, transposed)
            a11 = _a_at(a, i + 1, p + 1, transposed)
            a12 = _a_at(a, i + 1, p + 2, transposed)
            a13 = _a_at(a, i + 1, p + 3, transposed)
            a20 = _a_at(a, i + 2, p, transposed)
            a21 = _a_at(a, i + 2, p + 1, transposed)
            a22 = _a_at(a, i + 2, p + 2, transposed)
            a23 = _a_at(a, i + 2, p + 3, transposed)
            a30 = _a_at(a, i + 3, p, transposed)
            a31 = _a_at(a, i + 3, p + 1, transposed)
            a32 = _a_at(a, i + 3, p + 2, transposed)
            a33 = _a_at(a, i + 3, p + 3, transposed)
            for j in range(n):
                x0 = b0[j]
                x1 = b1[j]
                x2 = b2[j]
                x3 = b3[j]
                c0[j] = c0[j] + a00 * x0 + a01 * x1 + a02 * x2 + a03 * x3
                c1[j] = c1[j] + a10 * x0 + a11 * x1 + a12 * x2 + a13 * x3
                c2[j] = c2[j] + a20 * x0 + a21 * x1 + a22 * x2 + a23 * x3
                c3[j] = c3[j] + a30 * x0 + a31 * x1 + a32 * x2 + a33 * x3
        for p in range(k4, k):
            bp = b[p]
            a0 = _a_at(a, i, p, transposed)
            a1 = _a_at(a, i + 1, p, transposed)
            a2 = _a_at(a, i + 2, p, transposed)
            a3 = _a_at(a, i + 3, p, transposed)
            for j in range(n):
                x = bp[j]
                c0[j] += a0 * x
                c1[j] += a1 * x
                c2[j] += a2 * x
                c3[j] += a3 * x
    for i in range(m4, m):
        ci = c[i]
        for p in range(k):
            aip = _a_at(a, i, p, transposed)
            bp = b[p]
            for j in range(n):
                ci[j] += aip * bp[j]


@njit(_MATMUL_SIGNATURES, cache=True)
def matmul_nn(a, b, c, m, n, k, accumulate):
    """Tile product ``c[:m, :n] (+)= a[:m, :k] @ b[:k, :n]``.

    Parameters
    ----------
    a : ndarray, shape (>= m, >= k)
        Left factor.
    b : ndarray, shape (>= k, >= n)
        Right factor.
    c : ndarray, shape (>= m, >= n)
        Output block, written in place; the rest of ``c`` is left alone.
        Must not overlap ``a`` or ``b``.
    m, n, k : int
        Block sizes (``k = 0`` gives a zero product).
    accumulate : bool
        Add the product to ``c[:m, :n]`` if true, overwrite it otherwise.

    Notes
    -----
    ``a``, ``b``, ``c`` are 2-D C-contiguous arrays of one dtype (float32 or
    float64). Single-threaded. Each element of ``c`` is updated in steps of
    four products, fused multiply-adds in a fixed order, so the result matches
    ``a @ b`` within the usual ``k * eps`` bound (not bit for bit) and depends
    on the inputs only: repeated calls give identical bits.

    See Also
    --------
    matmul_tn
    """
    _matmul(a, b, c, m, n, k, accumulate, False)


@njit(_MATMUL_SIGNATURES, cache=True)
def matmul_tn(a, b, c, m, n, k, accumulate):
    """Tile product ``c[:m, :n] (+)= a[:k, :m].T @ b[:k, :n]``.

    Parameters
    ----------
    a : ndarray, shape (>= k, >= m)
        Left factor, stored transposed.
    b : ndarray, shape (>= k, >= n)
        Right factor.
    c : ndarray, shape (>= m, >= n)
        Output block, written in place; the rest of ``c`` is left alone.
        Must not overlap ``a`` or ``b``.
    m, n, k : int
        Block sizes (``k = 0`` gives a zero product).
    accumulate : bool
        Add the product to ``c[:m, :n]`` if true, overwrite it otherwise.

    Notes
    -----
    As `matmul_nn`, and just as fast: ``a`` is only read element by element
    outside the vectorised loop. This is the product of the backward pass
    (``dV += P^T dO``, ``dK += dS^T Q``) without transposing ``P`` or ``dS``.

    See Also
    --------
    matmul_nn
    """
    _matmul(a, b, c, m, n, k, accumulate, True)


# ---------------------------------------------------------------------------
# Exponential
# ---------------------------------------------------------------------------


@intrinsic
def _float_from_bits(typingctx, bits):
    """Reinterpret the bits of an int64 (int32) as a float64 (float32)."""
    if bits == types.int64:
        sig, llvm_type = types.float64(types.int64), ir.DoubleType()
    elif bits == types.int32:
        sig, llvm_type = types.float32(types.int32), ir.FloatType()
    else:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_type)

    return sig, codegen


# float64: Cody-Waite split of ln 2 (fdlibm): LN2_HI has 32 significant bits,
# so t * LN2_HI is exact for |t| < 2**21.
_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
# q(r) = (exp(r) - 1 - r) / r**2 on |r| <= 1.0005 ln(2)/2: coefficients (highest
# degree first) of its Chebyshev interpolant of degree 9 (mpmath.chebyfit, 50
# digits), rounded to float64. Relative error of 1 + r + r**2 q(r) with the
# rounded coefficients, evaluated exactly: 1.6e-17.
_EXP_Q_F64 = (
    2.5100424157005067e-08,
    2.7620138719733994e-07,
    2.7557268378684192e-06,
    2.480152119021773e-05,
    0.00019841269863105968,
    0.0013888888917281794,
    0.008333333333330051,
    0.04166666666662399,
    0.16666666666666669,
    0.5000000000000001,
)


@njit(**_OPTIONS)
def _exp_f64_scalar(v):
    """Vectorisable ``exp(v)``, float64 (see `exp_inplace`)."""
    # exp(-746) < 2**-1075 rounds to 0; exp(710) overflows to inf. Arguments
    # below -746 (masked entries are -inf) give 0 by a final select, not by an
    # underflowing product (see _exp_f32_scalar).
    x = v
    if x < -746.0:
        x = -1.0
    if x > 710.0:
        x = 710.0
    t = np.floor(x * _LOG2E + 0.5)
    r = (x - t * _LN2_HI) - t * _LN2_LO
    # 1 + r + r**2 q(r), q a degree-9 Chebyshev fit (see exp_inplace), by Horner.
    c = _EXP_Q_F64
    q = (((((((((c[0] * r + c[1]) * r + c[2]) * r + c[3]) * r + c[4]) * r + c[5]) * r
           + c[6]) * r + c[7]) * r + c[8]) * r + c[9])
    p = (q * r + 1.0) * r + 1.0
    # 2**t = 2**t1 * 2**t2, each factor a normal number built in its
    # exponent field, so that subnormal and overflowing results round
    # once, in the last product.
    e = np.int64(t)
    e1 = e >> 1
    e2 = e - e1
    y = p * _float_from_bits((e1 + 1023) << 52) * _float_from_bits((e2 + 1023) << 52)
    if v < -746.0:
        y = 0.0
    return y


def _exp_any(v):
    """``exp(v)`` of the dtype of ``v`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_exp_any)
def _exp_any_overload(v):
    if v == types.float64:
        return lambda v: _exp_f64_scalar(v)
    if v == types.float32:
        return lambda v: _exp_f32_scalar(v)
    return None


@njit([_EXP_SIGNATURES[types.float64]], **_OPTIONS)
def _exp_f64(x, m, n):
    """Vectorisable ``exp`` of ``x[:m, :n]`` in place, float64 (see `exp_inplace`)."""
    for i in range(m):
        row = x[i]
        for j in range(n):
            row[j] = _exp_any(row[j])


# float32: Cody-Waite split of ln 2 (Cephes): LN2_HI has 9 significant bits,
# so t * LN2_HI is exact for |t| < 2**15.
_LOG2E_F32 = np.float32(1.4426950408889634)
_LN2_HI_F32 = np.float32(0.693359375)
_LN2_LO_F32 = np.float32(-2.12194440e-4)
_HALF_F32 = np.float32(0.5)
_ONE_F32 = np.float32(1.0)
_LO_F32 = np.float32(-104.0)
_HI_F32 = np.float32(89.0)
_ZERO_ARG_F32 = np.float32(-1.0)
_ZERO_F32 = np.float32(0.0)
# As _EXP_Q_F64, degree 4, rounded to float32: relative error 1.1e-8.
_EXP_Q_F32 = (
    np.float32(0.0013926213141530752),
    np.float32(0.008363203145563602),
    np.float32(0.041666556149721146),
    np.float32(0.16666576266288757),
    np.float32(0.5),
)


@njit(**_OPTIONS)
def _exp_f32_scalar(v):
    """Vectorisable ``exp(v)``, float32 (see `exp_inplace`)."""
    # exp(-104) < 2**-150 rounds to 0; exp(89) overflows to inf. Arguments
    # below -104 (masked entries are -inf) give 0 by a final select, not by an
    # underflowing product: the polynomial runs on a harmless stand-in, since
    # underflow costs a microcode assist per element on some CPUs.
    x = v
    if x < _LO_F32:
        x = _ZERO_ARG_F32
    if x > _HI_F32:
        x = _HI_F32
    t = np.floor(x * _LOG2E_F32 + _HALF_F32)
    r = (x - t * _LN2_HI_F32) - t * _LN2_LO_F32
    # 1 + r + r**2 q(r), q a degree-4 Chebyshev fit (see exp_inplace), by Horner.
    c = _EXP_Q_F32
    q = (((c[0] * r + c[1]) * r + c[2]) * r + c[3]) * r + c[4]
    p = (q * r + _ONE_F32) * r + _ONE_F32
    e = np.int32(t)
    e1 = e >> 1
    e2 = e - e1
    s1 = _float_from_bits(np.int32((e1 + 127) << 23))
    s2 = _float_from_bits(np.int32((e2 + 127) << 23))
    y = p * s1 * s2
    if v < _LO_F32:
        y = _ZERO_F32
    return y


@njit([_EXP_SIGNATURES[types.float32]], **_OPTIONS)
def _exp_f32(x, m, n):
    """Vectorisable ``exp`` of ``x[:m, :n]`` in place, float32 (see `exp_inplace`)."""
    for i in range(m):
        row = x[i]
        for j in range(n):
            row[j] = _exp_any(row[j])


def _exp_block(x, m, n):
    """Dispatch to the exponential of the dtype of ``x`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_exp_block)
def _exp_block_overload(x, m, n):
    if isinstance(x, types.Array) and x.dtype == types.float64:
        return lambda x, m, n: _exp_f64(x, m, n)
    if isinstance(x, types.Array) and x.dtype == types.float32:
        return lambda x, m, n: _exp_f32(x, m, n)
    return None


def _neg_inf(x):
    """``-inf`` in the dtype of the array ``x`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_neg_inf, inline="always")
def _neg_inf_overload(x):
    if isinstance(x, types.Array) and x.dtype == types.float64:
        return lambda x: np.float64(-np.inf)
    if isinstance(x, types.Array) and x.dtype == types.float32:
        return lambda x: np.float32(-np.inf)
    return None


@njit(list(_EXP_SIGNATURES.values()), cache=True)
def exp_inplace(x, m, n):
    r"""Exponential of the block ``x[:m, :n]``, in place.

    Parameters
    ----------
    x : ndarray, float32 or float64, shape (>= m, >= n)
        2-D C-contiguous array; only the block ``x[:m, :n]`` is changed.
    m, n : int
        Block sizes.

    Notes
    -----
    A vectorisable replacement for ``math.exp``, which LLVM calls one element
    at a time. With :math:`t = \operatorname{round}(x / \ln 2)` and

    .. math:: r = (x - t\,c_{hi}) - t\,c_{lo}, \qquad c_{hi} + c_{lo} \approx \ln 2,

    (Cody-Waite reduction: :math:`c_{hi}` has few significant bits so that
    :math:`t\,c_{hi}` is exact), :math:`|r| \le \ln(2)/2` and

    .. math:: e^x = 2^t\, e^r, \qquad e^r \approx 1 + r + r^2 q(r),

    where :math:`q` is the Chebyshev interpolant of :math:`(e^r - 1 - r)/r^2`,
    of degree 9 in float64 and 4 in float32 (a polynomial of degree 11 or 6 in
    all, evaluated by Horner's rule with fused multiply-adds; near-minimax, two
    degrees fewer than the Taylor polynomial of the same accuracy). With its
    coefficients rounded to the working precision the polynomial is within
    :math:`1.6 \cdot 10^{-17}` (float64, 0.15 ulp) and :math:`1.1 \cdot 10^{-8}`
    (float32, 0.2 ulp) relative of :math:`e^r`.
    The power :math:`2^t` is written directly into the exponent field of two
    floats :math:`2^{t_1} 2^{t_2}`, :math:`t_1 = \lfloor t/2 \rfloor`, both normal,
    so that results in the subnormal range and overflow round once, in the last
    product. The rest of the error is the rounding of the Horner evaluation:
    in all, at most 1 ulp (asserted by the tests against a long double
    reference over the whole finite range; measured: 0.91 ulp in float32,
    0.93 ulp in float64).

    Special values: ``exp(-inf) = 0``; arguments below -746 (float64) or
    -104 (float32) give 0 and those above 710 (float64) or 89 (float32) give
    ``+inf``, as does ``+inf``, like `numpy.exp` (without its warnings);
    ``nan`` gives ``nan``. The attention kernels only pass arguments ``<= 0``.

    See Also
    --------
    numpy.exp
    """
    _exp_block(x, m, n)


_EXP_SHIFT_SUM_SIGNATURES = [
    types.void(
        _matrix(dtype), types.intp, types.intp, types.Array(dtype, 1, "C", readonly=True),
        types.boolean, types.Array(dtype, 1, "C"),
    )
    for dtype in _DTYPES
]


@njit(_EXP_SHIFT_SUM_SIGNATURES, **_OPTIONS)
def exp_shift_sum(x, m, n, shift, nvm, sums):
    r"""Shifted exponential of the block ``x[:m, :n]`` in place, with its column sums.

    ``x[i, j] = exp(x[i, j] - shift[j])`` and ``sums[j] += x[i, j]`` (over
    ``i`` in order), in one pass over the block; with ``nvm``, entries with
    ``x[i, j] < 0`` (or NaN) become 0 instead.

    Parameters
    ----------
    x : ndarray, float32 or float64, shape (>= m, >= n)
        2-D C-contiguous array; only the block ``x[:m, :n]`` is changed.
    m, n : int
        Block sizes.
    shift : ndarray, shape (>= n,)
        Subtracted from every row of the block.
    nvm : bool
        Zero the entries that are negative before the shift.
    sums : ndarray, shape (>= n,)
        Column sums of the exponentials are added to ``sums[:n]``.

    Notes
    -----
    The exponential is the one of `exp_inplace` (same bits); the sums run
    over the rows in order, so they match a separate pass exactly. This is
    the softmax step of the forward tiles (scores stored transposed, one
    column per query): subtracting the running maximum, exponentiating and
    summing together saves two passes over the tile.

    See Also
    --------
    exp_inplace
    """
    neg_inf = _neg_inf(x)
    if nvm:
        for i in range(m):
            row = x[i]
            for j in range(n):
                v = row[j]
                e = _exp_any(v - shift[j] if v >= 0 else neg_inf)
                row[j] = e
                sums[j] += e
    else:
        for i in range(m):
            row = x[i]
            for j in range(n):
                e = _exp_any(row[j] - shift[j])
                row[j] = e
                sums[j] += e


# ---------------------------------------------------------------------------
# Hyperbolic tangent
# ---------------------------------------------------------------------------


@njit(**_OPTIONS)
def _tanh_f64_scalar(v):
    """Vectorisable ``tanh(v)``, float64 (see `tanh_inplace`)."""
    # u = expm1(-2|v|) from the reduction of _exp_f64_scalar: -2|v| = t ln 2 + r,
    # expm1 = (2**t - 1) + 2**t (r + r**2 q(r)), both terms exact or accurate
    # relative to themselves, without the cancellation of exp(.) - 1.
    x = -2.0 * abs(v)
    if x < -746.0:
        x = -746.0  # |v| > 373: tanh rounds to +-1, and no NaN from -inf
    t = np.floor(x * _LOG2E + 0.5)
    r = (x - t * _LN2_HI) - t * _LN2_LO
    c = _EXP_Q_F64
    q = (((((((((c[0] * r + c[1]) * r + c[2]) * r + c[3]) * r + c[4]) * r + c[5]) * r
           + c[6]) * r + c[7]) * r + c[8]) * r + c[9])
    em1_r = q * r * r + r
    e = np.int64(t)
    e1 = e >> 1
    e2 = e - e1
    two_t = _float_from_bits((e1 + 1023) << 52) * _float_from_bits((e2 + 1023) << 52)
    u = (two_t - 1.0) + two_t * em1_r
    return math.copysign(abs(u) / (2.0 + u), v)


_TWO_F32 = np.float32(2.0)
_NEG_TWO_F32 = np.float32(-2.0)


@njit(**_OPTIONS)
def _tanh_f32_scalar(v):
    """Vectorisable ``tanh(v)``, float32 (see `tanh_inplace`)."""
    x = _NEG_TWO_F32 * abs(v)
    if x < _LO_F32:
        x = _LO_F32  # |v| > 52: tanh rounds to +-1
    t = np.floor(x * _LOG2E_F32 + _HALF_F32)
    r = (x - t * _LN2_HI_F32) - t * _LN2_LO_F32
    c = _EXP_Q_F32
    q = (((c[0] * r + c[1]) * r + c[2]) * r + c[3]) * r + c[4]
    em1_r = q * r * r + r
    e = np.int32(t)
    e1 = e >> 1
    e2 = e - e1
    s1 = _float_from_bits(np.int32((e1 + 127) << 23))
    s2 = _float_from_bits(np.int32((e2 + 127) << 23))
    two_t = s1 * s2
    u = (two_t - _ONE_F32) + two_t * em1_r
    return math.copysign(abs(u) / (_TWO_F32 + u), v)


def tanh_any(v):
    """``tanh(v)`` of the dtype of the float ``v``, vectorisable (jit code only).

    The scalar behind `tanh_inplace`, for kernels that fuse it into loops of
    their own.
    """
    raise NotImplementedError("only callable from compiled code")


@overload(tanh_any)
def _tanh_any_overload(v):
    if v == types.float64:
        return lambda v: _tanh_f64_scalar(v)
    if v == types.float32:
        return lambda v: _tanh_f32_scalar(v)
    return None


@njit(list(_EXP_SIGNATURES.values()), **_OPTIONS)
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
    at 4 ulp against mpmath. ``tanh(+-inf) = +-1``; ``nan`` gives ``nan``.

    See Also
    --------
    exp_inplace, numpy.tanh
    """
    for i in range(m):
        row = x[i]
        for j in range(n):
            row[j] = tanh_any(row[j])


# ---------------------------------------------------------------------------
# Prefetch
# ---------------------------------------------------------------------------


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the CPU to bring ``arr.ravel()[index]`` into the cache (jit code only).

    ``llvm.prefetch`` (a read, high locality, data cache): it never faults and
    changes no value, so an index past the end is harmless. Kernels use it
    where their access pattern defeats the hardware prefetcher, such as a
    tile of a C-order array read as many short rows far apart.
    """
    if not (isinstance(arr, types.Array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read (0), high temporal locality (3), data cache (1)
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, index), codegen


# ---------------------------------------------------------------------------
# Transposed add of a block
# ---------------------------------------------------------------------------

#: Bytes of the square blocks `transpose_add` moves: a 512-bit vector per row,
#: 16 float32 or 8 float64 (LLVM splits it on hosts with narrower registers).
TRANSPOSE_BYTES = 64


def _transpose_in_registers(builder, rows):
    """Transpose ``W`` vectors of ``W`` lanes: ``log2(W)`` rounds of two-source shuffles.

    Round ``bit`` pairs rows ``i`` and ``i + bit`` (``bit`` clear in ``i``) and
    swaps the entries whose column has the bit set in row ``i`` with those
    where it is clear in row ``i + bit``: each round swaps one bit of the row
    and column indices, so after all rounds entry ``(r, c)`` sits at ``(c, r)``.
    """
    width = len(rows)
    rows = list(rows)
    i32 = ir.IntType(32)
    bit = 1
    while bit < width:
        low = [j if not j & bit else width + j - bit for j in range(width)]
        high = [j + bit if not j & bit else width + j for j in range(width)]
        low, high = (ir.Constant(ir.VectorType(i32, width), m) for m in (low, high))
        for i in range(width):
            if not i & bit:
                a, b = rows[i], rows[i + bit]
                rows[i] = builder.shuffle_vector(a, b, low)
                rows[i + bit] = builder.shuffle_vector(a, b, high)
        bit *= 2
    return rows


def _make_transpose(store):
    """``transpose_add`` (``store=False``) or ``transpose_store`` (see their docstrings)."""

    def codegen(context, builder, signature, args):
        x_ty, flat_ty = signature.args[:2]
        x_val, flat_val, start, stride, row0, col0, scale_val = args
        ir_float = context.get_value_type(x_ty.dtype)
        itemsize = context.get_abi_sizeof(ir_float)
        width = TRANSPOSE_BYTES // itemsize
        vec = ir.VectorType(ir_float, width)
        intp = context.get_value_type(types.intp)
        i32 = ir.IntType(32)
        x_arr = context.make_array(x_ty)(context, builder, x_val)
        lead = cgutils.unpack_tuple(builder, x_arr.shape, 2)[1]
        flat_data = context.make_array(flat_ty)(context, builder, flat_val).data

        def vector_at(data, index):
            return builder.bitcast(builder.gep(data, [index], inbounds=True), vec.as_pointer())

        def flat_run(r):  # the r-th run of `flat`
            return vector_at(flat_data, builder.add(start, builder.mul(stride, ir.Constant(intp, r))))

        def x_row(c):  # row0 + c of x, from column col0
            index = builder.add(builder.mul(builder.add(row0, ir.Constant(intp, c)), lead), col0)
            return vector_at(x_arr.data, index)

        undef = ir.Constant(vec, ir.Undefined)
        splat = builder.shuffle_vector(
            builder.insert_element(undef, scale_val, ir.Constant(i32, 0)),
            undef, ir.Constant(ir.VectorType(i32, width), [0] * width),
        )
        if store:
            rows = [builder.load(x_row(c), align=itemsize) for c in range(width)]
            for r, row in enumerate(_transpose_in_registers(builder, rows)):
                builder.store(builder.fmul(row, splat), flat_run(r), align=itemsize)
        else:
            rows = [builder.load(flat_run(r), align=itemsize) for r in range(width)]
            for c, row in enumerate(_transpose_in_registers(builder, rows)):
                ptr = x_row(c)
                total = builder.fadd(builder.load(ptr, align=itemsize), builder.fmul(row, splat))
                builder.store(total, ptr, align=itemsize)
        return context.get_dummy_value()

    def typer(typingctx, x, flat, start, stride, row0, col0, scale):
        if not (isinstance(x, types.Array) and isinstance(flat, types.Array)):
            return None
        if x.ndim != 2 or flat.ndim != 1 or x.dtype != flat.dtype or scale != x.dtype:
            return None
        if store and not flat.mutable:
            return None
        sig = types.void(x, flat, types.intp, types.intp, types.intp, types.intp, scale)
        return sig, codegen

    return typer


@intrinsic
def transpose_add(typingctx, x, src, start, stride, row0, col0, scale):
    """``x[row0 + c, col0 + r] += scale * src[start + r * stride + c]`` for ``r, c < W``.

    ``W = TRANSPOSE_BYTES // itemsize``; ``x`` is a 2-D C-contiguous array,
    ``src`` a 1-D array of the same dtype, ``scale`` a float of that dtype
    (jit code only). The ``W`` runs of ``src`` are loaded as vectors,
    transposed in registers, multiplied by ``scale`` and added to ``W`` rows of
    ``x`` (one product and one sum per entry): a block of a C-order bias added
    to a key-major score tile without a scalar gather or scatter.
    """
    return _make_transpose(store=False)(typingctx, x, src, start, stride, row0, col0, scale)


@intrinsic
def transpose_store(typingctx, x, dst, start, stride, row0, col0, scale):
    """``dst[start + r * stride + c] = scale * x[row0 + c, col0 + r]`` for ``r, c < W``.

    The inverse direction of `transpose_add` (jit code only): ``W`` rows of the
    tile ``x`` are loaded, transposed in registers, multiplied by ``scale``
    and stored as ``W`` runs of ``dst``: a key-major gradient tile written
    into a C-order ``dbias``.
    """
    return _make_transpose(store=True)(typingctx, x, dst, start, stride, row0, col0, scale)
