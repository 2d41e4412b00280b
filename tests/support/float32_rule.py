"""The conformance kit's rule for every float32 quantity of a kernel backend, and the problems it is held on:
shared by the property tests of the CPU kernels (``test_properties_float32``, ``test_hardening_logits``) and of
the CUDA ones (``tests/cuda/test_sim_properties_float32.py``).

`problems` draws the corners an outside comparison found over the rule,
widened (``tau`` in [0.02, 50], soft-caps from 5 up, ALiBi with ``N > M``,
per-head ``tau`` and ``beta``, sinks, the masks, grouped-query heads and a
bias); `assert_within_the_kits_rule` holds each of ``out``, ``lse``, ``dq``,
``dk``, ``dv``, ``dtau``, ``dbeta`` and ``dbias`` to
`elastic_np.testing._tolerances.kit_allowed`.
"""

import numpy as np
from hypothesis import strategies as st

import elastic_np as enp
from elastic_np import reference
from elastic_np.testing import _tolerances
from elastic_np.testing._report import worst_error

QUANTITIES = ("out", "lse", "dq", "dk", "dv", "dtau", "dbeta", "dbias")


def log_uniform(lo, hi):
    return st.floats(np.log10(lo), np.log10(hi)).map(lambda e: float(10.0**e))


def per_head(values, H):
    """A scalar, or one value per head."""
    return st.one_of(values, st.lists(values, min_size=H, max_size=H).map(np.array))


@st.composite
def problems(draw):
    """``(q, k, v, dout, options, small_tiles)``: float32-exact unit normals, the options in the
    widened ranges, and whether the kernels run with tiles of 8 queries by 5 keys."""
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 3))
    B = draw(st.integers(1, 2))
    M = draw(st.integers(1, 70))
    N = draw(st.integers(1, 90))
    D = draw(st.sampled_from([4, 16, 64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, dout = (rng.standard_normal((B, H, N, n)) for n in (D, D))
    k, v = (rng.standard_normal((B, Hkv, M, D)) for _ in range(2))
    options = {}
    if draw(st.booleans()):
        options["tau"] = draw(per_head(log_uniform(0.02, 50.0), H))
    if draw(st.booleans()):
        options["beta"] = draw(per_head(st.one_of(st.just(0.0), log_uniform(1e-3, 1e3)), H))
    if draw(st.booleans()):
        options["softcap"] = draw(log_uniform(5.0, 1e3))
    if draw(st.booleans()):
        options["alibi_slopes"] = np.array(draw(st.lists(log_uniform(2.0**-8, 1.0), min_size=H, max_size=H)))
    if draw(st.booleans()):
        options["nvm"] = True
    if draw(st.booleans()):
        options["causal"] = True
    if draw(st.booleans()):
        options["window_size"] = (draw(st.integers(-1, 40)), draw(st.integers(-1, 40)))
    if draw(st.booleans()):
        options["bias"] = rng.standard_normal(draw(st.sampled_from([(N, M), (B, H, N, M), (1, H, 1, M)])))
    q, k, v, dout = (a.astype(np.float32).astype(np.float64) for a in (q, k, v, dout))
    if "bias" in options:
        options["bias"] = options["bias"].astype(np.float32).astype(np.float64)
    return q, k, v, dout, options, draw(st.booleans())


def kernel_results(q, k, v, dout, options, backend="cpu"):
    """A kernel backend's float32 ``out``, ``lse`` and gradients, by name."""
    args = [a.astype(np.float32) for a in (q, k, v)]
    if "bias" in options:
        options = dict(options, bias=options["bias"].astype(np.float32))
    out, lse = enp.attention(*args, return_lse=True, backend=backend, **options)
    grads = enp.attention_backward(dout.astype(np.float32), *args, out, lse, backend=backend, **options)
    return {"out": out, "lse": lse, **{name: getattr(grads, name) for name in QUANTITIES[2:]}}


def oracle_results(q, k, v, dout, options):
    out, lse = reference.attention(q, k, v, **options)
    with np.errstate(all="ignore"):
        grads = reference.attention_backward(dout, q, k, v, out, lse, **options)
    return {"out": out, "lse": lse, **{name: getattr(grads, name) for name in QUANTITIES[2:]}}


def assert_within_the_kits_rule(q, k, v, dout, options, got):
    """Every quantity of ``got`` (`kernel_results`) within `_tolerances.kit_allowed` of the oracle."""
    want = oracle_results(q, k, v, dout, options)
    with np.errstate(all="ignore"):
        naive = _tolerances.naive_orderings(q, k, v, dout, options, np.float32)
        rounding = _tolerances.rounding_allowance(q, k, v, dout, options)
    over = []
    for name in QUANTITIES:
        if want.get(name) is None:
            continue
        allowed, naive_error = _tolerances.kit_allowed(
            want[name], [n[name] for n in naive], np.float32, rounding.get(name, 0.0))
        error, note = worst_error(got[name], want[name])
        if not error <= allowed:
            over.append(f"{name}: error {error:.3g} > allowed {allowed:.3g} (naive {naive_error:.3g}) {note}")
    assert not over, "; ".join(over)
