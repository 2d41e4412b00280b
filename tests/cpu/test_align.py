"""``align="kv_lengths"``: offsets measured from each sequence's own end.

The definition, checked on the oracle: with ``align="kv_lengths"``, batch
entry ``b`` gets exactly the attention over its first ``kv_lengths[b]`` keys
alone, with the default alignment (the mask and bias cut to those keys).
The kernels are then held to the oracle with the option set.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cpu, reference
from elastic_np.testing import gradcheck
from oracle_checks import assert_matches_oracle, check_case, make_inputs

DTYPES = [np.float64, np.float32]
B, H, Hkv, N, M, D = 4, 4, 2, 7, 19, 8


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(cpu._runtime.config, "BLOCK_Q", 4)
    monkeypatch.setattr(cpu._runtime.config, "BLOCK_K", 5)
    monkeypatch.setattr(cpu._runtime.config, "DECODE_BLOCK_K", 5)
    monkeypatch.setattr(cpu._runtime.config, "SERIAL_WORK", 0)
    monkeypatch.setattr(cpu._runtime.config, "DECODE_MIN_SPLIT_KEYS", 7)
    monkeypatch.setattr(cpu._runtime.config, "DECODE_MIN_TASKS", 64)


def _options(n=N, m=M, seed=0):
    """Option sets with per-batch arrays, shaped for ``(B, H, n, m)``; lengths 0, 1, < n and m."""
    rng = np.random.default_rng(seed)
    lengths = np.array([m, 0, 1, max(m - 6, 0)])
    mask = rng.random((B, 1, n, m)) > 0.3
    bias = rng.standard_normal((B, H, n, m))
    bias[rng.random(bias.shape) < 0.1] = -np.inf
    window = enp.DynamicWindow(rng.uniform(0.3, 1.0, (B, H)), sharpness=3.0, threshold=0.05)
    slopes = rng.uniform(0.0, 0.3, (B, H))
    tau, beta = rng.uniform(0.5, 1.5, H), rng.uniform(0.1, 1.0, H)
    common = dict(kv_lengths=lengths, align="kv_lengths")
    return {
        "causal": dict(common, causal=True),
        "window": dict(common, window_size=(3, 1)),
        "alibi": dict(common, alibi_slopes=slopes, causal=True),
        "dynamic-window": dict(common, dynamic_window=window),
        "mask-bias": dict(common, mask=mask, bias=bias, nvm=True, tau=tau, beta=beta, causal=True),
        "everything": dict(
            common, causal=True, window_size=(4, -1), mask=mask, nvm=True, tau=tau, beta=beta,
            dynamic_window=window, softcap=1.3, alibi_slopes=slopes, bias=bias,
        ),
    }


def _inputs(dtype=np.float64, n=N, m=M, seed=1):
    return make_inputs(dtype, B=B, H=H, Hkv=Hkv, N=n, M=m, D=D, Dv=D, seed=seed)


def _alone(opts, b, length):
    """The options of batch entry ``b`` on its own, its keys cut to ``length``, aligned to the array."""
    alone = {}
    for name, value in opts.items():
        if name in ("kv_lengths", "align"):
            continue
        if name in ("mask", "bias"):
            value = value[b : b + 1, ..., :length]
        elif name == "alibi_slopes":
            value = value[b : b + 1]
        elif name == "dynamic_window":
            value = enp.DynamicWindow(value.sigma[b : b + 1], value.sharpness, value.threshold)
        alone[name] = value
    return alone


@pytest.mark.parametrize("case", list(_options()))
def test_the_oracle_is_each_sequence_alone(case):
    opts = _options()[case]
    q, k, v, dout = _inputs()
    out, lse = reference.attention(q, k, v, **opts)
    grads = reference.attention_backward(dout, q, k, v, out, lse, **opts)
    dtau, dbeta = 0.0, 0.0
    for b, length in enumerate(opts["kv_lengths"]):
        alone = _alone(opts, b, length)
        args = (q[b : b + 1], k[b : b + 1, :, :length], v[b : b + 1, :, :length])
        out_b, lse_b = reference.attention(*args, **alone)
        g = reference.attention_backward(dout[b : b + 1], *args, out_b, lse_b, **alone)
        np.testing.assert_allclose(out[b : b + 1], out_b, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(lse[b : b + 1], lse_b, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(grads.dq[b : b + 1], g.dq, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(grads.dk[b : b + 1, :, :length], g.dk, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(grads.dv[b : b + 1, :, :length], g.dv, rtol=1e-12, atol=1e-13)
        assert not grads.dk[b, :, length:].any() and not grads.dv[b, :, length:].any()
        if "bias" in opts:
            np.testing.assert_allclose(grads.dbias[b : b + 1, ..., :length], g.dbias, atol=1e-13)
            assert not grads.dbias[b, ..., length:].any()
        if "dynamic_window" in opts:
            np.testing.assert_allclose(grads.dsigma[b : b + 1], g.dsigma, rtol=1e-12, atol=1e-13)
        dtau, dbeta = dtau + g.dtau, dbeta + g.dbeta
    np.testing.assert_allclose(grads.dtau, dtau, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(grads.dbeta, dbeta, rtol=1e-12, atol=1e-13)


def test_the_oracle_gradient_against_finite_differences():
    opts = _options()["dynamic-window"]
    opts = dict(opts, causal=True, alibi_slopes=_options()["alibi"]["alibi_slopes"], tau=0.8, beta=0.4)
    q, k, v, dout = _inputs(n=3, m=6)
    opts["kv_lengths"] = np.array([6, 2, 1, 4])
    sigma = opts.pop("dynamic_window").sigma

    def loss(q, k, v, sigma):
        window = enp.DynamicWindow(sigma, sharpness=3.0, threshold=0.05)
        return reference.attention(q, k, v, dynamic_window=window, **opts)[0]

    window = enp.DynamicWindow(sigma, sharpness=3.0, threshold=0.05)
    out, lse = reference.attention(q, k, v, dynamic_window=window, **opts)
    g = reference.attention_backward(dout, q, k, v, out, lse, dynamic_window=window, **opts)
    gradcheck(loss, {"q": q, "k": k, "v": v, "sigma": sigma},
              {"q": g.dq, "k": g.dk, "v": g.dv, "sigma": g.dsigma}, dout=dout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 7, 16, 23])
@pytest.mark.parametrize("case", list(_options()))
def test_cpu_against_the_oracle(small_tiles, dtype, n, case):
    """``n <= 16`` runs the decode kernel forward; the backward is the prefill kernel's."""
    opts = _options(n=n, m=M)[case]
    check_case(dtype, opts, B=B, H=H, Hkv=Hkv, N=n, M=M, D=D, Dv=6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 40])
def test_cpu_long_ragged_cache(dtype, n):
    """Default tiles and split-KV over a few thousand keys."""
    m = 3000
    rng = np.random.default_rng(3)
    q, k, v, _ = _inputs(dtype, n=n, m=m)
    lengths = np.array([m, 0, 1, 1700])
    window = enp.DynamicWindow(rng.uniform(0.05, 0.3, (B, H)), sharpness=3.0, threshold=0.05)
    for opts in (dict(causal=True), dict(window_size=(300, 0), alibi_slopes=np.full(H, 0.01)),
                 dict(dynamic_window=window)):
        opts = dict(opts, kv_lengths=lengths, align="kv_lengths")
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
        ref_out, ref_lse = reference.attention(q, k, v, **opts)
        if dtype == np.float64:
            assert_matches_oracle("out", out, ref_out, dtype)
            assert_matches_oracle("lse", lse, ref_lse, dtype)
        else:
            np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
            assert np.abs(out - ref_out).max() <= 1e-5
            finite = np.isfinite(ref_lse)
            assert np.abs(lse[finite] - ref_lse[finite]).max() <= 1e-5 * np.abs(ref_lse[finite]).max()


@pytest.mark.parametrize("n", [1, 23])
def test_without_kv_lengths_it_is_the_default(small_tiles, n):
    q, k, v, dout = _inputs(np.float32, n=n)
    opts = dict(causal=True, window_size=(5, 0), alibi_slopes=np.full(H, 0.2),
                dynamic_window=enp.DynamicWindow(0.6, sharpness=3.0))
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
    out_a, lse_a = enp.attention(q, k, v, return_lse=True, backend="cpu", align="kv_lengths", **opts)
    np.testing.assert_array_equal(out, out_a)
    np.testing.assert_array_equal(lse, lse_a)
    g = enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **opts)
    g_a = enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", align="kv_lengths", **opts)
    for field in ("dq", "dk", "dv", "dsigma"):
        np.testing.assert_array_equal(getattr(g, field), getattr(g_a, field))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("align", ["end", "", None, "KV_LENGTHS"])
def test_bad_align_is_named(backend, align):
    q, k, v, _ = _inputs(n=2, m=3)
    with pytest.raises(ValueError, match="`align`"):
        enp.attention(q, k, v, align=align, backend=backend)
