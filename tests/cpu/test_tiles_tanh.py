"""The vectorisable hyperbolic tangent of the tile primitives against mpmath."""

import platform
import re

import mpmath
import numba
import numpy as np
import pytest

from elastic_np.cpu._tiles.tanh import tanh_any, tanh_inplace
from elastic_np.cpu._tiles.simd import compile_for

DTYPES = [np.float32, np.float64]
for _dtype in DTYPES:
    compile_for(_dtype)


def _ulp_error(got, x, dtype):
    """``|got - tanh(x)|`` in units of the last place of the exact result (mpmath, 40 digits)."""
    with mpmath.workdps(40):
        exact = np.array([mpmath.tanh(mpmath.mpf(float(a))) for a in x], dtype=object)
    exact64 = exact.astype(np.float64)
    spacing = np.spacing(np.abs(exact64).astype(dtype)).astype(np.float64)
    spacing = np.maximum(spacing, float(np.finfo(dtype).smallest_subnormal))
    diff = np.array(
        [abs(mpmath.mpf(float(g)) - e) for g, e in zip(got, exact)], dtype=object
    ).astype(np.float64)
    return diff / spacing


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_accuracy_in_ulps(dtype):
    rng = np.random.default_rng(5)
    x = np.concatenate(
        [
            rng.standard_normal(2000) * scale
            for scale in (1e-20, 1e-8, 1e-4, 1e-2, 0.1, 0.35, 1.0, 3.0, 10.0, 30.0)
        ]
        + [
            np.linspace(-20, 20, 4000),
            # around the reduction's steps t = -1, -2 (|2x| near ln(2)/2, 3 ln(2)/2)
            np.log(2) / 4 + np.linspace(-1e-3, 1e-3, 200),
            3 * np.log(2) / 4 + np.linspace(-1e-3, 1e-3, 200),
        ]
    ).astype(dtype)
    got = x.reshape(2, -1).copy()
    tanh_inplace(got, *got.shape)
    assert got.dtype == dtype
    ulp = _ulp_error(got.ravel(), x, dtype)
    worst = ulp.max()
    print(f"{np.dtype(dtype).name}: max error {worst:.3f} ulp at x = {x[np.argmax(ulp)]!r}")
    assert worst <= 4.0
    # odd, and exactly x for tiny x
    neg = -x.reshape(2, -1)
    tanh_inplace(neg, *neg.shape)
    np.testing.assert_array_equal(neg.ravel(), -got.ravel())


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_special_values(dtype):
    tiny = np.finfo(dtype).smallest_subnormal
    x = np.array([[0.0, -0.0, tiny, -tiny, 400.0, -400.0, np.inf, -np.inf, np.nan]], dtype)
    tanh_inplace(x, 1, x.shape[1])
    np.testing.assert_array_equal(x[0, :8], np.array([0.0, -0.0, tiny, -tiny, 1, -1, 1, -1], dtype))
    np.testing.assert_array_equal(np.signbit(x[0, :2]), [False, True])
    assert np.isnan(x[0, 8])


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_is_non_decreasing_over_consecutive_floats(dtype):
    # The forward kernel caps a tile's raw column maxima instead of taking the
    # maxima of the capped tile: the same only while tanh never decreases.
    # Windows of consecutive floats around the reduction's steps, where the
    # argument is clamped (|x| = 10 in float32, 32 in float64) and where tanh
    # reaches 1.
    int_type = np.int32 if dtype == np.float32 else np.int64
    centers = [1e-6, 1e-3, 0.1, np.log(2) / 4, 0.5, 3 * np.log(2) / 4, 1.0, 2.0, 4.5, 9.0, 10.0, 19.0, 32.0]
    for center in centers:
        bits = np.array([center], dtype).view(int_type)[0]
        x = (bits + np.arange(-50_000, 50_000, dtype=int_type)).view(dtype).reshape(1, -1).copy()
        tanh_inplace(x, *x.shape)
        steps = np.diff(x.ravel())
        assert (steps >= 0).all(), f"tanh decreases near {center}: {np.flatnonzero(steps < 0)[:5]}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_block_only(dtype):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 9)).astype(dtype)
    before = x.copy()
    tanh_inplace(x, 4, 7)
    np.testing.assert_allclose(x[:4, :7], np.tanh(before[:4, :7]), rtol=4 * np.finfo(dtype).eps)
    outside = np.ones(x.shape, bool)
    outside[:4, :7] = False
    np.testing.assert_array_equal(x[outside], before[outside])
    assert len(tanh_inplace.signatures) == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_any_from_jitted_code_keeps_the_dtype(dtype):
    @numba.njit
    def capped(x, cap):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = cap * tanh_any(x[i] / cap)
        return out

    x = np.linspace(-50, 50, 101).astype(dtype)
    cap = dtype(7.0)
    got = capped(x, cap)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, cap * np.tanh(x / cap), rtol=8 * np.finfo(dtype).eps)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 listing")
@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_vectorised(dtype):
    # cached code cannot be inspected: compile an uncached copy with the same options
    fn = tanh_inplace
    options = {key: value for key, value in fn.targetoptions.items() if key != "nopython"}
    copy = numba.njit(**options)(fn.py_func)
    copy(np.zeros((2, 2), dtype), 2, 2)
    asm = copy.inspect_asm(copy.signatures[0])
    packed = re.findall(r"\bv?(?:fmadd\w*|mul|div)p[sd]\s+%?[xyz]mm", asm)
    assert len(packed) >= 8
    assert not re.search(r"call\w*\s+\S*tanh", asm)  # no call to the scalar libm function
