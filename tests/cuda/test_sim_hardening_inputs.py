"""Extreme option values on the CUDA kernels (issue 22, items 3, 4, 6 and 7).

The CUDA side of ``tests/test_hardening_inputs.py``: a tiny ``sigma`` is
computed (the gate constants avoid ``sigma**2`` and ``sigma**3``), options
beyond the kernel dtype are rejected as in every backend, ``dtau`` survives
``tau**2`` underflowing. Run with ``NUMBA_ENABLE_CUDASIM=1`` (see conftest).
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference

pytestmark = pytest.mark.usefixtures("small_tiles")

DTYPES = [np.float64, np.float32]


def inputs(B=1, H=2, N=5, M=5, D=4, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype)
                 for shape in ((B, H, N, D), (B, H, M, D), (B, H, M, D), (B, H, N, D)))


def run_cuda(q, k, v, dout, **options):
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cuda", **options)
    return out, lse, enp.attention_backward(dout, q, k, v, out, lse, backend="cuda", **options)


@pytest.mark.parametrize("dtype,sigma", [(np.float64, 1e-120), (np.float64, 1e-170), (np.float64, 1e-300),
                                         (np.float32, 1e-20), (np.float32, 2e-38)])
def test_tiny_sigma_keeps_only_the_aligned_key(dtype, sigma):
    q, k, v, dout = inputs(dtype=dtype)
    out, lse, grads = run_cuda(q, k, v, dout, dynamic_window=enp.DynamicWindow(sigma, sharpness=2.0))
    diagonal = np.eye(5, dtype=bool)
    want_out, want_lse = reference.attention(q, k, v, mask=diagonal)
    want = reference.attention_backward(dout, q, k, v, want_out, want_lse, mask=diagonal)
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(out, want_out, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(lse, want_lse, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(grads.dq, want.dq, rtol=rtol, atol=rtol)
    assert grads.dsigma == 0.0


def test_moderate_sigma_gradient_matches_the_reference():
    """The gate rewritten with u = x / sigma: dsigma where it is not 0."""
    q, k, v, dout = inputs(N=9, M=9)
    window = enp.DynamicWindow(np.array([0.2, 0.7]), sharpness=3.0)
    out, lse, grads = run_cuda(q, k, v, dout, dynamic_window=window)
    want_out, want_lse = reference.attention(q, k, v, dynamic_window=window)
    want = reference.attention_backward(dout, q, k, v, want_out, want_lse, dynamic_window=window)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    assert np.all(np.abs(want.dsigma) > 1e-3)
    np.testing.assert_allclose(grads.dsigma, want.dsigma, rtol=1e-11)


@pytest.mark.parametrize("name,options", [
    ("tau", dict(tau=1e-39)),
    ("scale", dict(scale=1e300)),
    ("alibi_slopes", dict(alibi_slopes=np.array([1e300, 0.5]))),
    ("softcap", dict(softcap=1e-40)),
    ("beta", dict(beta=1e39)),
    ("sigma", dict(dynamic_window=enp.DynamicWindow(1e-39))),
])
def test_float32_options_beyond_float32_are_rejected(name, options):
    q, k, v, dout = inputs(dtype=np.float32)
    with pytest.raises(ValueError, match=f"`{name}`.*float32"):
        run_cuda(q, k, v, dout, **options)


@pytest.mark.parametrize("name,options", [
    ("tau", dict(tau=5e-324, scale=1e-300)),
    ("scale", dict(scale=1e300, tau=1e-10)),
    ("softcap", dict(softcap=1e-310)),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_options_beyond_float64_are_rejected(dtype, name, options):
    q, k, v, dout = inputs(dtype=dtype)
    with pytest.raises(ValueError, match=f"`{name}`"):
        run_cuda(q, k, v, dout, **options)


def test_dtau_with_tau_squared_below_the_float64_range():
    q, k, v, dout = inputs()
    grads = run_cuda(q, k, v, dout, tau=1e-160, scale=1e-160)[2]
    want = reference.attention_backward(dout, q, k, v, *reference.attention(q, k, v, scale=1.0), scale=1.0)
    np.testing.assert_allclose(grads.dtau * 1e-160, want.dtau, rtol=1e-11)


def test_the_largest_window_size_is_unbounded():
    q, k, v, dout = inputs()
    got = run_cuda(q, k, v, dout, window_size=(2**63 - 1, 0))
    want = run_cuda(q, k, v, dout, window_size=(-1, 0))
    np.testing.assert_array_equal(got[0], want[0])
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(got[2], name), getattr(want[2], name))
    with pytest.raises(ValueError, match="`window_size`"):
        run_cuda(q, k, v, dout, window_size=(2**63, 0))


@pytest.mark.parametrize("name", ["causal", "nvm"])
def test_boolean_options_must_be_booleans(name):
    q, k, v, dout = inputs()
    with pytest.raises(TypeError, match=f"`{name}` must be a bool"):
        run_cuda(q, k, v, dout, **{name: "False"})
