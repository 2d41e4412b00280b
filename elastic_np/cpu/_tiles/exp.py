"""The exponential for the tile kernels: vectorised, to the last bits.

``exp_inplace(x, m, n)``
    ``x[:m, :n] = exp(x[:m, :n])``, with ``exp(-inf) = 0``
``exp_shift_sum(x, m, n, shift, nvm, sums)``
    ``x[:m, :n] = exp(x[:m, :n] - shift[:n])`` (0 where NVM removes the
    entry) and ``sums[:n] += x[:m, :n].sum(axis=0)``, in one pass

The exponentials reduce by Cody-Waite (``ln 2`` in two parts) to a polynomial
on ``[-ln2/2, ln2/2]`` and scale by ``2^k`` built from the exponent bits;
the soft-cap's tangent (`elastic_np.cpu._tiles.tanh`) reuses them.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._tiles.simd import _DTYPES, _EXP_SIGNATURES, _INNER_OPTIONS, _OPTIONS, VECTOR_BYTES, _matrix, _typed


def _bitcast(name, pairs, doc):
    """An intrinsic that reinterprets the bits of its argument.

    ``pairs`` maps each argument type to ``(result type, LLVM result type)``.
    """

    def typer(typingctx, x):
        if x not in pairs:
            return None
        result, llvm_type = pairs[x]

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], llvm_type)

        return result(x), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


float_from_bits = _bitcast(
    "float_from_bits",
    {types.int64: (types.float64, ir.DoubleType()), types.int32: (types.float32, ir.FloatType())},
    "Reinterpret the bits of an int64 (int32) as a float64 (float32).",
)
_float_bits = _bitcast(
    "_float_bits",
    {types.float64: (types.int64, ir.IntType(64)), types.float32: (types.int32, ir.IntType(32))},
    "The bits of a float64 (float32) as an int64 (int32): the inverse of `float_from_bits`.",
)


def by_dtype(name, f64, f32, doc):
    """A scalar function for jit code that calls ``f64(v)`` or ``f32(v)`` by the dtype of ``v``."""

    def stub(v):
        raise NotImplementedError("only callable from compiled code")

    stub.__name__ = stub.__qualname__ = name
    stub.__doc__ = doc

    @overload(stub, inline="always")  # no compile of its own: only a call
    def _stub_overload(v):
        if v == types.float64:
            return lambda v: f64(v)
        if v == types.float32:
            return lambda v: f32(v)
        return None

    return stub


@intrinsic
def _ldexp(typingctx, x, n):
    """``x * 2**n`` rounded once (``llvm.ldexp``), float32 or float64 ``x``, int32 ``n``."""
    if x not in (types.float32, types.float64) or n != types.int32:
        return None
    sig = x(x, types.int32)

    def codegen(context, builder, signature, args):
        llvm_type = context.get_value_type(signature.args[0])
        name = "llvm.ldexp.f32.i32" if signature.args[0] == types.float32 else "llvm.ldexp.f64.i32"
        fnty = ir.FunctionType(llvm_type, [llvm_type, ir.IntType(32)])
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)

    return sig, codegen


#: ``llvm.ldexp`` compiles to one vectorised instruction (vscalefps/pd) with
#: AVX-512; elsewhere it may become a library call per element, so the
#: exponential builds its power of two from exponent fields instead.
_HAS_VECTOR_LDEXP = VECTOR_BYTES == 64


@inner(**_INNER_OPTIONS)
def _pow2_fields_f64(p, t):
    """``p * 2**t`` (float64 ``p`` near 1, integral float ``t`` in [-1100, 1100]), rounded once.

    2**t = 2**t1 * 2**t2, each factor a normal number built in its exponent
    field: p * 2**t1 is exact, and subnormal or overflowing results round
    once, in the last product.
    """
    t1 = np.floor(t * 0.5)
    return p * _pow2_f64(t1) * _pow2_f64(t - t1)


#: 1.5 * 2**52: adding it to an integral float64 n, |n| < 2**51, leaves n in
#: the low bits of the sum (two's complement, in the bits below the exponent).
_ROUND_F64 = 6755399441055744.0


@inner(**_INNER_OPTIONS)
def _pow2_f64(n):
    """``2**n`` for an integral float64 ``n`` in [-1022, 1023], built in its exponent field.

    Without a float-to-int64 conversion, which AVX2 lacks (LLVM did it
    element by element, a large share of an exp or tanh).
    """
    return float_from_bits((_float_bits(n + _ROUND_F64) + 1023) << 52)


@inner(**_INNER_OPTIONS)
def _pow2_fields_f32(p, t):
    """``p * 2**t`` (float32 ``p`` near 1, integral float ``t`` in [-160, 160]), rounded once."""
    e = np.int32(t)
    e1 = e >> 1
    e2 = e - e1
    s1 = float_from_bits(np.int32((e1 + 127) << 23))
    s2 = float_from_bits(np.int32((e2 + 127) << 23))
    return p * s1 * s2


@inner(**_INNER_OPTIONS)
def _pow2_scale_f64(p, t):
    """``p * 2**t`` rounded once: ``ldexp`` where it vectorises, else `_pow2_fields_f64`."""
    if _HAS_VECTOR_LDEXP:
        return _ldexp(p, np.int32(t))
    return _pow2_fields_f64(p, t)


@inner(**_INNER_OPTIONS)
def _pow2_scale_f32(p, t):
    """``p * 2**t`` rounded once: ``ldexp`` where it vectorises, else `_pow2_fields_f32`."""
    if _HAS_VECTOR_LDEXP:
        return _ldexp(p, np.int32(t))
    return _pow2_fields_f32(p, t)


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


@inner(**_INNER_OPTIONS)
def _exp_q_f64(r):
    """``q(r)`` of `_EXP_Q_F64`: ``c9 + r t(r)``, ``t`` by Estrin's scheme.

    The terms of ``t`` in pairs, then pairs of pairs with ``r**2`` and
    ``r**4``: five multiply-adds deep rather than Horner's nine. The
    exponential is one long chain of dependent operations per entry, and
    the out-of-order window rather than the FMA ports bounds how many
    entries are in flight, so a shallower chain keeps more of them going.
    The last step is Horner's, so that ``q`` rounds once at the size of its
    leading term, as before; ``t``'s extra roundings are scaled by
    ``|r| <= 0.35``.
    """
    c = _EXP_Q_F64
    r2 = r * r
    r4 = r2 * r2
    p0 = c[7] * r + c[8]
    p1 = c[5] * r + c[6]
    p2 = c[3] * r + c[4]
    p3 = c[1] * r + c[2]
    d0 = p1 * r2 + p0
    d1 = p3 * r2 + p2
    t = (c[0] * r4 + d1) * r4 + d0
    return t * r + c[9]


@inner(**_INNER_OPTIONS)
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
    # 1 + r + r**2 q(r), q a degree-9 Chebyshev fit (see exp_inplace)
    q = _exp_q_f64(r)
    p = (q * r + 1.0) * r + 1.0
    y = _pow2_scale_f64(p, t)
    if v < -746.0:
        y = 0.0
    return y


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


@inner(**_INNER_OPTIONS)
def _exp_q_f32(r, r2):
    """``q(r)`` of `_EXP_Q_F32` (``r2 = r * r``): the upper terms in a pair, then Horner (see `_exp_q_f64`)."""
    c = _EXP_Q_F32
    return ((c[0] * r + c[1]) * r2 + (c[2] * r + c[3])) * r + c[4]


@inner(**_INNER_OPTIONS)
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
    # 1 + r + r**2 q(r), q a degree-4 Chebyshev fit (see exp_inplace)
    q = _exp_q_f32(r, r * r)
    p = (q * r + _ONE_F32) * r + _ONE_F32
    y = _pow2_scale_f32(p, t)
    if v < _LO_F32:
        y = _ZERO_F32
    return y


_exp_any = by_dtype(
    "_exp_any", _exp_f64_scalar, _exp_f32_scalar, "``exp(v)`` of the dtype of ``v`` (jit code only)."
)


@njit(inline="always", **_OPTIONS)
def _exp_rows(x, m, n):
    """``exp`` of ``x[:m, :n]`` in place, four rows at a time (see `exp_shift_sum`)."""
    m4 = m - m % 4
    for i in range(0, m4, 4):
        r0, r1, r2, r3 = x[i, :n], x[i + 1, :n], x[i + 2, :n], x[i + 3, :n]
        for j in range(n):
            e0, e1, e2, e3 = _exp_any(r0[j]), _exp_any(r1[j]), _exp_any(r2[j]), _exp_any(r3[j])
            r0[j], r1[j], r2[j], r3[j] = e0, e1, e2, e3
    for i in range(m4, m):
        row = x[i, :n]
        for j in range(n):
            row[j] = _exp_any(row[j])


@_typed([_EXP_SIGNATURES[types.float64]], **_OPTIONS)
def _exp_f64(x, m, n):
    """Vectorisable ``exp`` of ``x[:m, :n]`` in place, float64 (see `exp_inplace`)."""
    _exp_rows(x, m, n)


@_typed([_EXP_SIGNATURES[types.float32]], **_OPTIONS)
def _exp_f32(x, m, n):
    """Vectorisable ``exp`` of ``x[:m, :n]`` in place, float32 (see `exp_inplace`)."""
    _exp_rows(x, m, n)


def _exp_block(x, m, n):
    """Dispatch to the exponential of the dtype of ``x`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_exp_block, inline="always")
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


@_typed(list(_EXP_SIGNATURES.values()), needs=(_exp_f64, _exp_f32), cache=True, fastmath=False)
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
    all, evaluated with fused multiply-adds; near-minimax, two degrees fewer
    than the Taylor polynomial of the same accuracy). The last steps follow
    Horner's rule; the higher terms of :math:`q` go in pairs (Estrin's
    scheme), which shortens the chain of dependent operations per entry,
    the bound on how many entries are in flight (see `_exp_q_f64`). With its
    coefficients rounded to the working precision the polynomial is within
    :math:`1.6 \cdot 10^{-17}` (float64, 0.15 ulp) and :math:`1.1 \cdot 10^{-8}`
    (float32, 0.2 ulp) relative of :math:`e^r`.
    The power :math:`2^t` is applied with one rounding, so that results in the
    subnormal range and overflow round once: by ``ldexp`` (one ``vscalef``
    instruction) with AVX-512, elsewhere by writing it into the exponent
    fields of two floats :math:`2^{t_1} 2^{t_2}`, :math:`t_1 = \lfloor t/2 \rfloor`,
    both normal, and multiplying (the same bits). The rest of the error is the
    rounding of the evaluation: in all, at most 1 ulp where the CPU
    fuses multiply-adds (`HAS_FMA`; measured: 0.91 ulp in float32, 0.93 ulp
    in float64) and 1.25 ulp where each step rounds twice (without
    FMA, as in a portable cache built with ``NUMBA_CPU_NAME=generic``;
    measured: 1.15 and 1.23 ulp), asserted by the tests against a long double
    reference over the whole finite range.

    Special values: ``exp(-inf) = 0``; arguments below -746 (float64) or
    -104 (float32) give 0 and those above 710 (float64) or 89 (float32) give
    ``+inf``, as does ``+inf``, like `numpy.exp` (without its warnings);
    ``nan`` gives ``nan``. The attention kernels only pass arguments ``<= 0``.

    See Also
    --------
    numpy.exp
    """
    _exp_block(x, m, n)


@njit(inline="always", **_OPTIONS)
def _shifted_exp(v, shift, nvm, neg_inf):
    """One entry of `exp_shift_sum`."""
    return _exp_any(v - shift if (v >= 0 or not nvm) else neg_inf)


@njit(inline="always", **_OPTIONS)
def _exp_shift_sum_rows(x, m, n, shift, nvm, sums):
    """`exp_shift_sum` four rows at a time; inlined where ``nvm`` is a constant."""
    neg_inf = _neg_inf(x)
    m4 = m - m % 4
    for i in range(0, m4, 4):
        r0, r1, r2, r3 = x[i, :n], x[i + 1, :n], x[i + 2, :n], x[i + 3, :n]
        for j in range(n):
            e0 = _shifted_exp(r0[j], shift[j], nvm, neg_inf)
            e1 = _shifted_exp(r1[j], shift[j], nvm, neg_inf)
            e2 = _shifted_exp(r2[j], shift[j], nvm, neg_inf)
            e3 = _shifted_exp(r3[j], shift[j], nvm, neg_inf)
            r0[j], r1[j], r2[j], r3[j] = e0, e1, e2, e3
            sums[j] = (((sums[j] + e0) + e1) + e2) + e3
    for i in range(m4, m):
        row = x[i, :n]
        for j in range(n):
            e = _shifted_exp(row[j], shift[j], nvm, neg_inf)
            row[j] = e
            sums[j] += e


_EXP_SHIFT_SUM_SIGNATURES = [
    types.void(
        _matrix(dtype), types.intp, types.intp, types.Array(dtype, 1, "C", readonly=True),
        types.boolean, types.Array(dtype, 1, "C"),
    )
    for dtype in _DTYPES
]


@_typed(_EXP_SHIFT_SUM_SIGNATURES, **_OPTIONS)
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
    summing together saves two passes over the tile. Rows go four at a
    time: the exponential is one long chain of dependent operations per
    entry, and four independent ones in flight hide more of its latency.

    See Also
    --------
    exp_inplace
    """
    if nvm:
        _exp_shift_sum_rows(x, m, n, shift, True, sums)
    else:
        _exp_shift_sum_rows(x, m, n, shift, False, sums)
