"""Tile primitives of the CPU kernels against NumPy."""

import platform
import re

import numba
import numpy as np
import pytest

from elastic_np.cpu._tiles import exp as _exp, products as _products, simd as _simd
from elastic_np.cpu._tiles.exp import exp_inplace, exp_shift_sum
from elastic_np.cpu._tiles.products import matmul_nn, matmul_nn_max, matmul_tn

DTYPES = [np.float32, np.float64]
for _dtype in DTYPES:
    _simd.compile_for(_dtype)
# odd sizes hit every leftover path of the register blocking: rows past the last
# block of rows, vectors past the last panel, columns past the last whole vector
SIZES = [(1, 1, 1), (7, 59, 97), (97, 7, 59), (59, 97, 7), (12, 33, 6), (64, 64, 64), (33, 130, 64)]


def _operands(rng, dtype, m, n, k, transpose_a):
    pad = 3
    a_shape = (k + pad, m + pad) if transpose_a else (m + pad, k + pad)
    a = rng.standard_normal(a_shape).astype(dtype)
    b = rng.standard_normal((k + pad, n + pad)).astype(dtype)
    c = rng.standard_normal((m + pad, n + 2 * pad)).astype(dtype)
    return a, b, c


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SIZES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_matmul(dtype, m, n, k, accumulate, transpose_a):
    rng = np.random.default_rng(1000 * m + 10 * n + k)
    a, b, c = _operands(rng, dtype, m, n, k, transpose_a)
    a64, b64, c0 = a.astype(np.float64), b.astype(np.float64), c.copy()
    prod = (a64[:k, :m].T if transpose_a else a64[:m, :k]) @ b64[:k, :n]
    expected = c0.astype(np.float64)
    expected[:m, :n] = prod + (expected[:m, :n] if accumulate else 0.0)
    a_in, b_in = a.copy(), b.copy()
    fn = matmul_tn if transpose_a else matmul_nn
    fn(a, 0, b, 0, c, m, n, k, accumulate)
    assert c.dtype == dtype
    # error bound: eps * k * sum |a||b| (+ |c| when accumulating)
    mag = (np.abs(a64[:k, :m].T) if transpose_a else np.abs(a64[:m, :k])) @ np.abs(b64[:k, :n])
    if accumulate:
        mag += np.abs(c0[:m, :n])
    bound = 2 * (k + 1) * np.finfo(dtype).eps * mag
    assert np.all(np.abs(c[:m, :n] - expected[:m, :n]) <= bound + np.finfo(dtype).tiny)
    # outside the block nothing changes, and the inputs are untouched
    outside = np.ones(c.shape, bool)
    outside[:m, :n] = False
    np.testing.assert_array_equal(c[outside], c0[outside])
    np.testing.assert_array_equal(a, a_in)
    np.testing.assert_array_equal(b, b_in)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_zero_k_overwrites_with_zero(dtype):
    c = np.ones((4, 5), dtype)
    a = np.ones((4, 4), dtype)
    matmul_nn(a, 0, a, 0, c, 3, 4, 0, False)
    assert np.all(c[:3, :4] == 0) and np.all(c[3] == 1) and np.all(c[:, 4] == 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_a", [False, True])
def test_matmul_propagates_nan_and_inf(dtype, transpose_a):
    rng = np.random.default_rng(9)
    a = rng.standard_normal((9, 9)).astype(dtype)
    b = rng.standard_normal((9, 10)).astype(dtype)
    a[2, 5] = np.nan  # row 2 of the product (row 5 when a is stored transposed)
    b[6, 3] = np.inf  # column 3 of the product
    c = np.zeros((9, 10), dtype)
    (matmul_tn if transpose_a else matmul_nn)(a, 0, b, 0, c, 9, 10, 9, False)
    with np.errstate(invalid="ignore"):
        expected = (a.T if transpose_a else a).astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(c), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(c), np.isinf(expected))
    assert np.isnan(c).any() and np.isinf(c).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_repeatable(dtype):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, 64)).astype(dtype)
    b = rng.standard_normal((64, 96)).astype(dtype)
    first, second = np.zeros((64, 96), dtype), np.zeros((64, 96), dtype)
    matmul_tn(a, 0, b, 0, first, 64, 96, 64, False)
    matmul_tn(a, 0, b, 0, second, 64, 96, 64, False)
    np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_a", [False, True])
def test_matmul_same_bits_on_every_path(dtype, transpose_a):
    # an element's bits do not depend on which path (register block, single row,
    # single vector, scalar tail column) computes it: partial tiles agree with whole ones
    m, n, k = 11, 83, 37
    rng = np.random.default_rng(21)
    a = rng.standard_normal((k, m) if transpose_a else (m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    c0 = rng.standard_normal((m, n)).astype(dtype)
    fn = matmul_tn if transpose_a else matmul_nn
    whole = c0.copy()
    fn(a, 0, b, 0, whole, m, n, k, True)
    for i in range(m):  # one row at a time
        a_row = np.ascontiguousarray(a[:, i : i + 1] if transpose_a else a[i : i + 1])
        row = c0[i : i + 1].copy()
        fn(a_row, 0, b, 0, row, 1, n, k, True)
        np.testing.assert_array_equal(row, whole[i : i + 1])
    for j in range(n):  # one column at a time: always the scalar tail
        col = np.ascontiguousarray(c0[:, j : j + 1])
        fn(a, 0, np.ascontiguousarray(b[:, j : j + 1]), 0, col, m, 1, k, True)
        np.testing.assert_array_equal(col, whole[:, j : j + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SIZES + [(128, 128, 64), (9, 64, 5)])
@pytest.mark.parametrize("nonneg", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_nn_max_is_the_product_then_the_max_pass(dtype, m, n, k, nonneg, accumulate):
    rng = np.random.default_rng(m + 7 * n + 31 * k)
    a, b, c = _operands(rng, dtype, m, n, k, False)
    a = np.abs(a)
    if m > 2 and k > 1:
        a[1, 0] = np.nan  # a NaN row of the product: passed over by the max
    col_max0 = rng.standard_normal(n + 5).astype(dtype)
    col_max0[: n // 3] = -np.inf
    col_max0[n // 3 : n // 2] = 10.0  # already above every entry
    b[:k, n - 1] = 0.0  # a column of +0.0 products: a -0.0 maximum stays -0.0
    col_max0[n - 1] = -0.0
    if n > 1:
        col_max0[n - 2] = -np.inf  # a column of entries <= 0: with nonneg, -inf stays but for 0
        b[:k, n - 2] = -np.abs(b[:k, n - 2])
    expected_c = c.copy()
    matmul_nn(a, 0, b, 0, expected_c, m, n, k, accumulate)
    expected_max = col_max0.copy()
    for i in range(m):
        for j in range(n):
            x = expected_c[i, j]
            keep = x > expected_max[j] and (x >= 0 or not nonneg)
            expected_max[j] = x if keep else expected_max[j]
    col_max = col_max0.copy()
    a_in, b_in = a.copy(), b.copy()
    matmul_nn_max(a, 0, b, 0, c, m, n, k, col_max, nonneg, accumulate)
    np.testing.assert_array_equal(c, expected_c)
    np.testing.assert_array_equal(np.signbit(col_max), np.signbit(expected_max))
    np.testing.assert_array_equal(col_max, expected_max)
    np.testing.assert_array_equal(a, a_in)
    np.testing.assert_array_equal(b, b_in)
    assert len(matmul_nn_max.signatures) == 2


def _ulp_error(got, x, dtype):
    """|got - exp(x)| in units of the spacing of ``dtype`` at exp(x) (x87 long double reference)."""
    exact = np.exp(x.astype(np.longdouble))
    spacing = np.spacing(np.abs(exact.astype(dtype))).astype(np.longdouble)
    spacing = np.maximum(spacing, np.finfo(dtype).smallest_subnormal)
    return (np.abs(got.astype(np.longdouble) - exact) / spacing).astype(np.float64)


# the finite range of exp in each dtype (below it the result is 0 or subnormal)
EXP_RANGE = {np.float32: (-104.0, 88.72), np.float64: (-745.2, 709.78)}


@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 63, reason="needs x87 long double for a reference")
@pytest.mark.parametrize("dtype", DTYPES)
def test_exp_accuracy_in_ulps(dtype):
    rng = np.random.default_rng(7)
    lo, hi = EXP_RANGE[dtype]
    x = np.concatenate(
        [
            np.linspace(lo, hi, 200_001),
            rng.uniform(-20, 0, 50_000),
            rng.uniform(-1, 1, 50_000),
            rng.uniform(-1e-6, 1e-6, 1000),
            [0.0, -0.0, 1e-30, -1e-30, 0.5 * np.log(2), -0.5 * np.log(2), np.log(2), lo, hi],
        ]
    ).astype(dtype)
    got = x.reshape(5, -1).copy()
    exp_inplace(got, *got.shape)
    ulp = _ulp_error(got.ravel(), x, dtype)
    worst = ulp.max()
    print(f"{np.dtype(dtype).name}: max error {worst:.3f} ulp at x = {x[np.argmax(ulp)]!r}")
    # without fused multiply-adds each Horner step rounds twice (see exp_inplace)
    assert worst <= (1.0 if _simd.HAS_FMA else 1.25)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pow2_scalings_agree(dtype):
    # ldexp (used with AVX-512) and the two exponent fields (elsewhere) round
    # p * 2**t once, to the same bits, over the whole range exp needs, subnormals included
    f64 = dtype == np.float64
    fields = _exp._pow2_fields_f64 if f64 else _exp._pow2_fields_f32

    @numba.njit
    def both(p, t, by_ldexp, by_fields):
        for i in range(p.size):
            by_ldexp[i] = _exp._ldexp(p[i], np.int32(t[i]))
            by_fields[i] = fields(p[i], t[i])

    rng = np.random.default_rng(17)
    t_lo, t_hi = (-1077, 1025) if f64 else (-151, 129)
    t = np.repeat(np.arange(t_lo, t_hi + 1), 40).astype(dtype)
    p = rng.uniform(np.sqrt(0.5), np.sqrt(2.0), t.size).astype(dtype)
    p[::7] = np.nextafter(dtype(1), dtype(0))  # rounding ties and edges near 1
    by_ldexp, by_fields = np.empty_like(p), np.empty_like(p)
    both(p, t, by_ldexp, by_fields)
    with np.errstate(over="ignore"):
        expected = np.ldexp(p, t.astype(np.int32))
    np.testing.assert_array_equal(by_fields, expected)
    np.testing.assert_array_equal(by_ldexp, expected)
    assert np.any((expected > 0) & (expected < np.finfo(dtype).tiny)) and np.any(np.isinf(expected))


@pytest.mark.parametrize(
    "dtype,coefficients,bound",
    [(np.float64, _exp._EXP_Q_F64, 1.7e-17), (np.float32, _exp._EXP_Q_F32, 1.2e-8)],
)
# newer mpmath deprecates the descending coefficient order its own chebyfit returns
@pytest.mark.filterwarnings("ignore:Descending .wrt powers. order:DeprecationWarning")
def test_exp_polynomial_is_the_chebyshev_fit(dtype, coefficients, bound):
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(50):
        half_width = mpmath.log(2) / 2 * mpmath.mpf("1.0005")

        def q(r):
            return (mpmath.exp(r) - 1 - r) / r**2 if r != 0 else mpmath.mpf(0.5)

        fit = mpmath.chebyfit(q, [-half_width, half_width], len(coefficients))
        # the stored coefficients are this fit, up to the last bit or two
        np.testing.assert_allclose(
            np.array([float(c) for c in fit]), np.array(coefficients, np.float64), rtol=2 * np.finfo(dtype).eps, atol=0
        )
        # relative error of 1 + r + r**2 q(r) with the rounded coefficients
        poly = [mpmath.mpf(float(c)) for c in coefficients] + [1, 1]
        rel = [abs(mpmath.polyval(poly, r) / mpmath.exp(r) - 1) for r in mpmath.linspace(-half_width, half_width, 801)]
        assert max(rel) < bound


@pytest.mark.parametrize("dtype", DTYPES)
def test_exp_special_values(dtype):
    lo, hi = EXP_RANGE[dtype]
    x = np.array([-np.inf, -1e30, -1e4, -800.0, -746.0, lo - 1.0, -0.0, 0.0, np.inf, 1e4, 1e30, np.nan], dtype)
    got = x.reshape(1, -1).copy()
    exp_inplace(got, 1, x.size)
    got = got[0]
    expected = np.array([0, 0, 0, 0, 0, 0, 1, 1, np.inf, np.inf, np.inf, np.nan], dtype)
    np.testing.assert_array_equal(got, expected)
    # edges of the range: -104 and -88 (float32 subnormal / smallest normal), the overflow threshold
    edges = np.array([lo, -104.0, -88.0, -87.3, hi, 0.999 * hi], dtype)
    got = edges.reshape(1, -1).copy()
    exp_inplace(got, 1, edges.size)
    assert np.all(np.isfinite(got))
    assert np.all(_ulp_error(got[0], edges, dtype) <= 1.0)
    above = np.array([[np.nextafter(dtype(hi), dtype(np.inf)) * dtype(1.001), 2 * hi]], dtype)
    exp_inplace(above, 1, 2)
    assert np.all(above == np.inf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", [(1, 1), (7, 59), (97, 7), (59, 97)])
def test_exp_block_only(dtype, m, n):
    rng = np.random.default_rng(m * n)
    x = rng.uniform(-30, 0, (m + 2, n + 3)).astype(dtype)
    x[0, 0] = -np.inf
    x0 = x.copy()
    exp_inplace(x, m, n)
    np.testing.assert_allclose(x[:m, :n], np.exp(x0[:m, :n]), rtol=2 * np.finfo(dtype).eps, atol=0)
    np.testing.assert_array_equal(x[m:], x0[m:])
    np.testing.assert_array_equal(x[:, n:], x0[:, n:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", [(1, 1), (7, 59), (97, 7), (64, 128)])
@pytest.mark.parametrize("nvm", [False, True])
def test_exp_shift_sum_is_the_separate_passes(dtype, m, n, nvm):
    # same bits as shift, then exp_inplace, then row-by-row column sums
    rng = np.random.default_rng(m + n + nvm)
    x = rng.uniform(-30, 5, (m + 2, n + 3)).astype(dtype)
    x[0, 0] = -np.inf
    if m > 1 and n > 2:
        x[1, 2] = np.nan
        x[m - 1, n - 1] = -2e4  # below the range of exp: exactly 0
    shift = rng.uniform(-2, 5, n + 3).astype(dtype)
    sums0 = rng.uniform(0, 3, n + 3).astype(dtype)
    x0 = x.copy()
    expected = x0[:m, :n] - shift[:n]
    if nvm:
        expected = np.where(x0[:m, :n] >= 0, expected, dtype(-np.inf)).astype(dtype)
    exp_inplace(expected, m, n)
    expected_sums = sums0.copy()
    for i in range(m):
        expected_sums[:n] += expected[i]
    sums = sums0.copy()
    exp_shift_sum(x, m, n, shift, nvm, sums)
    np.testing.assert_array_equal(x[:m, :n], expected)
    np.testing.assert_array_equal(sums, expected_sums)
    np.testing.assert_array_equal(x[m:], x0[m:])
    np.testing.assert_array_equal(x[:, n:], x0[:, n:])
    if m > 1 and n > 2:
        assert np.isnan(x[1, 2]) != nvm  # NVM removes NaN scores, otherwise NaN propagates
    assert len(exp_shift_sum.signatures) == 2


def _packed_arithmetic(asm):
    """Packed (SIMD) multiply, scale or FMA (any sign) instructions of an x86 listing (AT&T)."""
    return re.findall(r"\bv?(?:fn?m(?:add|sub)\w*|mul|scalef)p[sd]\s[^\n]*%[xyz]mm", asm)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 listing")
@pytest.mark.parametrize("dtype", DTYPES)
def test_vectorised(dtype):
    # cached code cannot be inspected: compile uncached copies with the same options
    x = np.zeros((2, 2), dtype)
    exp_fn = _exp._exp_f64 if dtype == np.float64 else _exp._exp_f32
    row = np.zeros(2, dtype)
    for fn, args in (
        (exp_fn, (x, 2, 2)),
        (_products._matmul, (x, 0, x, 0, x.copy(), 2, 2, 2, False, False, row.copy(), 2)),
        (_exp.exp_shift_sum, (x, 2, 2, row, False, row.copy())),
    ):
        options = {key: value for key, value in fn.targetoptions.items() if key != "nopython"}
        copy = numba.njit(**options)(fn.py_func)
        copy(*args)
        assert len(_packed_arithmetic(copy.inspect_asm(copy.signatures[0]))) >= 8, fn.__name__


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_specialisation_per_dtype(dtype):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((8, 8)).astype(dtype)
    frozen = a.copy()
    frozen.setflags(write=False)
    for fn in (matmul_nn, matmul_tn):
        c = np.zeros((8, 8), dtype)
        fn(frozen, np.int32(0), frozen, 0, c, np.int32(8), np.int16(8), 8, np.bool_(False))  # read-only factors, any ints
        np.testing.assert_allclose(c, (frozen.T if fn is matmul_tn else frozen) @ frozen, rtol=1e-5)
        assert len(fn.signatures) == 2
        with pytest.raises(TypeError):
            fn(a[:, :4], 0, a, 0, c, 4, 4, 4, False)  # not C-contiguous
        with pytest.raises(TypeError):
            fn(a, 0, a, 0, c.astype(np.float32 if dtype == np.float64 else np.float64), 4, 4, 4, False)  # mixed dtypes
    exp_inplace(a, np.int32(2), 3)
    assert len(exp_inplace.signatures) == 2
    with pytest.raises(TypeError):
        exp_inplace(frozen, 2, 2)  # written in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_called_from_jitted_code(dtype):
    # the way the kernels call them: literal flags and sizes inside njit code
    @numba.njit
    def tile_softmax_times_v(s, v, out):
        exp_inplace(s, 5, 6)
        matmul_nn(s, 0, v, 0, out, 5, 3, 6, False)
        matmul_tn(s, 0, s, 0, out, 6, 3, 5, True)

    rng = np.random.default_rng(11)
    s = rng.uniform(-3, 0, (5, 6)).astype(dtype)
    v = rng.standard_normal((6, 3)).astype(dtype)
    out = np.zeros((6, 3), dtype)
    p = np.exp(s.astype(np.float64))
    tile_softmax_times_v(s, v, out)
    expected = np.zeros((6, 3))
    expected[:5] = p @ v
    expected += p.T @ p[:, :3]
    np.testing.assert_allclose(out, expected, rtol=20 * np.finfo(dtype).eps)
    assert len(matmul_nn.signatures) == len(matmul_tn.signatures) == len(exp_inplace.signatures) == 2



def _head_rows(rng, dtype, rows, heads, width, head):
    """A C-contiguous ``(rows, heads * width)`` array (the rows of a ``(B, N, H, D)`` tile) and head ``head``'s copy."""
    wide = rng.standard_normal((rows, heads * width)).astype(dtype)
    return wide, np.ascontiguousarray(wide[:, head * width : (head + 1) * width])


def _compiled_caller(fn):
    """``fn`` called from jitted code: through its C entry point where the private path is on."""

    @numba.njit
    def call(a, a_col, b, b_col, c, m, n, k):
        fn(a, a_col, b, b_col, c, m, n, k, True)

    return call


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(7, 59, 37), (33, 40, 16), (64, 64, 64), (5, 3, 9)])
@pytest.mark.parametrize("fn", [matmul_nn, matmul_tn, matmul_nn_max], ids=lambda f: f.__name__)
def test_factors_from_a_column_are_read_in_place(dtype, m, n, k, fn):
    # a factor that starts at a column of a wider array (one head's entries, the array's
    # row length its leading dimension) gives the bits of the same factor on its own
    rng = np.random.default_rng(m * n + k)
    transposed = fn is matmul_tn
    a_wide, a = _head_rows(rng, dtype, k if transposed else m, 3, m if transposed else k, 2)
    b_wide, b = _head_rows(rng, dtype, k, 4, n, 1)
    a_col, b_col = 2 * a.shape[1], b.shape[1]
    c0 = rng.standard_normal((m, n)).astype(dtype)

    def product(*factors):
        c = c0.copy()
        col_max = np.full(n, -np.inf, dtype)
        if fn is matmul_nn_max:
            fn(*factors, c, m, n, k, col_max, False, True)
        else:
            fn(*factors, c, m, n, k, True)
        return c, col_max

    alone = product(a, 0, b, 0)
    for got in product(a_wide, a_col, b_wide, b_col), product(a_wide, a_col, b, 0), product(a, 0, b_wide, b_col):
        np.testing.assert_array_equal(got[0], alone[0])
        np.testing.assert_array_equal(got[1], alone[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_calls_read_columns_and_refuse_strided_views(dtype):
    # through the C entry points (pointer and shape: a strided view would be misread) as
    # called directly, a factor from a column gives the same bits and a strided view is a
    # typing error
    from elastic_np.cpu._tiles import calls as _calls

    _simd.compile_for(dtype, (_calls.matmul_nn, _calls.matmul_tn))
    rng = np.random.default_rng(2)
    a_wide, a = _head_rows(rng, dtype, 9, 3, 9, 1)
    b_wide, b = _head_rows(rng, dtype, 9, 2, 20, 1)
    for fn, typed in ((_calls.matmul_nn, matmul_nn), (_calls.matmul_tn, matmul_tn)):
        call = _compiled_caller(fn)
        expected = np.zeros((9, 20), dtype)
        typed(a, 0, b, 0, expected, 9, 20, 9, True)
        c = np.zeros((9, 20), dtype)
        call(a_wide, 9, b_wide, 20, c, 9, 20, 9)
        np.testing.assert_array_equal(c, expected)
        for view in (a_wide[:, 9:18], a_wide[:, ::3], a.T):
            with pytest.raises(numba.core.errors.TypingError):
                call(view, 0, b, 0, c, 9, 20, 9)
            with pytest.raises(numba.core.errors.TypingError):
                call(a, 0, view, 0, c, 9, 9, 9)
            with pytest.raises(TypeError):
                typed(view, 0, b, 0, c, 9, 20, 9, True)
