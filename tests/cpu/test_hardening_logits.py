"""NVM under every scale, and one set of logits for the decode forward and every backward.

NVM keeps an entry where its final score ``s = scale q . k`` (after the
modifiers) is ``>= 0``: with ``scale = 0`` every entry, with ``scale < 0``
those where ``q . k <= 0``. Under NVM the kernels scale the product after
it, and took the tile maxima of the products ``>= 0`` with it: those of
the kept logits for a positive scale only (with ``scale = 0`` a NaN, with a
negative one ``+inf``, and the rows empty).

The backward recomputes the probabilities from the forward's ``lse``: on a
row with a single kept key, ``p = exp(z - lse)`` is exactly 1 only when it
forms the logit ``z`` with the forward's bits. The bias and ALiBi terms,
added with one rounding (a fused multiply-add) in some kernels and tile
positions and with two in others, and float64 soft-cap factors formed as
``c / tau`` in one kernel and ``c (1 / tau)`` in another, put ``dv`` off by
6% at ``tau = 1e-6`` and to infinity at ``tau = 1e-8``.
"""

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import elastic_np as enp
from elastic_np import cpu, reference
from elastic_np._contract import _problem
from oracle_checks import assert_matches_oracle
from float32_rule import assert_within_the_kits_rule, kernel_results, log_uniform, per_head

DTYPES = [np.float64, np.float32]
#: One query (the stacked-rows decode kernel), 15, 16 (the key-major one), 17 and 40 (the prefill kernels).
QUERY_COUNTS = [1, 15, 16, 17, 40]
#: Examples of each property test: half of ``ELASTIC_NP_PROPERTY_EXAMPLES`` (default 300).
SETTINGS = settings(
    max_examples=max(1, int(os.environ.get("ELASTIC_NP_PROPERTY_EXAMPLES", "300")) // 2), deadline=None,
    derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: A third of those for the one-key property, whose every example runs a forward, backward, prefill forward and
#: double backward (about 0.1 s each).
ONE_KEY_SETTINGS = settings(SETTINGS, max_examples=max(1, SETTINGS.max_examples // 3))


def tiles(patch, name):
    """Default tiles, or tiles small enough that the problems span several: decode keys, or prefill tiles."""
    patch.setattr(cpu._runtime.config, "SERIAL_WORK", 0)
    if name == "decode":
        patch.setattr(cpu._runtime.config, "DECODE_BLOCK_K", 5)
        patch.setattr(cpu._runtime.config, "DECODE_MIN_SPLIT_KEYS", 7)
        patch.setattr(cpu._runtime.config, "DECODE_MIN_TASKS", 64)
    elif name == "prefill":
        patch.setattr(cpu._runtime.config, "BLOCK_Q", 32)
        patch.setattr(cpu._runtime.config, "BLOCK_K", 48)


# NVM with a scale that is not positive


@pytest.mark.parametrize("scale", [0.0, -1.0])
@pytest.mark.parametrize("N", QUERY_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvm_with_a_scale_that_is_not_positive(dtype, N, scale):
    q = np.ones((1, 1, N, 1), dtype)
    k = np.array([-1.0, -2.0], dtype).reshape(1, 1, 2, 1)
    v = np.array([1.0, 3.0], dtype).reshape(1, 1, 2, 1)
    for magnitude in (1.0, 1e3):  # logits of 1 and 2, and of 1000 and 2000
        out, lse = enp.attention(q, magnitude * k, v, scale=scale, nvm=True, return_lse=True, backend="cpu")
        want_out, want_lse = reference.attention(q, magnitude * k, v, scale=scale, nvm=True)
        if scale == 0.0:
            assert want_out[0, 0, 0, 0] == 2.0 and want_lse[0, 0, 0] == np.log(2.0)
        rtol = 1e-12 if dtype == np.float64 else 1e-6
        np.testing.assert_allclose(out, want_out, rtol=rtol)
        np.testing.assert_allclose(lse, want_lse, rtol=rtol)


@pytest.mark.parametrize("N", [3, 16, 20])
@pytest.mark.parametrize("scale", [0.0, -0.4])
def test_nvm_gradients_with_a_scale_that_is_not_positive(N, scale):
    """The backward and the double backward, float64, against the oracle: soft-cap, ALiBi, bias, a gate."""
    rng = np.random.default_rng(7)
    q, dout = rng.standard_normal((2, 1, 4, N, 8))
    k, v = rng.standard_normal((2, 1, 2, 37, 8))
    ddq, ddk, ddv = rng.standard_normal(q.shape), rng.standard_normal(k.shape), rng.standard_normal(v.shape)
    options = dict(
        scale=scale, nvm=True, tau=np.array([0.5, 1.0, 2.0, 0.3]), beta=0.4, softcap=3.0,
        alibi_slopes=np.array([0.1, 0.2, 0.0, 0.05]), bias=rng.standard_normal((N, 37)), causal=True,
        dynamic_window=enp.DynamicWindow(0.7, threshold=0.02),
    )
    for backend_options in (options, dict(options, dynamic_window=None, bias=None, alibi_slopes=None, causal=False)):
        got, want = (_every_result(backend, q, k, v, dout, (ddq, ddk, ddv), backend_options)
                     for backend in ("cpu", "reference"))
        for name in want:
            assert_matches_oracle(name, got[name], want[name], np.float64)


def _every_result(backend, q, k, v, dout, cotangents, options):
    """``out``, ``lse``, the gradients and the double backward's outputs, by name (those not None)."""
    out, lse = enp.attention(q, k, v, return_lse=True, backend=backend, **options)
    grads = enp.attention_backward(dout, q, k, v, out, lse, backend=backend, **options)
    second = enp.attention_double_backward(*cotangents, dout, q, k, v, out, lse, backend=backend, **options)
    results = {"out": out, "lse": lse}
    results.update({f"d{name}": getattr(grads, f"d{name}") for name in ("q", "k", "v", "tau", "beta")})
    results.update({f"second {name}": getattr(second, name) for name in ("ddout", "ddlse", "dq", "dk", "dv")})
    return {name: value for name, value in results.items() if value is not None}


@st.composite
def nvm_problems(draw):
    """Unit normal float32-exact inputs, NVM, a scale of either sign or 0, the options with extreme logits."""
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2))
    B = draw(st.integers(1, 2))
    N = draw(st.sampled_from([1, 2, 5, 15, 16, 17, 33]))
    M = draw(st.integers(1, 70))
    D = draw(st.sampled_from([4, 16, 64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, dout = rng.standard_normal((2, B, H, N, D))
    k, v = rng.standard_normal((2, B, Hkv, M, D))
    signs = draw(st.sampled_from(["mixed", "same", "opposite"]))  # of the products: any, all >= 0, all <= 0
    if signs != "mixed":
        q, k = np.abs(q), np.abs(k) * (1.0 if signs == "same" else -1.0)
    sign = draw(st.sampled_from([-1.0, 0.0, 1.0]))
    scale = sign * draw(log_uniform(1e-3, 1e2))
    options = dict(nvm=True, scale=scale, tau=draw(per_head(log_uniform(0.02, 50.0), H)))
    if draw(st.booleans()):
        options["beta"] = draw(per_head(st.one_of(st.just(0.0), log_uniform(1e-3, 1e3)), H))
    if draw(st.booleans()):
        options["softcap"] = draw(log_uniform(5.0, 1e3))
    if draw(st.booleans()):
        options["alibi_slopes"] = np.array(draw(st.lists(log_uniform(2.0**-8, 1.0), min_size=H, max_size=H)))
    if draw(st.booleans()):
        options["causal"] = True
    if draw(st.booleans()):
        options["bias"] = rng.standard_normal(draw(st.sampled_from([(N, M), (B, H, N, M), (1, H, 1, M)])))
        options["bias"] = options["bias"].astype(np.float32).astype(np.float64)
    q, k, v, dout = (a.astype(np.float32).astype(np.float64) for a in (q, k, v, dout))
    return q, k, v, dout, options, draw(st.sampled_from(["default", "decode", "prefill"]))


def decided_by_rounding(q, k, v, options):
    """Whether a final score lies within float32's rounding of 0, where NVM may keep or remove it.

    NVM jumps at ``s = 0``: a score of ``-4e-8`` (a saturated soft-cap less
    an ALiBi term of the cap's size) that float32 rounds to 0 is kept, the
    oracle removes it, and no rule on rounding errors can judge the result.
    Within ``1e-6`` of the sum of the magnitudes of the score's terms.
    """
    p = _problem.prepare(q, k, v, **options)
    product = reference.scores(dataclasses.replace(p, alibi=None, bias=None))[0]
    alibi = reference.scores(dataclasses.replace(p, scale=0.0, softcap=None, bias=None))[0]
    terms = np.abs(product) + np.abs(alibi) + (0.0 if p.bias is None else np.abs(p.bias))
    return bool(np.any(np.abs(reference.scores(p)[0]) < 1e-6 * terms))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@SETTINGS
@given(nvm_problems())
def test_nvm_of_any_scale_within_the_kits_rule(problem):
    q, k, v, dout, options, tile_sizes = problem
    assume(not decided_by_rounding(q, k, v, options))
    with pytest.MonkeyPatch.context() as patch:
        tiles(patch, tile_sizes)
        got = kernel_results(q, k, v, dout, options)
    assert_within_the_kits_rule(q, k, v, dout, options, got)


# The decode forward's logits, recomputed by the backward


def test_the_issue_reproducer_for_a_biased_decode_logit():
    for tau, N in ((1e-6, n) for n in range(1, 17)):
        q = np.full((1, 1, N, 1), -2.3250308, np.float32)
        k = np.full((1, 1, 1, 1), -0.21879166, np.float32)
        v = np.ones((1, 1, 1, 1), np.float32)
        options = dict(scale=1.0, tau=tau, bias=np.full((1, 1, N, 1), -1.2459110, np.float32))
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **options)
        grads = enp.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="cpu", **options)
        assert grads.dv[0, 0, 0, 0] == N, (N, grads.dv[0, 0, 0, 0] / N)


@st.composite
def one_key_problems(draw):
    """Rows that keep one key each (a window of width 1, or a mask), with every option that changes a logit.

    Returns ``(q, k, v, dout, options, keys, tile_sizes)``: ``keys[b, h, i]`` the key row ``i`` may keep
    (-1: none); ``dout`` small integers, so that sums of them are exact.
    """
    dtype = draw(st.sampled_from(DTYPES))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2))
    B = draw(st.integers(1, 2))
    N = draw(st.integers(1, 20))
    M = draw(st.integers(1, 300))
    D = draw(st.sampled_from([1, 3, 16, 64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((B, H, N, D))
    k, v = rng.standard_normal((2, B, Hkv, M, D))
    dout = rng.integers(1, 4, (B, H, N, D)).astype(float)
    tau = draw(per_head(log_uniform(1e-8, 50.0), H))
    options = dict(tau=tau, scale=draw(st.sampled_from([-1.0, 1.0])) * draw(log_uniform(0.05, 5.0)))
    if draw(st.booleans()):  # the diagonal's key
        options["window_size"] = (0, 0)
        keys = np.broadcast_to(np.arange(N) + M - N, (B, H, N)).copy()
        keys[keys < 0] = -1
    else:  # a key drawn for each row
        keys = rng.integers(0, M, (B, H, N))
        options["mask"] = np.arange(M) == keys[..., None]
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(B, H, N, M), (N, M), (1, H, 1, M), (B, 1, N, 1)]))
        options["bias"] = rng.standard_normal(shape) * draw(log_uniform(1e-2, 1e3))
        if draw(st.booleans()):
            options["bias"] = np.asfortranarray(options["bias"])
    if draw(st.booleans()):
        options["alibi_slopes"] = rng.uniform(0.0, 1.0, H)
    if draw(st.booleans()):
        options["softcap"] = draw(log_uniform(0.1, 1e3))
    if draw(st.booleans()):
        options["nvm"] = True
    if draw(st.booleans()):
        options["dynamic_window"] = enp.DynamicWindow(draw(st.floats(0.2, 2.0)), sharpness=3.0)
    if "bias" in options:
        options["bias"] = options["bias"].astype(dtype)
    inputs = tuple(a.astype(dtype) for a in (q, k, v, dout))
    return (*inputs, options, keys, draw(st.sampled_from(["default", "decode", "prefill"])))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@ONE_KEY_SETTINGS
@given(one_key_problems())
def test_a_row_with_one_key_has_p_exactly_one(problem):
    """``dv`` of every key is the sum of ``dout`` over the rows that keep it; the forward's ``lse`` is the
    prefill tiles' logit, bit for bit; the double backward's ``ddout`` of a row is ``ddv`` of its key."""
    q, k, v, dout, options, keys, tile_sizes = problem
    B, H, N = q.shape[:3]
    group = H // k.shape[1]
    with pytest.MonkeyPatch.context() as patch:
        tiles(patch, tile_sizes)
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **options)
        grads = enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **options)
        prefill_lse = cpu._prefill.forward.forward(cpu.prepare(q, k, v, dtypes=cpu.dtypes, **options))[1]
        ddv = np.random.default_rng(1).integers(-3, 4, v.shape).astype(v.dtype)
        second = enp.attention_double_backward(None, None, ddv, dout, q, k, v, out, lse, backend="cpu", **options)
    np.testing.assert_array_equal(lse, prefill_lse)
    kept = lse > -np.inf
    assert np.all(keys[kept] >= 0)
    want_dv = np.zeros(v.shape)
    want_ddout = np.zeros(dout.shape)
    for b, h, i in zip(*np.nonzero(kept)):
        want_dv[b, h // group, keys[b, h, i]] += dout[b, h, i]
        want_ddout[b, h, i] = ddv[b, h // group, keys[b, h, i]]
    np.testing.assert_array_equal(grads.dv, want_dv)
    np.testing.assert_array_equal(second.ddout, want_ddout)
