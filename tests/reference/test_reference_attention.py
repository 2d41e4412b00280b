"""The float64 attention oracle and its hand-derived backward."""

import warnings

import mpmath
import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference as ref
from elastic_np._contract import _problem
from elastic_np.reference import _backward
from elastic_np.testing import gradcheck
from reference_cases import BIAS_FULL, CASES, SHAPE, SLOPES, make_qkv


def check_gradients(options, seed=0, shape=SHAPE, rtol=1e-6, with_lse=False):
    """Hand-derived gradients of every input against central differences.

    ``with_lse``: the loss also takes ``sum(dlse * lse)`` with a random
    ``dlse``, given to the backward. A row with ``lse = -inf`` enters that
    term as 0, constant (the contract's rule for such a row).
    """
    margin = 1e-4 if options.get("nvm") else None
    q, k, v = make_qkv(seed, **shape, nvm_margin=margin, options=options)
    window = options.get("dynamic_window")
    learnable = ("tau", "beta", "dynamic_window", "bias")
    fixed = {key: val for key, val in options.items() if key not in learnable}
    tau, beta = options.get("tau", 1.0), options.get("beta", 0.0)
    inputs = {"q": q, "k": k, "v": v, "tau": tau}
    # central differences need beta > 0 (beta = 0 is the edge of the domain)
    check_beta = np.all(np.asarray(beta) > 0)
    inputs["beta"] = beta

    # -inf bias entries stay -inf (they remove the entry; the claimed gradient there is 0)
    removed = np.isneginf(options["bias"]) if "bias" in options else False

    def fn(q, k, v, tau, beta, sigma=None, bias=None):
        dyn = None if sigma is None else enp.DynamicWindow(sigma, window.sharpness, window.threshold)
        if bias is not None:
            bias = np.where(removed, -np.inf, bias)
        out, lse = ref.attention(q, k, v, tau=tau, beta=beta, dynamic_window=dyn, bias=bias, **fixed)
        if not with_lse:
            return out
        return np.concatenate([out.ravel(), np.where(np.isneginf(lse), 0.0, lse).ravel()])

    if window is not None:
        inputs["sigma"] = np.array(window.sigma)
    if "bias" in options:
        inputs["bias"] = np.where(removed, 0.0, options["bias"])
    out, lse = ref.attention(q, k, v, **options)
    rng = np.random.default_rng(seed + 100)
    dout = rng.standard_normal(out.shape)
    dlse = rng.standard_normal(lse.shape) if with_lse else None
    grads = ref.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **options)
    claimed = {"q": grads.dq, "k": grads.dk, "v": grads.dv, "tau": grads.dtau}
    if check_beta:
        claimed["beta"] = grads.dbeta
    if window is not None:
        claimed["sigma"] = grads.dsigma
    if "bias" in options:
        claimed["bias"] = grads.dbias
        assert grads.dbias.shape == np.shape(options["bias"])
    else:
        assert grads.dbias is None
    cotangent = np.concatenate([dout.ravel(), dlse.ravel()]) if with_lse else dout
    report = gradcheck(fn, inputs, claimed, dout=cotangent, rtol=rtol)
    assert report
    return grads


class TestAttentionBackward:
    @pytest.mark.parametrize("case", sorted(CASES))
    def test_gradients_match_finite_differences(self, case):
        check_gradients(CASES[case])

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_lse_gradients_match_finite_differences(self, case):
        check_gradients(CASES[case], with_lse=True)

    @pytest.mark.parametrize("with_lse", [False, True])
    @pytest.mark.parametrize("N, M", [(1, 6), (6, 1), (7, 4), (1, 1)])
    def test_lengths_and_causal_alignment(self, N, M, with_lse):
        shape = dict(SHAPE, N=N, M=M)
        check_gradients({"causal": True, "beta": 0.5, "tau": 0.7}, shape=shape, with_lse=with_lse)
        check_gradients({"window_size": (1, 0), "dynamic_window": enp.DynamicWindow(0.8)}, shape=shape,
                        with_lse=with_lse)

    @pytest.mark.parametrize("with_lse", [False, True])
    def test_multi_query_heads(self, with_lse):
        check_gradients({"nvm": True, "beta": 0.4}, shape=dict(SHAPE, H=3, Hkv=1), with_lse=with_lse)
        check_gradients({"softcap": 1.0, "alibi_slopes": SLOPES[:3], "bias": BIAS_FULL[:, :3],
                         "nvm": True, "beta": 0.4}, shape=dict(SHAPE, H=3, Hkv=1), with_lse=with_lse)

    @pytest.mark.parametrize("shape", [(), (7,), (1, 7), (4, 1, 1), (2, 1, 5, 1), (1, 4, 5, 7)])
    def test_bias_gradient_in_the_bias_shape(self, shape):
        bias = np.random.default_rng(12).standard_normal(shape)
        check_gradients({"bias": bias, "causal": True})

    @pytest.mark.parametrize("N, M", [(1, 6), (6, 1), (1, 1)])
    def test_modifiers_at_length_one(self, N, M):
        shape = dict(SHAPE, N=N, M=M)
        bias = np.random.default_rng(13).standard_normal((N, M))
        check_gradients({"softcap": 1.2, "alibi_slopes": SLOPES, "bias": bias, "causal": True,
                         "beta": 0.5}, shape=shape)

    def test_beta_gradient_at_zero_one_sided(self):
        q, k, v = make_qkv(3)
        out, lse = ref.attention(q, k, v, causal=True)
        dout = np.ones_like(out)
        g = ref.attention_backward(dout, q, k, v, out, lse, causal=True)
        h = 1e-7
        loss = lambda beta: np.sum(dout * ref.attention(q, k, v, causal=True, beta=beta)[0])
        np.testing.assert_allclose(g.dbeta, (loss(h) - loss(0.0)) / h, rtol=1e-5)

    @pytest.mark.parametrize("beta", [0.0, 0.7])
    def test_empty_rows(self, beta):
        q, k, v = make_qkv(4)
        options = {"kv_lengths": np.array([0, 7]), "causal": True, "beta": beta}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, lse = ref.attention(q, k, v, **options)
            g = ref.attention_backward(np.ones_like(out), q, k, v, out, lse, **options)
        np.testing.assert_array_equal(out[0], 0.0)
        np.testing.assert_array_equal(lse[0], np.log(beta) if beta else -np.inf)
        for grad in (g.dq, g.dk, g.dv, g.dtau, g.dbeta):
            assert np.isfinite(grad).all()
        np.testing.assert_array_equal(g.dq[0], 0.0)
        if beta:
            check_gradients(options)

    @pytest.mark.parametrize("beta", [0.0, 0.7, [0.0, 0.7, 0.0, 1.5]])
    def test_lse_gradient_of_empty_rows(self, beta):
        # Batch 0 keeps nothing. With beta > 0 its lse = log(beta) takes dlse / beta into
        # dbeta; with beta = 0 its lse = -inf takes no gradient at all, whatever dlse.
        q, k, v = make_qkv(4)
        options = {"kv_lengths": np.array([0, 7]), "causal": True, "beta": np.asarray(beta)}
        out, lse = ref.attention(q, k, v, **options)
        rng = np.random.default_rng(1)
        dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            g = ref.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **options)
        for grad in (g.dq, g.dk, g.dv, g.dtau, g.dbeta):
            assert np.isfinite(grad).all()
        for grad in (g.dq, g.dk, g.dv):
            np.testing.assert_array_equal(grad[0], 0.0)
        delta = np.sum(dout * out, axis=-1) - dlse
        with np.errstate(over="ignore", invalid="ignore"):
            want = -np.where(np.isneginf(lse), 0.0, delta * np.exp(-lse)).sum(axis=(0, 2))
        np.testing.assert_allclose(g.dbeta, want if np.ndim(beta) else want.sum(), rtol=1e-13)
        empty_heads = np.broadcast_to(np.asarray(beta) == 0, (4,))
        assert np.isneginf(lse[0, empty_heads]).all()
        if np.all(np.asarray(beta) > 0):
            check_gradients(options, with_lse=True)

    def test_lse_cotangent_enters_through_delta(self):
        # Every gradient with dlse is the one with delta - dlse in place of delta; dv has no delta.
        q, k, v = make_qkv(7)
        options = {"causal": True, "tau": 0.8, "beta": np.array([0.2, 0.5, 1.0, 0.0]),
                   "dynamic_window": enp.DynamicWindow(0.9, sharpness=2.0), "bias": BIAS_FULL}
        out, lse = ref.attention(q, k, v, **options)
        rng = np.random.default_rng(2)
        dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
        with_dlse = ref.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **options)
        without = ref.attention_backward(dout, q, k, v, out, lse, **options)
        np.testing.assert_array_equal(with_dlse.dv, without.dv)
        p = _problem.prepare(q, k, v, **options)
        probs, delta = _backward.score_gradient(p, dout, out, lse, dlse)[4:6]
        np.testing.assert_allclose(delta, np.sum(dout * out, axis=-1) - dlse, rtol=1e-15)
        lse_only = ref.attention_backward(np.zeros_like(dout), q, k, v, out, lse, dlse=dlse, **options)
        # d lse_i / d z_ij = p_ij: with dout = 0, dz = p dlse and dbias = dz / tau
        np.testing.assert_allclose(lse_only.dbias, probs * dlse[..., None] / 0.8, rtol=1e-13)
        np.testing.assert_array_equal(lse_only.dv, 0.0)
        np.testing.assert_allclose(lse_only.dbeta, np.sum(dlse * np.exp(-lse), axis=(0, 2)), rtol=1e-13)

    def test_no_dlse_is_zero_dlse_bit_for_bit(self):
        q, k, v = make_qkv(8)
        options = CASES["combined"]
        out, lse = ref.attention(q, k, v, **options)
        dout = np.random.default_rng(3).standard_normal(out.shape)
        none = ref.attention_backward(dout, q, k, v, out, lse, dlse=None, **options)
        zeros = ref.attention_backward(dout, q, k, v, out, lse, dlse=np.zeros_like(lse), **options)
        for field in ("dq", "dk", "dv", "dtau", "dbeta", "dsigma"):
            np.testing.assert_array_equal(getattr(none, field), getattr(zeros, field), err_msg=field)

    @pytest.mark.parametrize("B, N, M", [(1, 3, 0), (1, 0, 3), (0, 2, 3)])
    def test_empty_dimensions(self, B, N, M):
        q, k, v = np.ones((B, 2, N, 4)), np.ones((B, 1, M, 4)), np.ones((B, 1, M, 3))
        out, lse = ref.attention(q, k, v, beta=0.5)
        assert out.shape == (B, 2, N, 3) and lse.shape == (B, 2, N)
        np.testing.assert_array_equal(out, 0.0 if M == 0 else 1.0)
        g = ref.attention_backward(np.ones_like(out), q, k, v, out, lse, beta=0.5)
        assert g.dq.shape == q.shape and g.dk.shape == k.shape and g.dv.shape == v.shape
        assert np.isfinite(g.dbeta).all() and np.isfinite(g.dq).all()

    def test_rows_emptied_by_nvm_and_causal(self):
        # N > M with causal: the first N - M query rows see no key at all.
        q, k, v = make_qkv(5, N=6, M=3)
        out, lse = ref.attention(q, k, v, causal=True, beta=0.0)
        np.testing.assert_array_equal(out[:, :, :3], 0.0)
        assert np.isneginf(lse[:, :, :3]).all() and np.isfinite(lse[:, :, 3:]).all()

    @pytest.mark.parametrize("tau_shape, beta_shape, sigma_shape", [((), (), ()), ((4,), (4,), (2, 4)), ((), (4,), (4,)), ((4,), (), (2, 1))])
    def test_parameter_gradients_come_back_in_their_shapes(self, tau_shape, beta_shape, sigma_shape):
        q, k, v = make_qkv(6)
        opts = {"tau": np.full(tau_shape, 0.9) if tau_shape else 0.9,
                "beta": np.full(beta_shape, 0.5) if beta_shape else 0.5,
                "dynamic_window": enp.DynamicWindow(np.full(sigma_shape, 0.7) if sigma_shape else 0.7)}
        out, lse = ref.attention(q, k, v, **opts)
        g = ref.attention_backward(np.ones_like(out), q, k, v, out, lse, **opts)
        for grad, shape in ((g.dtau, tau_shape), (g.dbeta, beta_shape), (g.dsigma, sigma_shape)):
            assert np.shape(grad) == shape
            if shape == ():
                assert isinstance(grad, float)
        assert ref.attention_backward(np.ones_like(out), q, k, v, out, lse).dsigma is None


def modified_scores(s, options):
    """The score modifiers written out from the contract: soft-cap, then ALiBi, then bias."""
    N, M = s.shape[-2:]
    if "softcap" in options:
        s = options["softcap"] * np.tanh(s / options["softcap"])
    if "alibi_slopes" in options:
        slopes = np.broadcast_to(options["alibi_slopes"], s.shape[:2])[:, :, None, None]
        i, j = np.arange(N)[:, None], np.arange(M)[None, :]
        s = s - slopes * np.abs(i + (M - N) - j)
    if "bias" in options:
        s = s + options["bias"]
    return s


class TestAttentionForward:
    @pytest.mark.parametrize("case", sorted(CASES))
    def test_rows_are_elastic_softmax_of_masked_scores(self, case):
        options = CASES[case]
        q, k, v = make_qkv(1)
        out, lse = ref.attention(q, k, v, **options)
        problem = _problem.prepare(q, k, v, **options)
        keep = ref.structural_keep(problem)
        kk, vv = (np.repeat(a, 2, axis=1) for a in (k, v))
        s = modified_scores(problem.scale * q @ np.swapaxes(kk, -1, -2), options)
        keep = keep & np.isfinite(s)
        tau = problem.tau[:, None, None]
        if problem.sigma is None:
            # attention = elastic_softmax(scores with -inf outside the mask) @ v
            masked = np.where(keep, s, -np.inf)
            for h in range(4):
                y = ref.elastic_softmax(masked[:, h], tau=problem.tau[h], beta=problem.beta[h], nvm=problem.nvm)
                np.testing.assert_allclose(out[:, h], y @ vv[:, h], rtol=1e-13, atol=1e-15)
        else:
            G = ref.window_gate(problem)[0]
            keep = keep & (G > 0) & ((s >= 0) if problem.nvm else True)
            with np.errstate(divide="ignore"):
                z = np.where(keep, s / tau + np.log(G), -np.inf)
            for h in range(4):
                y = ref.elastic_softmax(z[:, h], beta=problem.beta[h], nvm=False)
                np.testing.assert_allclose(out[:, h], y @ vv[:, h], rtol=1e-13, atol=1e-15)

    def test_agrees_with_extended_precision(self):
        q, k, v = make_qkv(2, B=1, H=2, Hkv=1, N=3, M=5, D=4, Dv=3)
        window = enp.DynamicWindow(0.8, sharpness=2.0)
        tau, beta = np.array([0.7, 1.3]), np.array([0.2, 2.5])
        out, lse = ref.attention(q, k, v, causal=True, nvm=True, tau=tau, beta=beta, dynamic_window=window)
        mpmath.mp.dps = 40
        for h in range(2):
            for i in range(3):
                weights, values = [], []
                for j in range(5):
                    s = sum(mpmath.mpf(q[0, h, i, d]) * mpmath.mpf(k[0, 0, j, d]) for d in range(4)) / 2
                    x = mpmath.mpf(2 * (j - i - 2)) / 4
                    f = mpmath.exp(-x**2 / (2 * mpmath.mpf(0.8) ** 2)) / (mpmath.mpf(0.8) * mpmath.sqrt(2 * mpmath.pi))
                    if j <= i + 2 and s >= 0:
                        weights.append(mpmath.exp(s / mpmath.mpf(tau[h])) * mpmath.tanh(2 * f))
                        values.append([mpmath.mpf(v[0, 0, j, e]) for e in range(3)])
                denominator = mpmath.fsum(weights) + mpmath.mpf(beta[h])
                assert float(mpmath.log(denominator)) == pytest.approx(lse[0, h, i], rel=1e-13)
                for e in range(3):
                    exact = mpmath.fsum(w * val[e] for w, val in zip(weights, values)) / denominator
                    assert float(exact) == pytest.approx(out[0, h, i, e], rel=1e-13, abs=1e-300)

    def test_modifiers_agree_with_extended_precision(self):
        q, k, v = make_qkv(9, B=1, H=1, Hkv=1, N=3, M=4, D=2, Dv=2)
        bias = np.random.default_rng(5).standard_normal((3, 4))
        cap, slope = 0.9, 0.3
        out, lse = ref.attention(q, k, v, softcap=cap, alibi_slopes=np.array([slope]), bias=bias,
                                 tau=0.6, beta=0.4)
        mpmath.mp.dps = 40
        for i in range(3):
            weights = []
            for j in range(4):
                s = sum(mpmath.mpf(q[0, 0, i, d]) * mpmath.mpf(k[0, 0, j, d]) for d in range(2))
                s = cap * mpmath.tanh(s / mpmath.sqrt(2) / cap) - slope * abs(i + 1 - j) + bias[i, j]
                weights.append(mpmath.exp(s / mpmath.mpf(0.6)))
            denominator = mpmath.fsum(weights) + mpmath.mpf(0.4)
            assert float(mpmath.log(denominator)) == pytest.approx(lse[0, 0, i], rel=1e-13)
            for e in range(2):
                exact = mpmath.fsum(w * mpmath.mpf(v[0, 0, j, e]) for j, w in enumerate(weights))
                assert float(exact / denominator) == pytest.approx(out[0, 0, i, e], rel=1e-13)

    def test_nvm_acts_on_the_final_score(self):
        q, k, v = make_qkv(10, B=1, H=1, Hkv=1, N=1, M=2, D=1, Dv=1)
        q[:] = 1.0
        k[0, 0, :, 0] = [-1.0, 1.0]  # raw scores -1 and +1
        out = ref.attention(q, k, v, nvm=True, bias=np.array([2.0, -2.0]))[0]
        # the bias turns the first score to +1 (kept) and the second to -1 (removed)
        np.testing.assert_allclose(out[0, 0, 0, 0], v[0, 0, 0, 0], rtol=1e-15)

    def test_returns_float64_and_leaves_inputs_alone(self):
        q, k, v = (a.astype(np.float32) for a in make_qkv(3))
        copies = [a.copy() for a in (q, k, v)]
        for a in (q, k, v):
            a.setflags(write=False)
        mask = np.ones((5, 7), bool)
        out, lse = ref.attention(q, k, v, mask=mask, tau=np.array([1.0, 2.0, 3.0, 4.0]))
        assert out.dtype == lse.dtype == np.float64
        for a, c in zip((q, k, v), copies):
            np.testing.assert_array_equal(a, c)

    def test_non_contiguous_inputs(self):
        q, k, v = make_qkv(4, D=6)
        qs, ks = q[..., ::2], k[..., ::2]
        np.testing.assert_allclose(ref.attention(qs, ks, v)[0],
                                   ref.attention(qs.copy(), ks.copy(), v)[0], rtol=1e-14, atol=1e-15)


class TestDispatch:
    def test_reference_backend_is_the_oracle(self):
        q, k, v = make_qkv(5)
        opts = CASES["combined"]
        out, lse = enp.attention(q, k, v, return_lse=True, backend="reference", **opts)
        np.testing.assert_array_equal(out, ref.attention(q, k, v, **opts)[0])
        np.testing.assert_array_equal(enp.attention(q, k, v, backend="reference", **opts), out)
        g = enp.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="reference", **opts)
        g_ref = ref.attention_backward(np.ones_like(out), q, k, v, out, lse, **opts)
        np.testing.assert_array_equal(g.dq, g_ref.dq)
        assert g.dtau.shape == (4,) and g.dsigma.shape == (4,)

    def test_unknown_backend(self):
        with pytest.raises(ValueError, match="`backend`"):
            enp.attention(*make_qkv(0), backend="tpu")

    def test_types_are_immutable(self):
        window = enp.DynamicWindow(np.array([0.5, 1.0]))
        with pytest.raises(Exception):
            window.sharpness = 2.0
        with pytest.raises(ValueError):
            window.sigma[0] = 3.0
        q, k, v = make_qkv(0)
        out, lse = ref.attention(q, k, v)
        grads = ref.attention_backward(out, q, k, v, out, lse)
        with pytest.raises(Exception):
            grads.dq = None


class TestValidation:
    @pytest.mark.parametrize("kwargs, error, name", [
        ({"window_size": 3}, ValueError, "window_size"),
        ({"window_size": (1, 2, 3)}, ValueError, "window_size"),
        ({"window_size": (-2, 0)}, ValueError, "window_size"),
        ({"kv_lengths": np.array([8, 1])}, ValueError, "kv_lengths"),
        ({"kv_lengths": np.array([-1, 1])}, ValueError, "kv_lengths"),
        ({"kv_lengths": np.array([1])}, ValueError, "kv_lengths"),
        ({"kv_lengths": np.array([1.0, 2.0])}, TypeError, "kv_lengths"),
        ({"mask": np.ones((5, 7))}, TypeError, "mask"),
        ({"mask": np.ones((5, 6), bool)}, ValueError, "mask"),
        ({"tau": 0.0}, ValueError, "tau"),
        ({"tau": np.ones(3)}, ValueError, "tau"),
        ({"beta": -0.1}, ValueError, "beta"),
        ({"beta": np.array([0.0, 0.0, np.nan, 0.0])}, ValueError, "beta"),
        ({"scale": np.nan}, ValueError, "scale"),
        ({"dynamic_window": 0.5}, TypeError, "dynamic_window"),
        ({"dynamic_window": enp.DynamicWindow(np.ones(3))}, ValueError, "sigma"),
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"softcap": np.inf}, ValueError, "softcap"),
        ({"softcap": "tight"}, TypeError, "softcap"),
        ({"alibi_slopes": np.ones(3)}, ValueError, "alibi_slopes"),
        ({"alibi_slopes": np.ones((3, 4))}, ValueError, "alibi_slopes"),
        ({"alibi_slopes": np.array([1.0, np.nan, 1.0, 1.0])}, ValueError, "alibi_slopes"),
        ({"alibi_slopes": np.ones(4, bool)}, TypeError, "alibi_slopes"),
        ({"bias": np.ones((5, 6))}, ValueError, "bias"),
        ({"bias": np.ones((1, 2, 4, 5, 7))}, ValueError, "bias"),
        ({"bias": np.ones((5, 7), int)}, TypeError, "bias"),
        ({"bias": np.ones((5, 7), bool)}, TypeError, "bias"),
        ({"bias": np.full((5, 7), np.inf)}, ValueError, "bias"),
        ({"bias": np.full((5, 7), np.nan)}, ValueError, "bias"),
        # one bad entry among -inf ones (the check is a maximum: NaN must not hide)
        ({"bias": np.where(np.eye(5, 7) > 0, np.nan, -np.inf)}, ValueError, "bias"),
        ({"bias": np.where(np.eye(5, 7) > 0, -np.inf, np.nan)}, ValueError, "bias"),
        ({"bias": np.where(np.eye(5, 7) > 0, np.inf, -np.inf).astype(np.float32)}, ValueError, "bias"),
    ])
    def test_bad_options_name_the_parameter(self, kwargs, error, name):
        with pytest.raises(error, match=f"`{name}`"):
            ref.attention(*make_qkv(0), **kwargs)

    @pytest.mark.parametrize("kwargs, error, name", [
        ({"sigma": 0.0}, ValueError, "sigma"),
        ({"sigma": -1.0}, ValueError, "sigma"),
        ({"sigma": np.inf}, ValueError, "sigma"),
        ({"sigma": "wide"}, TypeError, "sigma"),
        ({"sigma": 1.0, "sharpness": 0.0}, ValueError, "sharpness"),
        ({"sigma": 1.0, "threshold": -0.1}, ValueError, "threshold"),
    ])
    def test_dynamic_window_validation(self, kwargs, error, name):
        with pytest.raises(error, match=f"`{name}`"):
            enp.DynamicWindow(**kwargs)

    def test_shapes(self):
        q, k, v = make_qkv(0)
        with pytest.raises(ValueError, match="multiple"):
            ref.attention(q[:, :3], k, v)
        with pytest.raises(ValueError, match="`k` head dim"):
            ref.attention(q, k[..., :2], v)
        with pytest.raises(ValueError, match="`v`"):
            ref.attention(q, k, v[:, :, :3])
        with pytest.raises(ValueError, match="batch"):
            ref.attention(q, k[:1], v[:1])
        with pytest.raises(ValueError, match="head dim D >= 1"):
            ref.attention(q[..., :0], k[..., :0], v)
        with pytest.raises(ValueError, match="`q` must have 4"):
            ref.attention(q[0], k, v)
        with pytest.raises(TypeError, match="`q`"):
            ref.attention(q.astype(int), k, v)
        with pytest.raises(ValueError, match="`k` contains NaN"):
            ref.attention(q, np.where(k > 1, np.nan, k), v)

    def test_backward_arrays(self):
        q, k, v = make_qkv(0)
        out, lse = ref.attention(q, k, v)
        with pytest.raises(ValueError, match="`dout` must have shape"):
            ref.attention_backward(out[..., :1], q, k, v, out, lse)
        with pytest.raises(ValueError, match="`lse` must have shape"):
            ref.attention_backward(out, q, k, v, out, lse[..., :2])
        with pytest.raises(ValueError, match="`out` contains NaN"):
            ref.attention_backward(out, q, k, v, out * np.nan, lse)



class TestAgainstTorch:
    @pytest.fixture(autouse=True)
    def _torch(self):
        self.torch = pytest.importorskip("torch")

    def test_bias_is_torch_float_mask(self):
        torch = self.torch
        q, k, v = make_qkv(8, B=2, H=4, Hkv=4, N=6, M=5, D=5, Dv=3)
        bias = np.random.default_rng(3).standard_normal((1, 4, 6, 5))
        out, lse = ref.attention(q, k, v, bias=bias)
        dout = np.random.default_rng(4).standard_normal(out.shape)
        g = ref.attention_backward(dout, q, k, v, out, lse, bias=bias)
        tq, tk, tv, tb = (torch.tensor(a, requires_grad=True) for a in (q, k, v, bias))
        t_out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tb)
        t_out.backward(torch.tensor(dout))
        np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-12, atol=1e-14)
        for mine, theirs in ((g.dq, tq), (g.dk, tk), (g.dv, tv), (g.dbias, tb)):
            np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-11, atol=1e-13)

    @pytest.mark.parametrize("options", [
        {}, {"causal": True}, {"scale": 0.25}, {"mask": True}, {"gqa": True},
    ], ids=["plain", "causal", "scale", "mask", "gqa"])
    def test_forward_and_backward(self, options):
        torch = self.torch
        gqa = options.pop("gqa", False) if "gqa" in options else False
        use_mask = options.pop("mask", False) if "mask" in options else False
        q, k, v = make_qkv(7, B=2, H=4, Hkv=2 if gqa else 4, N=6, M=6, D=5, Dv=3)
        mask = np.random.default_rng(1).random((2, 4, 6, 6)) < 0.7
        mask[..., 0] = True  # torch gives NaN for rows with nothing kept
        kwargs = dict(options)
        if use_mask:
            kwargs["mask"] = mask
        out, lse = ref.attention(q, k, v, **kwargs)
        dout = np.random.default_rng(2).standard_normal(out.shape)
        g = ref.attention_backward(dout, q, k, v, out, lse, **kwargs)

        tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
        t_out = torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=torch.tensor(mask) if use_mask else None,
            is_causal=options.get("causal", False), scale=options.get("scale"), enable_gqa=gqa)
        t_out.backward(torch.tensor(dout))
        np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-12, atol=1e-14)
        for mine, theirs in ((g.dq, tq), (g.dk, tk), (g.dv, tv)):
            np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-11, atol=1e-13)
