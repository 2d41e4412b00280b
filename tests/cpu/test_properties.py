"""Property-based tests: valid extreme values in every option, against the float64 oracle.

Every drawn problem must either be rejected with a ValueError or TypeError that
names a parameter, or give a ``NaN``-free result from the CPU kernels that
agrees with `elastic_np.reference` wherever the oracle is finite, forward and
backward. The allowance is the first-order effect of rounding the logits, at least ``1e-12`` of the size of
the terms (`allowances`); float32 results are checked for ``NaN`` and for the
same accept/reject decision.

CI runs ``ELASTIC_NP_PROPERTY_EXAMPLES`` examples per test (default 300); a
nightly run takes more: ``ELASTIC_NP_PROPERTY_EXAMPLES=5000 python -m pytest
tests/cpu/test_properties.py``.
"""

import os
import re

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import elastic_np as enp
from elastic_np import reference
from elastic_np._contract._problem import prepare
from elastic_np.reference import _attention
from elastic_np.testing import _tolerances

EXAMPLES = int(os.environ.get("ELASTIC_NP_PROPERTY_EXAMPLES", "300"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PARAMETERS = (
    "q", "k", "v", "dout", "out", "lse", "scale", "causal", "window_size", "kv_lengths", "align", "mask",
    "nvm", "tau", "beta", "dynamic_window", "sigma", "sharpness", "threshold", "softcap", "alibi_slopes",
    "bias",
)
NAMED = re.compile(r"`(" + "|".join(PARAMETERS) + r")`|\b(" + "|".join(PARAMETERS) + r")\b")


def log_uniform(lo, hi):
    return st.floats(np.log10(lo), np.log10(hi)).map(lambda e: float(10.0**e))


def per_head(values, H):
    """A scalar, or one value per head."""
    return st.one_of(values, st.lists(values, min_size=H, max_size=H).map(np.array))


@st.composite
def problems(draw):
    """``(q, k, v, dout, options)``: small shapes (N, M, D of 1, empty batches and key sets), extreme values."""
    B = draw(st.integers(0, 2))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2))
    N = draw(st.integers(0, 5))
    M = draw(st.integers(0, 7))
    D = draw(st.integers(1, 4))
    Dv = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logit_scale = draw(log_uniform(1e-3, 1e4))
    width = np.sqrt(logit_scale / np.sqrt(D))
    q = rng.standard_normal((B, H, N, D)) * width
    k = rng.standard_normal((B, Hkv, M, D)) * width
    v = rng.standard_normal((B, Hkv, M, Dv))
    dout = rng.standard_normal((B, H, N, Dv))
    options = dict(scale=1.0)
    if draw(st.booleans()):
        options["tau"] = draw(per_head(log_uniform(1e-6, 1e6), H))
    if draw(st.booleans()):
        options["beta"] = draw(per_head(st.one_of(st.just(0.0), log_uniform(1e-300, 1e300)), H))
    if draw(st.booleans()):
        options["softcap"] = draw(log_uniform(1e-3, 1e6))
    if draw(st.booleans()):
        options["nvm"] = True
    if draw(st.booleans()):
        options["causal"] = True
    if draw(st.booleans()):
        options["window_size"] = (draw(st.integers(-1, 4)), draw(st.integers(-1, 4)))
    if B and draw(st.booleans()):
        options["kv_lengths"] = rng.integers(0, M + 1, B)
        if draw(st.booleans()):
            options["align"] = "kv_lengths"
    if draw(st.booleans()):
        options["mask"] = rng.random((B, H, N, M)) < 0.8
    if draw(st.booleans()):
        options["alibi_slopes"] = np.array(draw(st.lists(log_uniform(1e-3, 1e2), min_size=H, max_size=H)))
    if draw(st.booleans()):
        options["dynamic_window"] = enp.DynamicWindow(
            draw(log_uniform(1e-2, 1e2)), sharpness=draw(log_uniform(1e-2, 1e3)),
            threshold=draw(st.one_of(st.just(0.0), log_uniform(1e-6, 1.0))),
        )
    if draw(st.booleans()):
        bias = rng.standard_normal((N, M)) * draw(log_uniform(1e-3, 1e4))
        bias[rng.random((N, M)) < 0.1] = -np.inf
        options["bias"] = bias
    return q, k, v, dout, options


def outcome(call):
    """``("ok", result)`` or ``("rejected", exception)`` for a ValueError or TypeError naming a parameter."""
    try:
        return "ok", call()
    except (ValueError, TypeError) as exc:
        assert NAMED.search(str(exc)), f"{type(exc).__name__} names no parameter: {exc}"
        return "rejected", exc


def run(backend, dtype, q, k, v, dout, options):
    """Forward and backward of one backend: ``(out, lse, grads)``."""
    args = [a.astype(dtype) for a in (q, k, v)]
    if "bias" in options:
        options = dict(options, bias=options["bias"].astype(dtype))
    out, lse = enp.attention(*args, return_lse=True, backend=backend, **options)
    grads = enp.attention_backward(dout.astype(dtype), *args, out, lse, backend=backend, **options)
    return out, lse, grads


GRADS = ("dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias")


def assert_no_nan(out, lse, grads):
    assert not np.isnan(out).any() and np.isfinite(out).all(), "out"
    assert not np.isnan(lse).any() and not (lse == np.inf).any(), "lse"
    for name in GRADS:
        value = getattr(grads, name)
        if value is not None:
            assert not np.isnan(value).any(), name


def allowances(q, k, v, dout, options):
    """The error allowed for each quantity, from the size of its terms and the logits' conditioning.

    A kernel computes each logit ``z`` with a rounding error of a few ``eps |z|``
    (``eps`` float64's), which moves ``p = exp(z - lse)`` by as much relative to
    itself: every quantity may be off by ``32 eps (1 + max |z|)`` times the sum
    of the magnitudes of its terms (``sum_j p_ij |v_j|`` for ``out``, the same
    with a bound on ``|dz|`` for the gradients), and never less than ``1e-12``
    of that sum.
    """
    p = prepare(q, k, v, **options)
    B, H, Hkv, N, M, D, Dv = p.shape
    group = H // Hkv
    with np.errstate(all="ignore"):
        out, lse = _attention._forward(p)
        s, z, keep, gate, cap_slope = _attention._attention_logits(p)
        probs = np.where(keep, np.exp(z - lse[..., None]), 0.0)
        vv = np.abs(np.repeat(p.v, group, axis=1))
        kk = np.abs(np.repeat(p.k, group, axis=1))
        delta = np.sum(np.abs(dout * out), axis=-1)
        dz = probs * (np.abs(dout) @ np.swapaxes(vv, -1, -2) + delta[..., None])
        ds = dz / p.tau[:, None, None]
        ds_raw = ds if cap_slope is None else ds * cap_slope
        zmax = max(np.max(np.abs(np.where(keep, z, 0.0)), initial=0.0),
                   np.max(np.abs(np.where(np.isfinite(lse), lse, 0.0)), initial=0.0))
        terms = {
            "out": probs @ vv,
            "lse": np.array(1.0 + zmax),
            "dq": p.scale * ds_raw @ kk,
            "dk": (p.scale * np.swapaxes(ds_raw, -1, -2) @ np.abs(p.q)).reshape(B, Hkv, group, M, D).sum(axis=2),
            "dv": (np.swapaxes(probs, -1, -2) @ np.abs(dout)).reshape(B, Hkv, group, M, Dv).sum(axis=2),
            "dtau": np.sum(np.where(keep, dz * np.abs(s), 0.0), axis=(0, 2, 3)) / p.tau**2,
            "dbeta": np.sum(np.where(delta == 0, 0.0, delta * np.exp(-lse)), axis=(0, 2)),
            "dbias": ds,
        }
        if gate is not None:
            G, f, x = gate
            y = p.sharpness * np.where(G > 0, f, 1.0)
            sigma = p.sigma[:, :, None, None]
            dlogg = _attention.log_tanh_elasticity(y) * ((x / sigma) ** 2 + 1) / sigma
            terms["dsigma"] = np.sum(np.where(keep, dz * dlogg, 0.0), axis=(2, 3))
    relative = max(32 * np.finfo(np.float64).eps * (1.0 + zmax), _tolerances.FLOOR["float64"])
    return {name: relative * float(np.max(t, initial=0.0)) for name, t in terms.items()}


def assert_agrees(got, want, allowed, name):
    """Where the oracle is finite: within ``allowed`` of it, and finite."""
    got, want = (np.asarray(a, dtype=np.float64) for a in (got, want))
    finite = np.isfinite(want)
    assert np.isfinite(got[finite]).all(), f"{name}: not finite where the oracle is"
    assert (got[~finite] == want[~finite]).all(), f"{name}: infinities differ from the oracle's"
    if finite.any():
        error = np.max(np.abs(got[finite] - want[finite]))
        assert error <= allowed, f"{name}: error {error:.3g} > allowed {allowed:.3g}"


@SETTINGS
@given(problems())
def test_extreme_valid_values(problem):
    q, k, v, dout, options = problem
    with np.errstate(all="ignore"):
        status, result = outcome(lambda: run("reference", np.float64, q, k, v, dout, options))
    got_status, got = outcome(lambda: run("cpu", np.float64, q, k, v, dout, options))
    assert got_status == status, (status, result, got)
    if status == "rejected":
        assert type(got) is type(result)
        return
    out, lse, grads = result
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "the oracle gave NaN"
    assert_no_nan(*got)
    allowed = allowances(q, k, v, dout, options)
    assert_agrees(got[0], out, allowed["out"], "out")
    assert_agrees(got[1], lse, allowed["lse"], "lse")
    for name in GRADS:
        want = getattr(grads, name)
        if want is not None:
            assert_agrees(getattr(got[2], name), want, allowed[name], name)

    status32, got32 = outcome(lambda: run("cpu", np.float32, q, k, v, dout, options))
    if status32 == "ok":
        assert_no_nan(*got32)
