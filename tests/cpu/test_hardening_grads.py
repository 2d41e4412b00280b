"""Gradients at the edges: a float32 sink gradient, empty shapes with a bias, saturated tanh.

The CUDA kernels have the same tests in ``tests/cuda/test_sim_attention.py``.
"""

import itertools

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference
from mp_oracle import mp_attention_grads, relative_errors, saturated_inputs


def test_float32_dbeta_does_not_overflow():
    # every row has lse = -100 * 3 + log 3 < -88.7: exp(-lse) overflows float32
    q = np.full((1, 1, 2, 1), 10, np.float32)
    k = np.full((1, 1, 3, 1), -10, np.float32)
    v = np.ones((1, 1, 3, 2), np.float32)
    dout = np.ones((1, 1, 2, 2), np.float32)
    out, lse = enp.attention(q, k, v, scale=1.0, return_lse=True, backend="cpu")
    grads = enp.attention_backward(dout, q, k, v, out, lse, scale=1.0, backend="cpu")
    q64, k64, v64, d64 = (a.astype(np.float64) for a in (q, k, v, dout))
    o64, l64 = reference.attention(q64, k64, v64, scale=1.0)
    want = reference.attention_backward(d64, q64, k64, v64, o64, l64, scale=1.0)
    assert np.isfinite(grads.dbeta)
    assert want.dbeta < -1e43
    np.testing.assert_allclose(grads.dbeta, want.dbeta, rtol=1e-4)


def test_float32_dbeta_of_rows_of_both_signs_is_finite():
    rng = np.random.default_rng(3)
    q = np.full((1, 1, 4, 1), 10, np.float32)
    k = np.full((1, 1, 3, 1), -10, np.float32)
    v = rng.standard_normal((1, 1, 3, 2)).astype(np.float32)
    dout = rng.standard_normal((1, 1, 4, 2)).astype(np.float32)
    options = dict(scale=1.0, beta=np.float32(0.0))
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **options)
    grads = enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **options)
    assert np.isfinite(grads.dbeta)
    want = enp.attention_backward(*(a.astype(np.float64) for a in (dout, q, k, v, out, lse)),
                                  backend="reference", **options)
    np.testing.assert_allclose(grads.dbeta, want.dbeta, rtol=1e-3)


def test_dbeta_of_overflowing_rows_of_both_signs_is_an_infinity_not_nan():
    """Rows whose exp(-lse) overflows float64 in two heads, with a beta shared by the heads."""
    q = np.array([10.0, -13.0, 60.0, 10.0, -53.0, 36.0]).reshape(1, 2, 3, 1)
    k = np.array([130.0, 95.0]).reshape(1, 2, 1, 1)
    v = np.array([-0.7, -1.3]).reshape(1, 2, 1, 1)
    dout = np.array([-0.6, 0.04, -2.3, -0.2, -1.2, -0.7]).reshape(1, 2, 3, 1)
    for backend, dtype in (("reference", np.float64), ("cpu", np.float64), ("cpu", np.float32)):
        args = [a.astype(dtype) for a in (q, k, v)]
        out, lse = enp.attention(*args, scale=1.0, return_lse=True, backend=backend)
        grads = enp.attention_backward(dout.astype(dtype), *args, out, lse, scale=1.0, backend=backend)
        # the row with lse = -95 * 53 dominates: delta = -1.2 * -1.3 > 0, dbeta = -inf
        assert grads.dbeta == -np.inf, (backend, dtype)


def test_dbeta_of_overflowing_rows_that_cancel_exactly_is_zero():
    """Two equal rows with exp(-lse) = exp(1000) and opposite delta: the sum is exactly 0, not NaN."""
    q = np.full((1, 1, 2, 1), -10.0)
    k = np.full((1, 1, 1, 1), 100.0)
    v = np.ones((1, 1, 1, 1))
    dout = np.array([1.0, -1.0]).reshape(1, 1, 2, 1)
    for backend, dtype in (("reference", np.float64), ("cpu", np.float64), ("cpu", np.float32)):
        args = [a.astype(dtype) for a in (q, k, v)]
        out, lse = enp.attention(*args, scale=1.0, return_lse=True, backend=backend)
        grads = enp.attention_backward(dout.astype(dtype), *args, out, lse, scale=1.0, backend=backend)
        assert grads.dbeta == 0.0, (backend, dtype, grads.dbeta)


def test_elastic_softmax_vjp_dbeta_of_overflowing_rows():
    # log D = x / tau = -1000 and -1100: exp(-log D) overflows in both rows
    dy = np.array([[1.0], [-1.0]])
    options = dict(tau=1e-3, beta=0.0, nvm=False)
    assert reference.elastic_softmax_vjp(np.array([[-1.0], [-1.1]]), dy, **options)[2] == np.inf
    assert reference.elastic_softmax_vjp(np.array([[-1.0], [-1.0]]), dy, **options)[2] == 0.0


def test_dbeta_that_fits_float64_survives_an_overflowing_factor():
    # exp(-lse) = exp(720) overflows, delta = 1e-10 brings the product back to 1e-10 e^720 ~ 1e303
    from elastic_np._contract._grads import sink_gradient

    delta = np.array([[[1e-10]]])
    lse = np.array([[[-720.0]]])
    np.testing.assert_allclose(sink_gradient(delta, lse), [-1e-10 * np.exp(360.0) * np.exp(360.0)], rtol=1e-13)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("lse_dtype", [np.float32, np.float64])
def test_the_compiled_sink_gradient_is_the_contracts(shared, lse_dtype):
    """`elastic_np.cpu._prefill.sink` against `elastic_np._contract._grads.sink_gradient`: rows without a key
    (``lse = -inf``) or without a cotangent, rows whose ``exp(-lse)`` overflows, a head without a live row."""
    from elastic_np._contract._grads import sink_gradient
    from elastic_np.cpu._prefill import sink

    rng = np.random.default_rng(4)
    B, H, N = 2, 4, 37
    delta = rng.standard_normal((B, H, N))
    lse = (rng.standard_normal((B, H, N)) * 30).astype(lse_dtype)
    lse[rng.random((B, H, N)) < 0.2] = -np.inf
    delta[rng.random((B, H, N)) < 0.2] = 0.0
    lse[:, 1, :3] = -800.0  # exp(800) overflows float64: head 1's sum is +-inf
    delta[:, 2] = 0.0  # head 2 has no live row: 0
    lse[:, 3] = -720.0  # head 3: delta e^720 overflows termwise, the sum 1e-10 e^720 fits
    delta[:, 3] = 0.0
    delta[0, 3, 0] = 1e-10

    class Problem:
        beta_shape = (1,) if shared else (H,)

    got = sink.sink_gradient(Problem(), delta, lse)
    want = sink_gradient(delta, lse, per_head=not shared).reshape(-1)
    assert got.shape == want.shape and got.dtype == np.float64
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite])
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-13, atol=0)
    if not shared:
        assert got[2] == 0.0 and np.isinf(got[1]) and np.isfinite(got[3]) and got[3] < -1e300


# --- empty batches and key sets with every bias broadcast shape ---------------------------

EMPTY_SHAPES = {  # (B, H, Hkv, N, M)
    "no keys": (2, 1, 1, 4, 0),
    "no batch": (0, 2, 1, 4, 5),
    "no queries": (2, 2, 1, 0, 5),
    "no heads": (2, 0, 1, 4, 5),
    "nothing": (0, 2, 2, 0, 0),
}


def bias_shapes(B, H, N, M):
    """Every shape that broadcasts to (B, H, N, M), 2-D to 4-D."""
    shapes = []
    for keep in itertools.product((True, False), repeat=4):
        full = tuple(n if k else 1 for n, k in zip((B, H, N, M), keep))
        shapes += [full, full[1:], full[2:]]
    return sorted(set(shapes))


def empty_cases():
    for name, (B, H, Hkv, N, M) in EMPTY_SHAPES.items():
        for shape in bias_shapes(B, H, N, M):
            yield pytest.param((B, H, Hkv, N, M), shape, id=f"{name}-bias{shape}")


@pytest.mark.parametrize("dims, bias_shape", list(empty_cases()))
def test_empty_problems_with_a_bias(dims, bias_shape):
    B, H, Hkv, N, M = dims
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, N, 8))
    k = rng.standard_normal((B, Hkv, M, 8))
    v = rng.standard_normal((B, Hkv, M, 8))
    dout = rng.standard_normal((B, H, N, 8))
    bias = rng.standard_normal(bias_shape)
    opts = dict(bias=bias, beta=0.5)
    want_out, want_lse = reference.attention(q, k, v, **opts)
    want = reference.attention_backward(dout, q, k, v, want_out, want_lse, **opts)
    for dtype in (np.float64, np.float32):
        args = [a.astype(dtype) for a in (q, k, v)]
        o = dict(opts, bias=bias.astype(dtype))
        out, lse = enp.attention(*args, return_lse=True, backend="cpu", **o)
        grads = enp.attention_backward(dout.astype(dtype), *args, out, lse, backend="cpu", **o)
        np.testing.assert_array_equal(out, want_out.astype(dtype))
        for name in ("dq", "dk", "dv", "dbias"):
            got, ref = getattr(grads, name), getattr(want, name)
            assert got.shape == ref.shape and got.dtype == dtype, name
            np.testing.assert_array_equal(got, ref.astype(dtype), err_msg=name)
        assert grads.dbeta == want.dbeta == 0.0


# --- saturated soft-caps and gates against a 40-digit evaluation ---------------------------

BACKENDS = ["reference", "cpu"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [0.09, 0.02])  # every |score| / softcap >= 16, >= 74
def test_saturated_softcap_slope(backend, softcap):
    q, k, v, dout = saturated_inputs()
    raw = q @ k.T
    assert np.abs(raw).min() / softcap >= 16
    options = dict(scale=1.0, tau=0.7, beta=0.3, softcap=softcap)
    want = mp_attention_grads(q, k, v, dout, 1.0, 0.7, 0.3, softcap=softcap)
    args = [a[None, None] for a in (q, k, v)]
    out, lse = enp.attention(*args, return_lse=True, backend=backend, **options)
    grads = enp.attention_backward(dout[None, None], *args, out, lse, backend=backend, **options)
    errors = relative_errors(grads, want)
    assert max(errors.values()) < 1e-12, errors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sharpness", [500.0, 2000.0])  # sharpness * f >= 18 everywhere
def test_saturated_gate_sigma_gradient(backend, sharpness):
    rng = np.random.default_rng(1)
    N, M, D = 3, 4, 4
    q, k, v, dout = (rng.standard_normal(s) for s in ((N, D), (M, D), (M, D), (N, D)))
    window = enp.DynamicWindow(0.9, sharpness=sharpness, threshold=0.0)
    options = dict(scale=0.5, tau=1.3, dynamic_window=window)
    want = mp_attention_grads(q, k, v, dout, 0.5, 1.3, 0.0, sigma=0.9, sharpness=sharpness)
    assert abs(want["dsigma"]) < 1e-10  # the gate's slope is all but 0: no cancellation may hide it
    args = [a[None, None] for a in (q, k, v)]
    out, lse = enp.attention(*args, return_lse=True, backend=backend, **options)
    grads = enp.attention_backward(dout[None, None], *args, out, lse, backend=backend, **options)
    errors = relative_errors(grads, want)
    assert max(errors.values()) < 1e-12, errors
