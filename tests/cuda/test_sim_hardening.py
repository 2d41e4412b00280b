"""Gradients at the edges on the CUDA kernels: float32 dbeta, empty shapes with a bias, saturated tanh.

The same cases as ``tests/test_hardening_grads.py`` for the CPU kernels and the reference.
"""

import os
import sys

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mp_oracle import mp_attention_grads, relative_errors, saturated_inputs  # noqa: E402


def test_float32_dbeta_does_not_overflow():
    q = np.full((1, 1, 2, 1), 10, np.float32)
    k = np.full((1, 1, 3, 1), -10, np.float32)
    v = np.ones((1, 1, 3, 2), np.float32)
    dout = np.ones((1, 1, 2, 2), np.float32)
    out, lse = enp.attention(q, k, v, scale=1.0, return_lse=True, backend="cuda")
    grads = enp.attention_backward(dout, q, k, v, out, lse, scale=1.0, backend="cuda")
    q64, k64, v64, d64 = (a.astype(np.float64) for a in (q, k, v, dout))
    o64, l64 = reference.attention(q64, k64, v64, scale=1.0)
    want = reference.attention_backward(d64, q64, k64, v64, o64, l64, scale=1.0)
    assert want.dbeta < -1e43
    np.testing.assert_allclose(grads.dbeta, want.dbeta, rtol=1e-4)


@pytest.mark.parametrize(
    "q_shape, kv_shape, bias_shape",
    [((2, 1, 4, 8), (2, 1, 0, 8), (4, 0)), ((0, 2, 4, 8), (0, 1, 5, 8), (4, 5)),
     ((2, 2, 0, 8), (2, 1, 5, 8), (1, 2, 1, 5)), ((2, 1, 4, 8), (2, 1, 0, 8), (2, 1, 4, 1))],
)
def test_empty_problems_with_a_bias(q_shape, kv_shape, bias_shape):
    rng = np.random.default_rng(0)
    q, dout = rng.standard_normal(q_shape), rng.standard_normal(q_shape)
    k, v = rng.standard_normal(kv_shape), rng.standard_normal(kv_shape)
    opts = dict(bias=rng.standard_normal(bias_shape), beta=0.5)
    want_out, want_lse = reference.attention(q, k, v, **opts)
    want = reference.attention_backward(dout, q, k, v, want_out, want_lse, **opts)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cuda", **opts)
    grads = enp.attention_backward(dout, q, k, v, out, lse, backend="cuda", **opts)
    np.testing.assert_array_equal(out, want_out)
    for name in ("dq", "dk", "dv", "dbias"):
        np.testing.assert_array_equal(getattr(grads, name), getattr(want, name), err_msg=name)
    assert grads.dbeta == want.dbeta == 0.0


def test_saturated_softcap_slope():
    q, k, v, dout = saturated_inputs()
    options = dict(scale=1.0, tau=0.7, beta=0.3, softcap=0.05)
    want = mp_attention_grads(q, k, v, dout, 1.0, 0.7, 0.3, softcap=0.05)
    args = [a[None, None] for a in (q, k, v)]
    out, lse = enp.attention(*args, return_lse=True, backend="cuda", **options)
    grads = enp.attention_backward(dout[None, None], *args, out, lse, backend="cuda", **options)
    errors = relative_errors(grads, want)
    assert max(errors.values()) < 1e-12, errors


def test_saturated_gate_sigma_gradient():
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal(s) for s in ((3, 4), (4, 4), (4, 4), (3, 4)))
    options = dict(scale=0.5, tau=1.3, dynamic_window=enp.DynamicWindow(0.9, sharpness=500.0, threshold=0.0))
    want = mp_attention_grads(q, k, v, dout, 0.5, 1.3, 0.0, sigma=0.9, sharpness=500.0)
    args = [a[None, None] for a in (q, k, v)]
    out, lse = enp.attention(*args, return_lse=True, backend="cuda", **options)
    grads = enp.attention_backward(dout[None, None], *args, out, lse, backend="cuda", **options)
    errors = relative_errors(grads, want)
    assert max(errors.values()) < 1e-12, errors
