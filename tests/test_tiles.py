"""Tile primitives of the CPU kernels against NumPy."""

import numpy as np
import pytest

from elastic_np._tiles import exp_inplace, matmul_nn, matmul_tn

DTYPES = [np.float32, np.float64]
SIZES = [(1, 1, 1), (7, 59, 97), (97, 7, 59), (59, 97, 7), (64, 64, 64), (33, 130, 64)]


def _rtol(dtype):
    return 1e-5 if dtype == np.float32 else 1e-13


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
    fn(a, b, c, m, n, k, accumulate)
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
    matmul_nn(a, a, c, 3, 4, 0, False)
    assert np.all(c[:3, :4] == 0) and np.all(c[3] == 1) and np.all(c[:, 4] == 1)


def _ulp_error(got, expected64, dtype):
    """|got - exact| in units of the last place of the exact value in ``dtype``."""
    exact = expected64.astype(dtype)
    spacing = np.spacing(np.abs(exact)).astype(np.float64)
    spacing = np.maximum(spacing, np.finfo(dtype).smallest_subnormal)
    return np.abs(got.astype(np.float64) - expected64) / spacing


@pytest.mark.parametrize("dtype", DTYPES)
def test_exp_accuracy(dtype):
    rng = np.random.default_rng(7)
    hi = 88.0 if dtype == np.float32 else 709.0
    lo = -87.0 if dtype == np.float32 else -708.0
    x = np.concatenate(
        [
            rng.uniform(lo, hi, 4000),
            rng.uniform(-20, 0, 4000),
            rng.uniform(-1, 1, 2000),
            [0.0, -0.0, 1e-30, -1e-30, 0.5 * np.log(2), -np.log(2), np.log(2), lo, hi],
        ]
    ).astype(dtype)
    x2 = x.reshape(1, -1).copy()
    m, n = x2.shape
    exp_inplace(x2, m, n)
    # long double reference is exact enough for both dtypes on x86
    expected = np.exp(x.astype(np.longdouble)).astype(np.float64).reshape(m, n)
    ulp = _ulp_error(x2, expected, dtype)
    assert ulp.max() <= 2.0, ulp.max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_exp_special_values(dtype):
    x = np.array([[-np.inf, -1e4, -1e30, 0.0, -104.0, -88.0, -746.0, -800.0]], dtype)
    exp_inplace(x, 1, x.shape[1])
    with np.errstate(under="ignore"):
        expected = np.exp(np.array([-np.inf, -1e4, -1e30, 0.0, -104.0, -88.0, -746.0, -800.0]))
    assert np.all(np.isfinite(x))
    assert x[0, 0] == 0.0 and x[0, 1] == 0.0 and x[0, 2] == 0.0 and x[0, 3] == 1.0
    tiny = np.finfo(dtype).smallest_subnormal
    np.testing.assert_allclose(x[0].astype(np.float64), expected.astype(dtype), rtol=1e-6, atol=2 * tiny)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", [(1, 1), (7, 59), (97, 7)])
def test_exp_block_only(dtype, m, n):
    rng = np.random.default_rng(m * n)
    x = rng.uniform(-30, 0, (m + 2, n + 3)).astype(dtype)
    x0 = x.copy()
    exp_inplace(x, m, n)
    np.testing.assert_allclose(x[:m, :n], np.exp(x0[:m, :n]), rtol=4 * np.finfo(dtype).eps)
    np.testing.assert_array_equal(x[m:], x0[m:])
    np.testing.assert_array_equal(x[:, n:], x0[:, n:])
