"""The conformance kit's float32 rule is finite wherever the oracle is, and still rejects a wrong result.

Where a plain float32 evaluation of the formula overflows, its error, and
the rule's allowance, were infinite: any result passed. Three places:

- a row whose logits all lie far below the sink's logit ``log beta``
  (``exp(log beta - m)`` with ``m`` the row's largest logit): the naive
  evaluation now takes the row maximum over ``log beta`` too;
- ``dbeta = -sum delta exp(-lse)`` with ``lse`` below -88.7 (rows of very
  negative logits, no sink or a tiny one), whose true value lies beyond
  float32's range (the kernels return it in float64): the naive sum is then
  taken with its terms scaled by a common power and the factor restored in
  float64 (`_tolerances.naive_sink_gradient`);
- a dynamic window whose bell underflows float32 on every key of a row (the
  oracle's float64 bell does not): the naive gate is then taken in
  logarithms (`_tolerances._naive_gate`).

Each test checks the regime is reached, the allowance finite, the CPU
kernels within it, and a perturbed result rejected (by 0.1%, or by as much
as float32 resolves there). The last test: the products' terms in the
logits' factor (`_tolerances._logit_condition`), which a cancelling product
needs.
"""

import os
import sys

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference
from elastic_np.testing import _tolerances
from elastic_np.testing._report import worst_error

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import float32_extremes  # noqa: E402

F32_MAX = float(np.finfo(np.float32).max)


def exact(a):
    return np.asarray(a, dtype=np.float32).astype(np.float64)


def far_below(rng, B, H, N, M, D, offset, rows=slice(None), spread=1.0):
    """``q, k, v, dout`` whose every ``q . k / sqrt(D)`` lies near ``-offset`` on the query rows ``rows``.

    ``q`` and ``k`` are a shift plus normals of deviation ``spread``.
    """
    shift = np.sqrt(offset * np.sqrt(D)) * np.eye(D)[0]
    q = spread * rng.standard_normal((B, H, N, D))
    q[:, :, rows] += shift
    k = spread * rng.standard_normal((B, H, M, D)) - shift
    return tuple(exact(a) for a in (q, k, rng.standard_normal((B, H, M, D)), rng.standard_normal((B, H, N, D))))


def judged(problem, have):
    """`float32_extremes.judge` of ``have``, each allowance asserted finite wherever the oracle is."""
    result = float32_extremes.judge(*problem, have)
    want = float32_extremes.oracle_results(*problem)
    for name, (error, naive_error, allowed, note) in result.items():
        if np.isfinite(want[name]).any():
            assert np.isfinite(allowed), f"{name}: allowance {allowed} (naive error {naive_error})"
    return result


def assert_within(result):
    over = {name: r for name, r in result.items() if not r[0] <= r[2]}
    assert not over, over


def assert_rejected(problem, have, name, change):
    """``have`` with ``change`` applied to quantity ``name`` is outside the rule."""
    wrong = dict(have, **{name: change(np.asarray(have[name], dtype=np.float64))})
    error, _, allowed, _ = judged(problem, wrong)[name]
    assert error > allowed, f"{name}: perturbed error {error:.3g} within {allowed:.3g}"


@pytest.mark.parametrize("N", [1, 6, 40])  # the decode kernel (1 to 16 queries) and the prefill kernel
@pytest.mark.parametrize("tau", [1.0, 0.02])
def test_a_sink_far_above_every_logit_of_its_rows(N, tau):
    """Every other row's logits lie near -200 / tau, the others' at unit scale."""
    rng = np.random.default_rng(N)
    far = np.arange(N) % 2 == 0
    q, k, v, dout = far_below(rng, 1, 2, N, 23, 16, offset=200.0, rows=far)
    problem = (q, k, v, dout, None, {"beta": 1.0, "tau": tau})
    z = np.einsum("bhnd,bhmd->bhnm", q, k) / 4.0 / tau
    assert z[:, :, far].max() < -89  # a plain float32 exp(log beta - max z) overflows
    have = float32_extremes.kernel_results(*problem)
    result = judged(problem, have)
    assert_within(result)
    # ten times the float32 floor, on the sink's rows alone
    assert_rejected(problem, have, "lse", lambda lse: lse + np.where(far, 1e-4 * (1 + np.abs(lse).max()), 0.0))
    if not far.all():  # the other rows' logits reach 350 at tau = 0.02: float32 resolves dq to a few percent
        assert_rejected(problem, have, "out", lambda out: out * 1.001)
        assert_rejected(problem, have, "dq", lambda dq: dq * (1.001 if tau == 1.0 else 1.1))


@pytest.mark.parametrize("beta", [0.0, 1e-50, np.array([0.0, 1e-60])])
@pytest.mark.parametrize("N", [3, 40])
def test_a_dbeta_beyond_float32s_range(beta, N):
    rng = np.random.default_rng(N)
    q, k, v, dout = far_below(rng, 2, 2, N, 9, 8, offset=150.0)
    problem = (q, k, v, dout, None, {"beta": beta})
    want = float32_extremes.oracle_results(*problem)["dbeta"]
    assert np.all(np.isfinite(want)) and np.all(np.abs(want) > F32_MAX)
    have = float32_extremes.kernel_results(*problem)
    result = judged(problem, have)
    assert_within(result)
    assert_rejected(problem, have, "dbeta", lambda dbeta: dbeta * 1.001)
    assert_rejected(problem, have, "dbeta", lambda dbeta: -dbeta)


def test_a_head_whose_dbeta_overflows_float64_leaves_the_others_judged():
    """Head 0's rows reach ``lse`` near -1000 (the oracle's ``dbeta`` is infinite), head 1's stay at unit scale."""
    rng = np.random.default_rng(3)
    q, k, v, dout = far_below(rng, 1, 2, 4, 7, 8, offset=1000.0)
    q[:, 1], k[:, 1] = exact(rng.standard_normal(q[:, 1].shape)), exact(rng.standard_normal(k[:, 1].shape))
    problem = (q, k, v, dout, None, {"beta": np.array([0.0, 0.5])})
    want = float32_extremes.oracle_results(*problem)["dbeta"]
    assert np.isinf(want[0]) and np.isfinite(want[1])
    have = float32_extremes.kernel_results(*problem)
    result = judged(problem, have)
    assert_within(result)
    assert result["dbeta"][2] < 1e-4 * abs(want[1])
    assert_rejected(problem, have, "dbeta", lambda dbeta: dbeta * np.array([1.0, 1.001]))
    assert_rejected(problem, have, "dbeta", lambda dbeta: dbeta * np.array([np.nan, 1.0]))


@pytest.mark.parametrize("N", [16, 56])
def test_rows_whose_every_key_lies_far_outside_a_narrow_window(N):
    """A bell of width 0.1 over 15 keys: the first rows' ``f`` underflows float32, not float64."""
    rng = np.random.default_rng(N)
    q, k, v, dout = (exact(rng.standard_normal(s)) for s in [(1, 2, N, 16), (1, 2, 15, 16), (1, 2, 15, 16), (1, 2, N, 16)])
    window = enp.DynamicWindow(0.1, sharpness=0.01)
    problem = (q, k, v, dout, None, {"dynamic_window": window})
    x = 2.0 * (N - 1) / 14  # the first row's nearest key
    assert np.exp(-0.5 * (x / 0.1) ** 2) < np.finfo(np.float32).smallest_subnormal
    have = float32_extremes.kernel_results(*problem)
    result = judged(problem, have)
    assert_within(result)
    assert_rejected(problem, have, "out", lambda out: out * 1.001)
    if N == 16:  # at N = 56 the far rows' logits reach -3000: the rule's allowance exceeds |dsigma| there
        assert_rejected(problem, have, "dsigma", lambda dsigma: dsigma * 1.001)


def test_an_oracle_without_a_finite_value_allows_nothing():
    """Its infinities must be matched: a NaN or an infinity of the other sign is outside, whatever the naive gave."""
    want = np.array([np.inf, -np.inf])
    allowed, _ = _tolerances.kit_allowed(want, [want.copy()], np.float32, rounding=np.inf)
    assert allowed == 0.0
    assert worst_error(want, want)[0] <= allowed
    for wrong in (np.array([np.inf, np.nan]), np.array([np.inf, np.inf])):
        assert not worst_error(wrong, want)[0] <= allowed


def test_the_naive_dbeta_is_the_plain_float32_sum_wherever_that_is_finite():
    """The scaled sum replaces only what overflows: a head at unit scale keeps the plain sum's bits."""
    rng = np.random.default_rng(0)
    delta = rng.standard_normal((2, 2, 5)).astype(np.float32)
    lse = rng.uniform(-3.0, 3.0, (2, 2, 5)).astype(np.float32)
    lse[:, 0] -= np.float32(200.0)  # head 0: exp(-lse) overflows float32
    with np.errstate(over="ignore", invalid="ignore"):
        plain = -(delta * np.exp(-lse)).sum(axis=(0, 2)).astype(np.float64)
    got = _tolerances.naive_sink_gradient(delta, lse, (2,))
    assert not np.isfinite(plain[0]) and got[1] == plain[1]
    truth = -np.sum(delta[:, 0].astype(np.float64) * np.exp(-lse[:, 0].astype(np.float64)))
    assert abs(got[0] - truth) < 1e-5 * np.sum(np.abs(delta[:, 0] * np.exp(-lse[:, 0].astype(np.float64))))
    shared = _tolerances.naive_sink_gradient(delta, lse, ())
    assert isinstance(shared, float) and abs(shared - (truth + plain[1])) < 1e-5 * abs(truth)


def test_a_cancelling_product_in_any_summation_order():
    """``q . k`` near 10 from terms of magnitude 1000: every sequential float32 order passes, 8 eps beyond them fails.

    One key and no sink: ``out = v`` exactly and ``lse`` is the logit, so a
    kernel's ``lse`` error is its product's. NumPy's blocked products (the
    naive evaluation, in four orders of the head dims) can land well below a
    sequential sum's error, which the rule allows through the products'
    magnitude in the logits' factor.
    """
    rng = np.random.default_rng(5)
    D = 32
    q = 30.0 * rng.standard_normal(D)
    k = 30.0 * rng.standard_normal(D)
    k = exact(k - (q @ k - 10.0 * np.sqrt(D)) / (q @ q) * q)  # q . k / sqrt(D) near 10
    q = exact(q)
    terms = np.abs(q * k).sum() / np.sqrt(D)
    assert terms > 50 * abs(q @ k) / np.sqrt(D)
    problem = (q.reshape(1, 1, 1, D), k.reshape(1, 1, 1, D), np.ones((1, 1, 1, 4)), np.ones((1, 1, 1, 4)), None, {})
    want = float32_extremes.oracle_results(*problem)
    have = {name: np.asarray(want[name], dtype=np.float32) for name in float32_extremes.QUANTITIES if want[name] is not None}
    scale = np.float32(1 / np.sqrt(D))
    for _ in range(200):
        total = np.float32(0)
        for d in rng.permutation(D):
            total = np.float32(total + np.float32(q[d] * scale) * np.float32(k[d]))
        have["lse"] = np.full((1, 1, 1), total, dtype=np.float32)
        error, _, allowed, _ = judged(problem, have)["lse"]
        assert error <= allowed
    eps = float(np.finfo(np.float32).eps)
    assert_rejected(problem, have, "lse", lambda lse: want["lse"] + 8 * eps * (1 + terms))


@pytest.mark.parametrize("seed, index", [(1, 6291), (1, 7144), (2, 2987), (2, 7022), (2, 9076)])
def test_the_problems_that_10000_extreme_problems_found_over_the_rule(seed, index):
    """Honest results the rule rejected, each for a rounding it did not count.

    A logit from a cancelling product (seed 1: 6291, 7144); a ``dbeta``
    below float32's normal range, whose ``delta`` are subnormal (2987); the
    slope of a saturated soft-cap, ``4 exp(-2 |x|)``, which moves by ``2 |dx|``
    relative to itself (7022); a ``dbeta`` near float64's largest number,
    whose terms' magnitudes overflow it (9076).
    """
    result = float32_extremes.measure(*float32_extremes.problem(seed, index))
    assert not float32_extremes.findings(result)


def test_a_dbeta_near_float64s_largest_number():
    """Rows near ``lse = -705``: ``dbeta`` about 1e307, its terms' magnitudes with their factors beyond float64."""
    rng = np.random.default_rng(9)
    q, k, v, dout = far_below(rng, 1, 2, 9, 30, 16, offset=708.0, spread=0.1)
    problem = (q, k, v, dout, None, {})
    want = float32_extremes.oracle_results(*problem)["dbeta"]
    assert np.isfinite(want) and abs(want) > 1e306
    have = float32_extremes.kernel_results(*problem)
    result = judged(problem, have)
    assert_within(result)
    assert result["dbeta"][2] < 5e-3 * abs(want)
    # every term carries the logits' factor, above 700 here: the bound is not cut at float64's largest number
    rounding = _tolerances.rounding_allowance(q, k, v, dout, {})["dbeta"]
    assert rounding >= 2 * float(np.finfo(np.float32).eps) * 700 * abs(want)
    assert_rejected(problem, have, "dbeta", lambda dbeta: dbeta * 1.01)


def test_a_result_below_float32s_normal_range():
    """A sink of 2 over logits near -100: ``out`` and ``delta`` are float32 subnormals, resolved to 1.4e-45 at best."""
    rng = np.random.default_rng(4)
    q, k, v, dout = far_below(rng, 1, 2, 20, 30, 16, offset=100.0, spread=0.1)
    problem = (q, k, v, dout, None, {"beta": 2.0})
    want = float32_extremes.oracle_results(*problem)
    tiny = float(np.finfo(np.float32).tiny)
    assert np.abs(want["out"]).max() < 1e-4 * tiny and 0 < abs(want["dbeta"]) < 1e-4 * tiny
    have = float32_extremes.kernel_results(*problem)
    assert_within(judged(problem, have))
    assert_rejected(problem, have, "out", lambda out: out + 2 * tiny)
    assert_rejected(problem, have, "dbeta", lambda dbeta: dbeta + 2 * tiny)
