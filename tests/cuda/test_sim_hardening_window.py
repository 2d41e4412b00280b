"""The dynamic window at its edges on the CUDA kernels: the cases of ``tests/test_hardening_window.py``.

Rows far from all their keys (``d log G / d sigma`` where ``sharpness f``
is subnormal: float64's band as in the report, float32's, which the kernels
compute their gate in) and ``dtau`` beside a large ``log G``.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np._contract._problem import prepare
from elastic_np.reference._attention import window_gate
from mp_oracle import mp_attention_grads
from test_hardening_window import faint_gate_inputs, far_rows, fields, out_of_rule, run


def test_dsigma_of_the_reported_rows_is_finite_and_right():
    q = np.ones((1, 1, 20, 4))
    k = v = np.ones((1, 1, 3, 4))
    options = dict(dynamic_window=enp.DynamicWindow(0.5, sharpness=2.0))
    out, lse, grads = run("cuda", np.float64, q, k, v, np.ones_like(q), options)
    want = mp_attention_grads(q[0, 0], k[0, 0], v[0, 0], q[0, 0], 0.5, 1.0, 0.0, sigma=0.5, sharpness=2.0)
    assert np.isfinite(grads.dsigma)
    assert abs(grads.dsigma - want["dsigma"]) <= 3000 * 20 * 4 * np.finfo(np.float64).eps
    assert not out_of_rule(q, k, v, np.ones_like(q), options, np.float64, fields(out, lse, grads))


def test_float32_dsigma_where_the_bell_is_subnormal():
    q, k, v, dout = (a[None, None] for a in far_rows(6, N=20, M=3))
    options = dict(scale=0.5, dynamic_window=enp.DynamicWindow(1.3, sharpness=2.0))
    G, f, _ = window_gate(prepare(*(a.astype(np.float32) for a in (q, k, v)), **options))
    y = np.float32(2.0) * f[G > 0]
    assert y.min() < 1 / np.finfo(np.float32).max  # where 1 / (4y) overflowed float32
    out, lse, grads = run("cuda", np.float32, q, k, v, dout, options)
    assert np.isfinite(grads.dsigma)
    assert not out_of_rule(q, k, v, dout, options, np.float32, fields(out, lse, grads))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_dtau_under_a_faint_gate(dtype):
    q, k, v, dout, options = faint_gate_inputs(1.0)
    assert not out_of_rule(q, k, v, dout, options, dtype, fields(*run("cuda", dtype, q, k, v, dout, options)))
    q, k, v, dout, options = faint_gate_inputs(0.0)
    np.testing.assert_array_equal(run("cuda", dtype, q, k, v, dout, options)[2].dtau, 0.0)
