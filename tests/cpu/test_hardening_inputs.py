"""Extreme option values and malformed options (issue 22, items 3, 4, 6 and 7).

Each value is either computed correctly (against the float64 oracle, or a
limit known in closed form) or rejected by a ValueError/TypeError that names
the option, the same way in the reference and the CPU kernels. The CUDA
kernels have the same tests in ``tests/cuda/test_sim_hardening_inputs.py``.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference

KERNEL_DTYPES = [np.float64, np.float32]


def inputs(B=1, H=2, N=5, M=5, D=4, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal(shape).astype(dtype)
                     for shape in ((B, H, N, D), (B, H, M, D), (B, H, M, D), (B, H, N, D)))
    return q, k, v, dout


def run(backend, q, k, v, dout, **options):
    if backend == "reference":
        out, lse = reference.attention(q, k, v, **options)
        return out, lse, reference.attention_backward(dout, q, k, v, out, lse, **options)
    out, lse = enp.attention(q, k, v, return_lse=True, backend=backend, **options)
    return out, lse, enp.attention_backward(dout, q, k, v, out, lse, backend=backend, **options)


def backends():
    return [("reference", np.float64)] + [("cpu", dtype) for dtype in KERNEL_DTYPES]


# ---------------------------------------------------------------------------
# Item 3: a tiny sigma
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [1e-30, 1e-120, 1e-170, 1e-300])
@pytest.mark.parametrize("backend,dtype", backends())
def test_tiny_sigma_keeps_only_the_aligned_key(backend, dtype, sigma):
    """Narrower than one key: only offset 0 is open, with G = 1, and dsigma = 0 (not NaN, not an error)."""
    if dtype == np.float32 and sigma < np.finfo(np.float32).tiny:
        pytest.skip("below the float32 range: rejected (test_sigma_below_the_dtype_range_is_rejected)")
    q, k, v, dout = inputs(dtype=dtype)
    window = enp.DynamicWindow(sigma, sharpness=2.0)
    out, lse, grads = run(backend, q, k, v, dout, dynamic_window=window)
    diagonal = np.eye(5, dtype=bool)
    want_out, want_lse = reference.attention(q, k, v, mask=diagonal)
    want = reference.attention_backward(dout, q, k, v, want_out, want_lse, mask=diagonal)
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(out, want_out, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(lse, want_lse, rtol=rtol, atol=rtol)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(getattr(grads, name), getattr(want, name), rtol=rtol, atol=rtol)
    assert grads.dsigma == 0.0


def test_sigma_below_the_dtype_range_is_rejected():
    with pytest.raises(ValueError, match="`sigma`"):
        enp.DynamicWindow(5e-324)
    with pytest.raises(ValueError, match="`sigma`"):
        enp.DynamicWindow(np.array([1.0, 1e-310]))
    q, k, v, dout = inputs(dtype=np.float32)
    window = enp.DynamicWindow(1e-39)  # normal in float64, below float32's normal range
    with pytest.raises(ValueError, match="`sigma`.*float32"):
        enp.attention(q, k, v, dynamic_window=window, backend="cpu")
    enp.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                  dynamic_window=window, backend="cpu")


# ---------------------------------------------------------------------------
# Item 4: options beyond the range of the kernel dtype
# ---------------------------------------------------------------------------

FLOAT32_OVERFLOWS = [
    ("tau", dict(tau=1e-39)),
    ("scale", dict(scale=1e300)),
    ("alibi_slopes", dict(alibi_slopes=np.array([1e300, 0.5]))),
    ("softcap", dict(softcap=1e-40)),
    ("softcap", dict(softcap=1e39)),
    ("tau", dict(tau=np.array([1.0, 1e39]))),
    ("beta", dict(beta=1e39)),
    ("scale", dict(scale=1e-30, tau=1e10)),  # scale / tau underflows
    ("alibi_slopes", dict(alibi_slopes=np.array([1e30, 0.5]), tau=1e-10, scale=1e-10)),  # slope / tau
    ("softcap", dict(softcap=1e30, tau=1e-10, scale=1e-10)),  # softcap / tau overflows
]


@pytest.mark.parametrize("name,options", FLOAT32_OVERFLOWS)
def test_float32_kernels_reject_options_beyond_float32(name, options):
    q, k, v, dout = inputs(dtype=np.float32)
    with pytest.raises(ValueError, match=f"`{name}`.*float32"):
        enp.attention(q, k, v, backend="cpu", **options)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu")
    with pytest.raises(ValueError, match=f"`{name}`.*float32"):
        enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **options)


@pytest.mark.parametrize("name,options", FLOAT32_OVERFLOWS)
def test_the_float32_overflows_are_computed_in_float64(name, options):
    """The same values are fine in float64 (the reference and the float64 kernels agree)."""
    q, k, v, dout = inputs()
    out, lse, grads = run("reference", q, k, v, dout, **options)
    got_out, got_lse, got = run("cpu", q, k, v, dout, **options)
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    np.testing.assert_allclose(got_out, out, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(got_lse, lse, rtol=1e-12)
    # (dq itself is rounding noise times 1 / tau for tau = 1e-39: compared only for finiteness)
    assert np.isfinite(got.dq).all() and np.isfinite(grads.dq).all()


FLOAT64_OVERFLOWS = [
    ("tau", dict(tau=5e-324)),  # issue 22 item 7: the forward returned NaN
    ("tau", dict(tau=1e-310)),
    ("softcap", dict(softcap=1e-310)),
    ("scale", dict(scale=1e300, tau=1e-10)),
    ("alibi_slopes", dict(alibi_slopes=np.array([1e308, 0.5]), tau=0.5)),
    ("softcap", dict(softcap=1e300, tau=1e-10)),
    ("softcap", dict(softcap=1e-300, tau=1e10)),
]


@pytest.mark.parametrize("name,options", FLOAT64_OVERFLOWS)
@pytest.mark.parametrize("backend,dtype", backends())
def test_every_backend_rejects_options_beyond_float64(backend, dtype, name, options):
    q, k, v, dout = inputs(dtype=dtype)
    with pytest.raises(ValueError, match=f"`{name}`"):
        run(backend, q, k, v, dout, **options)


@pytest.mark.parametrize("backend,dtype", backends())
def test_extreme_but_representable_options_are_computed(backend, dtype):
    """Small tau with a small scale, zero scale and slopes, huge beta: fine in every dtype."""
    q, k, v, dout = inputs(dtype=dtype)
    cases = [dict(tau=1e-30, scale=1e-8), dict(scale=0.0), dict(alibi_slopes=np.zeros(2)),
             dict(beta=1e30), dict(softcap=1e-3, tau=1e-3), dict(softcap=1e6, tau=1e6)]
    for options in cases:
        out, lse, grads = run(backend, q, k, v, dout, **options)
        want_out, want_lse = reference.attention(q, k, v, **options)
        rtol = 1e-12 if dtype == np.float64 else 2e-5
        np.testing.assert_allclose(out, want_out, rtol=rtol, atol=rtol, err_msg=str(options))
        np.testing.assert_allclose(lse, want_lse, rtol=rtol, err_msg=str(options))
        assert np.isfinite(grads.dq).all() and np.isfinite(grads.dtau).all()


# ---------------------------------------------------------------------------
# Item 6: malformed options
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", [(2**63, 0), (0, 2**63), (-(2**63) - 1, 0), (2**70, 2**70)])
@pytest.mark.parametrize("backend,dtype", backends())
def test_window_size_beyond_int64_is_a_value_error(backend, dtype, window):
    q, k, v, dout = inputs(dtype=dtype)
    with pytest.raises(ValueError, match="`window_size`"):
        run(backend, q, k, v, dout, window_size=window)


@pytest.mark.parametrize("backend,dtype", backends())
def test_the_largest_window_size_is_unbounded(backend, dtype):
    q, k, v, dout = inputs(dtype=dtype)
    big = 2**63 - 1
    got = run(backend, q, k, v, dout, window_size=(big, 0))
    want = run(backend, q, k, v, dout, window_size=(-1, 0))
    np.testing.assert_array_equal(got[0], want[0])
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(got[2], name), getattr(want[2], name))


NOT_BOOLEANS = ["False", np.array([True, False]), np.array([True]), 1, 0, None, 1.0]


@pytest.mark.parametrize("value", NOT_BOOLEANS, ids=repr)
@pytest.mark.parametrize("name", ["causal", "nvm"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_attention_boolean_options_must_be_booleans(backend, name, value):
    q, k, v, dout = inputs()
    with pytest.raises(TypeError, match=f"`{name}` must be a bool"):
        enp.attention(q, k, v, backend=backend, **{name: value})
    out, lse = reference.attention(q, k, v)
    with pytest.raises(TypeError, match=f"`{name}` must be a bool"):
        enp.attention_backward(dout, q, k, v, out, lse, backend=backend, **{name: value})
    with pytest.raises(TypeError, match=f"`{name}` must be a bool"):
        reference.attention(q, k, v, **{name: value})


@pytest.mark.parametrize("value", NOT_BOOLEANS, ids=repr)
def test_other_boolean_options_must_be_booleans(value):
    q, k, v, dout = inputs()
    with pytest.raises(TypeError, match="`return_lse` must be a bool"):
        enp.attention(q, k, v, return_lse=value, backend="reference")
    with pytest.raises(TypeError, match="`check_finite` must be a bool"):
        reference.attention(q, k, v, check_finite=value)
    x = np.array([1.0, -2.0])
    for fn in (reference.softmax, reference.log_softmax, reference.online_softmax):
        with pytest.raises(TypeError, match="`check_finite` must be a bool"):
            fn(x, check_finite=value)
    with pytest.raises(TypeError, match="`nvm` must be a bool"):
        reference.elastic_softmax(x, nvm=value)
    with pytest.raises(TypeError, match="`nvm` must be a bool"):
        reference.elastic_softmax_vjp(x, x, nvm=value)
    with pytest.raises(TypeError, match="`check_finite` must be a bool"):
        reference.elastic_softmax_vjp(x, x, check_finite=value)


def test_numpy_booleans_are_booleans():
    q, k, v, dout = inputs()
    got = reference.attention(q, k, v, causal=np.True_, nvm=np.bool_(False))
    want = reference.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(got[0], want[0])
    got = enp.attention(q, k, v, causal=np.True_, return_lse=np.True_, backend="cpu")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)


@pytest.mark.parametrize("name,value", [
    ("align", np.array(["array", "kv_lengths"])), ("backend", np.array(["cpu", "reference"])),
    ("window_size", (True, 0)), ("window_size", (0, np.True_)),
])
def test_string_and_integer_options_are_not_truth_tested(name, value):
    """The siblings of the boolean options: NumPy's ambiguity message, or a bool taken for 1."""
    q, k, v, dout = inputs()
    options = {"backend": "reference", name: value}
    with pytest.raises(ValueError, match=f"`{name}`"):
        enp.attention(q, k, v, **options)


@pytest.mark.parametrize("keyword", ["defer_bias_check", "defer_kv_check", "dtypes", "return_lse", "causl"])
def test_reference_attention_rejects_unknown_keywords(keyword):
    q, k, v, dout = inputs()
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        reference.attention(q, k, v, **{keyword: True})
    out, lse = reference.attention(q, k, v)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        reference.attention_backward(dout, q, k, v, out, lse, **{keyword: True})


def test_the_bias_check_cannot_be_turned_off():
    q, k, v, dout = inputs()
    bias = np.zeros((5, 5))
    bias[1, 2] = np.nan
    with pytest.raises(TypeError, match="defer_bias_check"):
        reference.attention(q, k, v, bias=bias, defer_bias_check=True)
    with pytest.raises(ValueError, match="`bias`"):
        reference.attention(q, k, v, bias=bias)


# ---------------------------------------------------------------------------
# Item 7: the reference's intermediate under- and overflows
# ---------------------------------------------------------------------------


def test_elastic_softmax_vjp_tiny_tau():
    x, dy = np.array([1.0, 2.0, 0.5]), np.array([0.3, -1.0, 2.0])
    dx, dtau, dbeta = reference.elastic_softmax_vjp(x, dy, tau=1e-200)
    assert dtau == 0.0 and dbeta == 0.0
    np.testing.assert_array_equal(dx, 0.0)


def test_elastic_softmax_vjp_dtau_divides_step_by_step():
    """sum(dz x) / tau^2 with tau^2 below the float64 range but the quotient within it."""
    x, dy = np.array([1e-160, 3e-160]), np.array([1.0, -1.0])
    tau = 1e-160
    dx, dtau, dbeta = reference.elastic_softmax_vjp(x, dy, tau=tau, nvm=False)
    # at x / tau = (1, 3): y = softmax(1, 3), dz = y (dy - delta), dtau = -sum(dz * x) / tau^2
    y = np.exp([1.0, 3.0]) / np.exp([1.0, 3.0]).sum()
    dz = y * (dy - (dy * y).sum())
    want = -(dz * np.array([1.0, 3.0])).sum() / tau
    np.testing.assert_allclose(dtau, want, rtol=1e-13)


@pytest.mark.parametrize("tau", [5e-324, 1e-310, 1e-300])
def test_elastic_softmax_tiny_tau_is_the_argmax(tau):
    x = np.array([1.0, 3.0, -2.0, 2.0])
    for use_nvm in (True, False):
        y = reference.elastic_softmax(x, tau=tau, nvm=use_nvm)
        np.testing.assert_array_equal(y, [0.0, 1.0, 0.0, 0.0])
        dx, dtau, dbeta = reference.elastic_softmax_vjp(x, np.ones(4), tau=tau, beta=0.5, nvm=use_nvm)
        assert np.isfinite(dx).all() and np.isfinite(dtau) and dbeta == 0.0


def test_elastic_softmax_huge_logits():
    """x / tau never overflows before the shift: logits near the float64 maximum."""
    x = np.array([1e308, 1.5e308, -1e308])
    y = reference.elastic_softmax(x, tau=0.5, nvm=False)
    np.testing.assert_array_equal(y, [0.0, 1.0, 0.0])


def test_alibi_slope_near_the_float64_maximum():
    """slope |off| overflows to -inf: weight 0 and no term in dtau, in the reference and the kernels."""
    q, k, v, dout = inputs(dtype=np.float64)
    slopes = np.array([1e308, 0.25])
    out, lse, grads = run("reference", q, k, v, dout, alibi_slopes=slopes)
    assert np.isfinite(grads.dtau) and np.isfinite(grads.dq).all()
    # head 0 keeps only offset 0 (|off| >= 1 scores at most -1e308): the diagonal
    diagonal = np.eye(5, dtype=bool)
    want = reference.attention(q[:, :1], k[:, :1], v[:, :1], mask=diagonal)
    want_g = reference.attention_backward(dout[:, :1], q[:, :1], k[:, :1], v[:, :1], *want, mask=diagonal)
    np.testing.assert_allclose(out[:, :1], want[0], rtol=1e-13)
    np.testing.assert_allclose(grads.dq[:, :1], want_g.dq, rtol=1e-12, atol=1e-14)
    got = run("cpu", q, k, v, dout, alibi_slopes=slopes)
    np.testing.assert_allclose(got[2].dtau, grads.dtau, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(got[0], out, rtol=1e-12)


@pytest.mark.parametrize("backend,dtype", backends())
def test_dtau_with_tau_squared_below_the_float64_range(backend, dtype):
    """tau = 1e-160: tau**2 underflows to a subnormal, dtau = -(sum dz s) / tau^2 must not."""
    q, k, v, dout = inputs(dtype=dtype)
    options = dict(tau=1e-160, scale=1e-160) if dtype == np.float64 else dict(tau=1e-30, scale=1e-30)
    tau = options["tau"]
    grads = run(backend, q, k, v, dout, **options)[2]
    # the same logits with tau = 1: dtau scales as 1 / tau (s = scale q.k scales with tau)
    want = run("reference", q, k, v, dout, scale=1.0)[2]
    rtol = 1e-11 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(grads.dtau * tau, want.dtau, rtol=rtol)


@pytest.mark.parametrize("backend,dtype", backends())
def test_tau_below_the_normal_range_is_rejected(backend, dtype):
    q, k, v, dout = inputs(dtype=dtype)
    with pytest.raises(ValueError, match="`tau`"):
        run(backend, q, k, v, dout, tau=5e-324, scale=1e-300)


def test_reference_rejects_logits_beyond_float64():
    """Valid options, but q . k scale / tau overflows: no NaN, a ValueError naming the cause."""
    q, k, v, dout = inputs()
    q = q * 1e200
    with pytest.raises(ValueError, match="overflow"):
        reference.attention(q, k, v, scale=1e120)
