"""The second-order VJP of the float64 oracle, `reference.attention_double_backward`.

Its gradients are held to central differences of ``sum(u * attention_backward(...))``
in every input of the backward (``q, k, v, dout, dlse`` and the learnable
options), with ``out`` and ``lse`` recomputed by the forward at each point.
"""

import warnings

import mpmath
import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference as ref
from elastic_np._api import dispatch
from elastic_np._contract._problem import prepare
from elastic_np.reference import _double_backward
from elastic_np.testing import gradcheck
from reference_cases import BIAS_FULL, CASES, SHAPE, SLOPES, make_qkv

#: The backward's outputs, in order; their cotangents are ``dd`` + the name without its ``d``.
GRADS = ("dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias")

#: The oracle's option cases (B=2, H=4, Hkv=2, N=5, M=7), and rows emptied by kv_lengths.
FD_CASES = {
    **{name: CASES[name] for name in (
        "plain", "causal", "window", "kv_lengths", "mask", "nvm", "tau_beta_scalar", "tau_beta_per_head",
        "dynamic_window", "dynamic_window_threshold", "combined", "softcap", "alibi", "alibi_per_batch",
        "bias", "bias_rows_keys", "bias_neg_inf", "modifiers_combined", "modifiers_gate")},
    "empty_rows_sink": {"kv_lengths": np.array([0, 7]), "causal": True, "beta": np.array([0.2, 0.5, 1.0, 0.7])},
    "empty_rows_lse_inf": {"kv_lengths": np.array([0, 6]), "tau": 0.7},
}


def _setup(options, shape=SHAPE, seed=0):
    """Inputs of the backward, a random cotangent ``u`` of its outputs, and the backward as a function.

    Returns ``(q, k, v, dout, dlse, u, inputs, fn)``: ``fn(**inputs)`` is the
    backward's outputs raveled and concatenated, at the point ``inputs``
    (``out`` and ``lse`` recomputed there); ``u`` maps each output to its
    cotangent (None for an output that is None).
    """
    margin = 1e-4 if options.get("nvm") else None
    q, k, v = make_qkv(seed, **shape, nvm_margin=margin, options=options)
    window = options.get("dynamic_window")
    fixed = {key: val for key, val in options.items() if key not in ("tau", "beta", "dynamic_window", "bias")}
    removed = np.isneginf(options["bias"]) if "bias" in options else False
    out, lse = ref.attention(q, k, v, **options)
    rng = np.random.default_rng(seed + 200)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    g = ref.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **options)
    u = {name: None if getattr(g, name) is None else rng.standard_normal(np.shape(getattr(g, name)))
         for name in GRADS}
    inputs = {"q": q, "k": k, "v": v, "dout": dout, "dlse": dlse,
              "tau": options.get("tau", 1.0), "beta": options.get("beta", 0.0)}
    if window is not None:
        inputs["sigma"] = np.array(window.sigma)
    if "bias" in options:
        inputs["bias"] = np.where(removed, 0.0, options["bias"])  # -inf entries stay -inf in fn

    def fn(q, k, v, dout, dlse, tau, beta, sigma=None, bias=None):
        dyn = None if sigma is None else enp.DynamicWindow(sigma, window.sharpness, window.threshold)
        opts = dict(fixed, tau=tau, beta=beta, dynamic_window=dyn,
                    bias=None if bias is None else np.where(removed, -np.inf, bias))
        out, lse = ref.attention(q, k, v, **opts)
        grads = ref.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **opts)
        return np.concatenate([np.ravel(getattr(grads, name)) for name in GRADS if u[name] is not None])

    return q, k, v, dout, dlse, u, inputs, fn


def double_backward(u, dout, q, k, v, dlse=None, **options):
    """`ref.attention_double_backward` with the cotangents ``u`` (a map like `_setup`'s), the forward run first."""
    out, lse = ref.attention(q, k, v, **options)
    return ref.attention_double_backward(
        u["dq"], u["dk"], u["dv"], dout, q, k, v, out, lse, ddtau=u["dtau"], ddbeta=u["dbeta"],
        ddsigma=u["dsigma"], ddbias=u["dbias"], dlse=dlse, **options)


def check_second_order(options, shape=SHAPE, seed=0, with_dlse=True, rtol=1e-6):
    """The double backward against central differences of ``<u, attention_backward>``, every input.

    ``with_dlse=False`` gives the double backward ``dlse=None`` (the point
    differentiated is then ``dlse = 0``). ``beta`` is perturbed only where
    every value is > 0 (0 is the edge of its domain). Returns the report.
    """
    q, k, v, dout, dlse, u, inputs, fn = _setup(options, shape, seed)
    if not with_dlse:
        dlse = inputs["dlse"] = np.zeros_like(dlse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow or invalid operation on the way
        r = double_backward(u, dout, q, k, v, dlse=dlse if with_dlse else None, **options)
    claimed = {"q": r.dq, "k": r.dk, "v": r.dv, "dout": r.ddout, "dlse": r.ddlse, "tau": r.dtau}
    if np.all(np.asarray(inputs["beta"]) > 0):
        claimed["beta"] = r.dbeta
    for name, grad in (("sigma", r.dsigma), ("bias", r.dbias)):
        assert (grad is None) == (name not in inputs), name
        if grad is not None:
            claimed[name] = grad
    cotangent = np.concatenate([np.ravel(a) for a in u.values() if a is not None])
    report = gradcheck(fn, inputs, claimed, dout=cotangent, rtol=rtol, raise_on_failure=False)
    assert report, f"\n{report}"
    return report


class TestFiniteDifferences:
    @pytest.mark.parametrize("case", sorted(FD_CASES))
    def test_every_input(self, case):
        check_second_order(FD_CASES[case])

    @pytest.mark.parametrize("case", ["plain", "combined", "modifiers_combined"])
    def test_without_dlse(self, case):
        check_second_order(FD_CASES[case], with_dlse=False)

    @pytest.mark.parametrize("N, M", [(7, 4), (3, 8), (1, 1)])
    def test_lengths_and_causal_alignment(self, N, M):
        shape = dict(SHAPE, N=N, M=M)
        check_second_order({"causal": True, "beta": 0.5, "tau": 0.7}, shape=shape)
        check_second_order({"window_size": (1, 0), "softcap": 1.3, "dynamic_window": enp.DynamicWindow(0.8)},
                           shape=shape)

    def test_heads(self):
        check_second_order({"softcap": 1.0, "alibi_slopes": SLOPES[:3], "bias": BIAS_FULL[:, :3],
                            "nvm": True, "beta": 0.4}, shape=dict(SHAPE, H=3, Hkv=1))
        check_second_order({"tau": np.array([0.8, 1.3]), "causal": True}, shape=dict(SHAPE, H=2, Hkv=2))

    @pytest.mark.parametrize("shape", [(), (7,), (4, 1, 1), (2, 1, 5, 1)])
    def test_bias_in_its_shape(self, shape):
        bias = np.random.default_rng(12).standard_normal(shape)
        check_second_order({"bias": bias, "causal": True, "beta": 0.3})

    @pytest.mark.parametrize("sigma_shape", [(), (4,), (2, 1)])
    def test_sigma_in_its_shape(self, sigma_shape):
        window = enp.DynamicWindow(np.full(sigma_shape, 0.7), sharpness=2.5)
        check_second_order({"dynamic_window": window, "tau": 0.9})


class TestGateSecondDerivative:
    @pytest.mark.parametrize("sigma, sharpness", [(0.7, 1.0), (0.3, 40.0), (2.0, 1e-200), (0.05, 3.0)])
    def test_agrees_with_extended_precision(self, sigma, sharpness):
        # sharpness 40: the gate saturates (tanh rounds to 1); 1e-200 and sigma 0.05: y -> 0
        q = np.zeros((1, 1, 4, 1))
        p = prepare(q, q, q, dynamic_window=enp.DynamicWindow(sigma, sharpness=sharpness))
        G, f, x = ref.window_gate(p)
        got = _double_backward.d2log_gate(p, G, f, x)[0, 0]
        mpmath.mp.dps = 40
        for (i, j), xij in np.ndenumerate(x[0, 0]):
            if G[0, 0, i, j] == 0:  # the bell underflows: the entry is removed
                continue
            bell = lambda s: mpmath.exp(-xij**2 / (2 * s**2)) / (s * mpmath.sqrt(2 * mpmath.pi))
            want = mpmath.diff(lambda s: mpmath.log(mpmath.tanh(sharpness * bell(s))), mpmath.mpf(sigma), 2)
            assert abs(got[i, j] - float(want)) <= 1e-12 * abs(float(want)), (i, j)


def _direction(seed, options, shape=SHAPE):
    """A random cotangent of the backward's outputs (a direction of its inputs ``x``) for ``options``."""
    return _setup(options, shape, seed)[5]


class TestSymmetry:
    @pytest.mark.parametrize("case", ["combined", "modifiers_combined", "modifiers_gate"])
    def test_hessian_is_symmetric(self, case):
        # <w, H u> = <u, H w> for two directions of (q, k, v, tau, beta, sigma, bias)
        options = FD_CASES[case]
        q, k, v, dout, dlse, u = _setup(options)[:6]
        w = _direction(1, options)
        hu = double_backward(u, dout, q, k, v, dlse=dlse, **options)
        hw = double_backward(w, dout, q, k, v, dlse=dlse, **options)
        w_hu = sum(np.sum(getattr(hu, name) * w[name]) for name in GRADS if w[name] is not None)
        u_hw = sum(np.sum(getattr(hw, name) * u[name]) for name in GRADS if u[name] is not None)
        assert abs(w_hu - u_hw) <= 1e-12 * max(abs(w_hu), 1.0)
        assert abs(w_hu) > 1e-3  # the check sees the terms


class TestResult:
    @pytest.mark.parametrize("tau_shape, beta_shape, sigma_shape",
                             [((), (), ()), ((4,), (4,), (2, 4)), ((), (4,), (4,)), ((4,), (), (2, 1))])
    def test_parameters_come_back_in_their_shapes(self, tau_shape, beta_shape, sigma_shape):
        q, k, v = make_qkv(6)
        opts = {"tau": np.full(tau_shape, 0.9) if tau_shape else 0.9,
                "beta": np.full(beta_shape, 0.5) if beta_shape else 0.5,
                "dynamic_window": enp.DynamicWindow(np.full(sigma_shape, 0.7) if sigma_shape else 0.7),
                "bias": np.ones((5, 7))}
        dout = np.ones((2, 4, 5, 2))
        u = dict(zip(GRADS, (np.ones_like(q), np.ones_like(k), np.ones_like(v), np.ones(tau_shape),
                             np.ones(beta_shape), np.ones(sigma_shape), np.ones((5, 7)))))
        r = double_backward(u, dout, q, k, v, **opts)
        assert isinstance(r, ref.DoubleBackwardGrads)
        assert r.ddout.shape == dout.shape and r.ddlse.shape == (2, 4, 5)
        for grad, shape in ((r.dq, q.shape), (r.dk, k.shape), (r.dv, v.shape), (r.dtau, tau_shape),
                            (r.dbeta, beta_shape), (r.dsigma, sigma_shape), (r.dbias, (5, 7))):
            assert np.shape(grad) == shape
            if shape == ():
                assert isinstance(grad, float)
            else:
                assert grad.dtype == np.float64
        plain = ref.attention_double_backward(None, None, None, dout, q, k, v, *ref.attention(q, k, v))
        assert plain.dsigma is None and plain.dbias is None

    def test_none_is_zeros(self):
        q, k, v = make_qkv(7)
        options = FD_CASES["modifiers_gate"]
        out, lse = ref.attention(q, k, v, **options)
        dout = np.random.default_rng(3).standard_normal(out.shape)
        ddq = np.random.default_rng(4).standard_normal(q.shape)
        none = ref.attention_double_backward(ddq, None, None, dout, q, k, v, out, lse, **options)
        zeros = ref.attention_double_backward(
            ddq, np.zeros_like(k), np.zeros_like(v), dout, q, k, v, out, lse, ddtau=0.0, ddbeta=0.0,
            ddsigma=0.0, ddbias=np.zeros(options["bias"].shape), dlse=np.zeros_like(lse), **options)
        for a, b in zip(none, zeros):
            np.testing.assert_array_equal(a, b)

    def test_layout_float32_and_inputs_left_alone(self):
        q, k, v = (a.astype(np.float32) for a in make_qkv(8))
        options = {"causal": True, "beta": 0.4, "softcap": 1.5}
        u = _direction(2, options)
        dout = np.random.default_rng(5).standard_normal((2, 4, 5, 2)).astype(np.float32)
        arrays = [q, k, v, dout, *(a for a in u.values() if a is not None)]
        copies = [a.copy() for a in arrays]
        for a in arrays:
            a.setflags(write=False)
        r = double_backward(u, dout, q, k, v, **options)
        assert all(np.asarray(x).dtype == np.float64 for x in r if x is not None)
        for a, c in zip(arrays, copies):
            np.testing.assert_array_equal(a, c)
        t = lambda a: None if a is None else np.swapaxes(a, 1, 2)
        given = {name: t(a) if name in ("dq", "dk", "dv") else a for name, a in u.items()}
        r_bnhd = double_backward(given, t(dout), t(q), t(k), t(v), layout="bnhd", **options)
        for name, a, b in zip(r._fields, r, r_bnhd):
            np.testing.assert_array_equal(t(b) if name in ("ddout", "dq", "dk", "dv") else b, a, err_msg=name)

    def test_padding_is_never_read(self):
        q, k, v = make_qkv(9)
        options = {"kv_lengths": np.array([4, 7]), "beta": 0.5}
        u = _direction(3, options)
        dout = np.ones((2, 4, 5, 2))
        clean = double_backward(u, dout, q, k, v, **options)
        k, v = k.copy(), v.copy()
        k[0, :, 4:], v[0, :, 4:] = np.nan, np.inf
        u["dk"][0, :, 4:] = 1e300
        dirty = double_backward(u, dout, q, k, v, **options)
        for a, b in zip(clean, dirty):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(dirty.dk[0, :, 4:], 0.0)

    @pytest.mark.parametrize("B, N, M", [(1, 3, 0), (1, 0, 3), (0, 2, 3)])
    def test_empty_dimensions(self, B, N, M):
        q, k, v = np.ones((B, 2, N, 4)), np.ones((B, 1, M, 4)), np.ones((B, 1, M, 3))
        out, lse = ref.attention(q, k, v, beta=0.5)
        r = ref.attention_double_backward(q, k, v, np.ones_like(out), q, k, v, out, lse, ddbeta=1.0, beta=0.5)
        assert r.dq.shape == q.shape and r.dk.shape == k.shape and r.ddout.shape == out.shape
        assert all(np.isfinite(x).all() for x in r if x is not None)


class TestValidation:
    def setup_method(self):
        self.q, self.k, self.v = make_qkv(0)
        self.out, self.lse = ref.attention(self.q, self.k, self.v)

    def call(self, ddq=None, ddk=None, ddv=None, **kwargs):
        return ref.attention_double_backward(ddq, ddk, ddv, self.out, self.q, self.k, self.v, self.out,
                                             self.lse, **kwargs)

    @pytest.mark.parametrize("kwargs, error, name", [
        ({"ddq": np.ones((2, 4, 5, 2))}, ValueError, "ddq"),
        ({"ddk": np.ones((2, 4, 7, 3))}, ValueError, "ddk"),
        ({"ddv": np.ones((2, 2, 7, 2), dtype=int)}, TypeError, "ddv"),
        ({"ddk": np.full((2, 2, 7, 3), np.nan)}, ValueError, "ddk"),
        ({"ddtau": np.ones(4)}, ValueError, "ddtau"),
        ({"ddbeta": np.ones(3), "beta": np.full(4, 0.5)}, ValueError, "ddbeta"),
        ({"ddbeta": np.inf}, ValueError, "ddbeta"),
        ({"ddsigma": 1.0}, ValueError, "ddsigma"),
        ({"ddsigma": np.ones(4), "dynamic_window": enp.DynamicWindow(np.ones((2, 4)))}, ValueError, "ddsigma"),
        ({"ddbias": np.ones((5, 7))}, ValueError, "ddbias"),
        ({"ddbias": np.ones((2, 4, 5, 7)), "bias": np.ones((5, 7))}, ValueError, "ddbias"),
        ({"dlse": np.ones((2, 4))}, ValueError, "dlse"),
    ])
    def test_bad_cotangents_name_the_argument(self, kwargs, error, name):
        with pytest.raises(error, match=f"`{name}`"):
            self.call(**kwargs)

    def test_check_finite_false_checks_no_cotangent(self):
        r = self.call(ddk=np.full((2, 2, 7, 3), np.nan), check_finite=False)
        assert np.isnan(r.dq).all()

    def test_unknown_option(self):
        with pytest.raises(TypeError, match=r"attention_double_backward\(\) got an unexpected keyword"):
            self.call(is_causal=True)


def test_the_dispatcher_gives_the_references_bits_and_names_a_backend_without_one(monkeypatch):
    rng = np.random.default_rng(5)
    q, k, v, ddq, dout = (rng.standard_normal((1, 2, 4, 3)) for _ in range(5))
    out, lse = enp.attention(q, k, v, return_lse=True, backend="reference", tau=0.7, beta=0.3)
    got = enp.attention_double_backward(ddq, None, None, dout, q, k, v, out, lse, ddtau=0.5,
                                        backend="reference", tau=0.7, beta=0.3)
    want = ref.attention_double_backward(ddq, None, None, dout, q, k, v, out, lse, ddtau=0.5,
                                                tau=0.7, beta=0.3)
    assert isinstance(got, enp.DoubleBackwardGrads)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # the CPU kernels have one (tests/cpu/test_cpu_double_backward.py holds them to the oracle)
    kernels = enp.attention_double_backward(ddq, None, None, dout, q, k, v, out, lse, ddtau=0.5,
                                            backend="cpu", tau=0.7, beta=0.3)
    for a, b in zip(kernels, want):
        if b is None:
            assert a is None
            continue
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * max(1.0, np.abs(b).max()))
    # a backend without one is named
    module = dispatch.get_backend("cpu")
    monkeypatch.delattr(module, "double_backward")
    with pytest.raises(enp.BackendUnavailableError, match="backend 'cpu' has no double backward"):
        enp.attention_double_backward(ddq, None, None, dout, q, k, v, out, lse, backend="cpu")
