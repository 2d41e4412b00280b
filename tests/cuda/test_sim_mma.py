"""The tensor-core products (`elastic_np.cuda._tensor_core.mma`) of one warp against NumPy.

On the simulator this checks the Python stand-ins; on a GPU the inline PTX,
and with it the fragment layouts every tensor-core kernel relies on: each
lane loads its fragments of ``A`` (16 x 8) and ``B`` (8 x 8) by the layout of
the module's docstring, and the product must be ``A B + C`` for random,
non-symmetric matrices.
"""

import numpy as np
import pytest

from elastic_np.cuda._runtime import gpu as _host

cuda = _host.cuda_module()
_mma = _host.kernel_module("_tensor_core.mma")


@cuda.jit
def _one_warp(a, b, c, d, split_a, split_b, three):
    lane = cuda.threadIdx.x
    g = lane // 4
    t = lane % 4
    a0, a0s = _mma.split(a[g, t])
    a1, a1s = _mma.split(a[g + 8, t])
    a2, a2s = _mma.split(a[g, t + 4])
    a3, a3s = _mma.split(a[g + 8, t + 4])
    b0, b0s = _mma.split(b[t, g])
    b1, b1s = _mma.split(b[t + 4, g])
    split_a[g, t], split_a[g + 8, t], split_a[g, t + 4], split_a[g + 8, t + 4] = a0s, a1s, a2s, a3s
    split_b[t, g], split_b[t + 4, g] = b0s, b1s
    c0, c1, c2, c3 = c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]
    if three:
        c0, c1, c2, c3 = _mma.mma(a0s, a1s, a2s, a3s, b0, b1, c0, c1, c2, c3)
        c0, c1, c2, c3 = _mma.mma(a0, a1, a2, a3, b0s, b1s, c0, c1, c2, c3)
    c0, c1, c2, c3 = _mma.mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = c0, c1, c2, c3


def _tf32(x):
    """``x`` rounded to TF32 (nearest, ties away from zero), as ``cvt.rna.tf32.f32``."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _run(a, b, c, three):
    d = np.zeros_like(c)
    split_a = np.zeros_like(a)
    split_b = np.zeros_like(b)
    _one_warp[1, 32](a, b, c, d, split_a, split_b, three)
    return d, split_a, split_b


@pytest.fixture
def matrices():
    rng = np.random.default_rng(5)
    return rng.standard_normal((16, 8)), rng.standard_normal((8, 8)), rng.standard_normal((16, 8))


def test_tf32_product_of_one_warp(matrices):
    a, b, c = (m.astype(np.float32) for m in matrices)
    d, _, _ = _run(a, b, c, False)
    # TF32 inputs multiply exactly in float32; the sum of 8 terms and C rounds a few times
    exact = _tf32(a).astype(np.float64) @ _tf32(b).astype(np.float64) + c
    scale = np.abs(_tf32(a)).astype(np.float64) @ np.abs(_tf32(b)) + np.abs(c)
    assert np.all(np.abs(d - exact) <= 10 * np.finfo(np.float32).eps * scale)
    # one TF32 product is far from float32 accuracy
    assert np.abs(d - (a.astype(np.float64) @ b + c)).max() > 1e-5


def test_three_tf32_products_keep_float32_accuracy(matrices):
    a, b, c = (m.astype(np.float32) for m in matrices)
    d, split_a, split_b = _run(a, b, c, True)
    assert np.array_equal(split_a, _tf32(a - _tf32(a)))
    assert np.array_equal(split_b, _tf32(b - _tf32(b)))
    exact = a.astype(np.float64) @ b.astype(np.float64) + c
    scale = np.abs(a).astype(np.float64) @ np.abs(b) + np.abs(c)
    assert np.all(np.abs(d - exact) <= 10 * np.finfo(np.float32).eps * scale)


def test_split_of_infinities_and_nan():
    a = np.zeros((16, 8), dtype=np.float32)
    a[0, 0], a[1, 0], a[2, 0] = np.inf, -np.inf, np.nan
    a[3, 0] = np.finfo(np.float32).max  # rounds up to inf in TF32
    b = np.eye(8, dtype=np.float32)
    _, split_a, _ = _run(a, b, np.zeros((16, 8), dtype=np.float32), True)
    assert np.array_equal(split_a[:4, 0], np.zeros(4, dtype=np.float32))


def test_float64_product_of_one_warp(matrices):
    a, b, c = matrices
    d, split_a, _ = _run(a, b, c, False)
    assert not split_a.any()
    exact = a @ b + c
    scale = np.abs(a) @ np.abs(b) + np.abs(c)
    assert np.all(np.abs(d - exact) <= 10 * np.finfo(np.float64).eps * scale)
