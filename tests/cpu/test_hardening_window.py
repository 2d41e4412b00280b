"""The dynamic window at its edges: rows far from all their keys, and ``dtau`` beside a large ``log G``.

With many more queries than keys, the first rows sit far outside the
window: every key they keep has a gate ``G = tanh(sharpness f)`` whose bell
``f`` is tiny or subnormal, ``log G`` is hundreds below 0, and the rows'
probabilities still sum to 1. ``d log G / d sigma`` tends to ``(u^2 - 1) /
sigma`` there (``u = x / sigma``); it must not come out as ``inf * 0``. And
a logit ``z = s / tau + log G`` rounded at ``|log G|`` no longer holds
``s / tau`` to the precision ``dtau`` needs. The float64 oracle is held to
finite differences and to a 40-digit evaluation (`mp_oracle`), the kernels
to the oracle by the conformance kit's rule. The CUDA kernels have the same
cases in ``tests/cuda/test_sim_hardening_window.py``.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import elastic_np as enp
from elastic_np import reference
from elastic_np.reference._attention import window_gate
from elastic_np._contract._problem import prepare
from mp_oracle import mp_attention_grads, relative_errors
from window_edges import faint_gate_inputs, far_rows, fields, out_of_rule, run

KERNELS = [("cpu", np.float64), ("cpu", np.float32)]
#: Below this ``y = sharpness f``, ``1 / y`` (what ``d log G / dy`` tends to) overflows float64.
OVERFLOWS = 1 / np.finfo(np.float64).max
SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def smallest_open_gate(q, k, v, options):
    """The smallest ``sharpness f`` among the entries the gate keeps (where ``d log G / dy`` is largest)."""
    p = prepare(q, k, v, **options)
    G, f, _ = window_gate(p)
    return float(np.min(p.sharpness * f[G > 0]))


# --- dsigma where a row's keys all lie far outside the window (issue 71, item 3) ----------


@pytest.mark.parametrize("backend, dtype", [("reference", np.float64), *KERNELS])
def test_dsigma_of_the_reported_rows_is_finite_and_right(backend, dtype):
    q = np.ones((1, 1, 20, 4))
    k = v = np.ones((1, 1, 3, 4))
    options = dict(dynamic_window=enp.DynamicWindow(0.5, sharpness=2.0))
    assert smallest_open_gate(q, k, v, options) < OVERFLOWS
    out, lse, grads = run(backend, dtype, q, k, v, np.ones_like(q), options)
    want = mp_attention_grads(q[0, 0], k[0, 0], v[0, 0], q[0, 0], 0.5, 1.0, 0.0, sigma=0.5, sharpness=2.0)
    assert np.isfinite(grads.dsigma)
    # every p (dP - delta) is 0 here: a rounding of delta is all the kernels may add
    assert abs(grads.dsigma - want["dsigma"]) <= 3000 * 20 * 4 * np.finfo(dtype).eps
    if backend == "cpu":
        assert not out_of_rule(q, k, v, np.ones_like(q), options, dtype, fields(out, lse, grads))


# (N, M, sigma): the first row's nearest key has a normal f, its farthest a subnormal one
# (1 / (4 sharpness f) overflows), and no f within e^-10 of underflowing to 0
FAR = [(24, 3, 0.6), (20, 4, 0.3), (26, 5, 0.3)]


@pytest.mark.parametrize("seed, sizes, sharpness", [(0, FAR[0], 2.0), (1, FAR[1], 0.05), (2, FAR[2], 40.0)])
def test_oracle_of_far_rows_matches_finite_differences(seed, sizes, sharpness):
    N, M, sigma = sizes
    q, k, v, dout = (a[None, None] for a in far_rows(seed, N, M))
    window = enp.DynamicWindow(sigma, sharpness=sharpness)
    options = dict(scale=0.5, beta=0.2, tau=0.9)
    assert smallest_open_gate(q, k, v, dict(options, dynamic_window=window)) < OVERFLOWS
    out, lse = reference.attention(q, k, v, dynamic_window=window, **options)
    grads = reference.attention_backward(dout, q, k, v, out, lse, dynamic_window=window, **options)
    assert np.isfinite(grads.dsigma) and abs(grads.dsigma) > 1e-3

    def forward(q, k, v, sigma, tau, beta):
        win = enp.DynamicWindow(sigma, sharpness=sharpness)
        return reference.attention(q, k, v, scale=0.5, tau=tau, beta=beta, dynamic_window=win)[0]

    inputs = dict(q=q, k=k, v=v, sigma=sigma, tau=0.9, beta=0.2)
    claimed = dict(q=grads.dq, k=grads.dk, v=grads.dv, sigma=grads.dsigma, tau=grads.dtau, beta=grads.dbeta)
    enp.testing.gradcheck(forward, inputs, claimed, dout=dout)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("seed, sizes, sharpness", [(3, FAR[0], 40.0), (4, FAR[1], 2.0), (5, FAR[2], 0.05)])
def test_far_rows_match_a_40_digit_evaluation(backend, seed, sizes, sharpness):
    N, M, sigma = sizes
    q, k, v, dout = far_rows(seed, N, M)
    options = dict(scale=0.5, tau=0.8, beta=0.1, dynamic_window=enp.DynamicWindow(sigma, sharpness=sharpness))
    assert smallest_open_gate(q[None, None], k[None, None], v[None, None], options) < OVERFLOWS
    want = mp_attention_grads(q, k, v, dout, 0.5, 0.8, 0.1, sigma=sigma, sharpness=sharpness)
    _, _, grads = run(backend, np.float64, *(a[None, None] for a in (q, k, v, dout)), options)
    errors = relative_errors(grads, want)
    assert max(errors.values()) < 1e-9, errors


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_double_backward_of_far_rows_matches_finite_differences(backend):
    # d^2 log G / d sigma^2 has the same factor (d log tanh / d log y) as the first derivative
    N, M, sigma = FAR[1]
    q, k, v, dout = (a[None, None] for a in far_rows(7, N, M))
    options = dict(scale=0.5, tau=0.8, beta=0.1)
    rng = np.random.default_rng(8)
    ddq, ddk, ddv = (rng.standard_normal(a.shape) for a in (q, k, v))

    def backward(q, sigma, tau):
        window = enp.DynamicWindow(sigma, sharpness=2.0)
        out, lse = reference.attention(q, k, v, scale=0.5, tau=tau, beta=0.1, dynamic_window=window)
        g = reference.attention_backward(dout, q, k, v, out, lse, scale=0.5, tau=tau, beta=0.1, dynamic_window=window)
        return np.concatenate([g.dq.ravel(), g.dk.ravel(), g.dv.ravel(), [g.dsigma, g.dtau]])

    window = enp.DynamicWindow(sigma, sharpness=2.0)
    out, lse = enp.attention(q, k, v, return_lse=True, backend=backend, dynamic_window=window, **options)
    h = enp.attention_double_backward(ddq, ddk, ddv, dout, q, k, v, out, lse, ddsigma=0.7, ddtau=0.3,
                                      backend=backend, dynamic_window=window, **options)
    weights = np.concatenate([ddq.ravel(), ddk.ravel(), ddv.ravel(), [0.7, 0.3]])
    enp.testing.gradcheck(backward, dict(q=q, sigma=sigma, tau=0.8), dict(q=h.dq, sigma=h.dsigma, tau=h.dtau),
                          dout=weights)

@st.composite
def outrun_problems(draw):
    """``(q, k, v, dout, options)``: up to 48 queries over 1 to 6 keys, a narrow or wide window, any sharpness."""
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    M = draw(st.integers(1, 6))
    N = M + draw(st.integers(0, 42))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, dout = (rng.standard_normal((B, H, N, 4)) for _ in range(2))
    k, v = (rng.standard_normal((B, H, M, 4)) for _ in range(2))
    sigma = 10.0 ** rng.uniform(-1.3, 0.3, size=draw(st.sampled_from([(), (B, H)])))
    window = enp.DynamicWindow(sigma, sharpness=10.0 ** draw(st.floats(-3, 3)),
                               threshold=draw(st.sampled_from([0.0, 1e-200, 1e-30])))
    options = dict(dynamic_window=window, tau=10.0 ** draw(st.floats(-1, 0.5)))
    if draw(st.booleans()):
        options["beta"] = 10.0 ** draw(st.floats(-3, 1))
    if draw(st.booleans()):
        options["causal"] = True
    q, k, v, dout = (a.astype(np.float32).astype(np.float64) for a in (q, k, v, dout))
    return q, k, v, dout, options


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@SETTINGS
@given(outrun_problems())
def test_rows_that_outrun_their_keys_within_the_kits_rule(problem):
    q, k, v, dout, options = problem
    over = {}
    for backend, dtype in KERNELS:
        got = fields(*run(backend, dtype, q, k, v, dout, options))
        over[np.dtype(dtype).name] = out_of_rule(q, k, v, dout, options, dtype, got)
    assert not any(over.values()), over


# --- dtau beside a large log G (issue 71, item 12) ----------------------------------------


@pytest.mark.parametrize("backend, dtype", KERNELS)
def test_dtau_of_small_scores_under_a_faint_gate(backend, dtype):
    q, k, v, dout, options = faint_gate_inputs(1.0)
    got = fields(*run(backend, dtype, q, k, v, dout, options))
    assert not out_of_rule(q, k, v, dout, options, dtype, got)


@pytest.mark.parametrize("backend, dtype", [("reference", np.float64), *KERNELS])
def test_dtau_of_zero_scores_under_a_gate_is_zero(backend, dtype):
    # scale = 0: every score is 0, and so is every term dz s of dtau
    q, k, v, dout, options = faint_gate_inputs(0.0)
    _, _, grads = run(backend, dtype, q, k, v, dout, options)
    np.testing.assert_array_equal(grads.dtau, 0.0)
    assert np.all(grads.dsigma != 0.0)


@st.composite
def extreme_problems(draw):
    """``(q, k, v, dout, options)`` under a dynamic window, with logits up to the thousands.

    ``tau`` down to 0.02; scores of magnitude 1e-3 to 30 (queries, ALiBi's
    terms and the bias alike): scores that ``log G`` dwarfs, and logits in
    the thousands; sinks, soft-caps, ALiBi, NVM, causal masks and a bias
    drawn on top; the window narrow or wide, faint or saturated.
    """
    H, M, N = draw(st.integers(1, 3)), draw(st.integers(1, 40)), draw(st.integers(1, 50))
    D = draw(st.sampled_from([4, 16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    magnitude = draw(st.sampled_from([1e-3, 1e-2, 1.0, 30.0]))  # of the scores, and of ALiBi's and the bias's terms
    q = magnitude * rng.standard_normal((1, H, N, D))
    k, v = (rng.standard_normal((1, H, M, D)) for _ in range(2))
    dout = rng.standard_normal((1, H, N, D))
    sigma = 10.0 ** rng.uniform(-1.3, 0.3, size=draw(st.sampled_from([(), (1, H)])))
    options = dict(
        tau=10.0 ** rng.uniform(np.log10(0.02), np.log10(50), size=draw(st.sampled_from([(), (H,)]))),
        dynamic_window=enp.DynamicWindow(sigma, sharpness=10.0 ** draw(st.sampled_from([-3, -2, 0, 3])),
                                         threshold=draw(st.sampled_from([0.0, 0.01, 0.1]))),
    )
    extras = dict(beta=10.0 ** draw(st.floats(-3, 3)), softcap=10.0 ** draw(st.floats(0.7, 3)),
                  alibi_slopes=magnitude * 2.0 ** rng.uniform(-8, 0, size=H), nvm=True, causal=True,
                  bias=(magnitude * rng.standard_normal((N, M))).astype(np.float32).astype(np.float64))
    options.update({name: value for name, value in extras.items() if draw(st.booleans())})
    q, k, v, dout = (a.astype(np.float32).astype(np.float64) for a in (q, k, v, dout))
    return q, k, v, dout, options


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@SETTINGS
@given(extreme_problems())
def test_float32_under_a_window_on_extreme_logits_within_the_kits_rule(problem):
    q, k, v, dout, options = problem
    got = fields(*run("cpu", np.float32, q, k, v, dout, options))
    over = out_of_rule(q, k, v, dout, options, np.float32, got)
    assert not over, over
