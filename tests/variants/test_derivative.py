"""elastic_np._variants.derivative: a score_mod's exact derivative, Numba's ``vjp`` and the NumPy evaluator
against each other, against the Python function's values and against central finite differences."""

import math
from math import exp, tanh

import numba
import numpy as np
import pytest

from elastic_np._variants.derivative import differentiate

B, H, N = 2, 2, 24  # N: index distances past T5's exact buckets (8)


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * math.tanh(score / 30.0)


def rel_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + table.shape[1] // 2]


def alibi(score, b, h, q_idx, kv_idx, slopes):
    return score - slopes[h] * abs(q_idx - kv_idx)


def t5_with(to_int):
    def t5(score, b, h, q_idx, kv_idx, table):
        rel = kv_idx - q_idx
        n = np.abs(rel)
        large = 8 + to_int(np.log(np.maximum(n, 1) / 8.0) / math.log(128 / 8.0) * 8)
        bucket = np.where(n < 8, n, np.minimum(large, 15)) + np.where(rel > 0, 16, 0)
        return score + table[bucket, h]
    return t5


def gated(score, b, h, q_idx, kv_idx, w):
    return np.where(q_idx >= kv_idx, score * w[h], -np.inf)


def mix(score, b, h, q_idx, kv_idx, w):
    return math.log1p(math.exp(score)) * w[0] + math.sqrt(w[1] * w[1] + 1.0) - max(score, w[2])


def powers(score, b, h, q_idx, kv_idx, w):
    return w[0] ** score + (score * score + 0.5) ** w[1] + math.pow(score * score + 1.0, w[2]) + score ** 3


def divide(score, b, h, q_idx, kv_idx, w):
    return score / w[h] + 1.0 / (w[h] * (score * score + 1.0)) - (q_idx + 1) / (kv_idx + 2)


def no_score(score, b, h, q_idx, kv_idx, w, doc):
    return w[h] * 2.0 + (q_idx - kv_idx) + np.where(doc[q_idx] == doc[kv_idx], w[0] * w[1], 0.0)


def indices_only(score, b, h, q_idx, kv_idx):
    return float(q_idx - kv_idx) / 3.0 + (q_idx - kv_idx) // 4 + (q_idx - 2 * kv_idx) % 3


def imported(score, b, h, q_idx, kv_idx):
    return exp(-tanh(score)) + min(score, 1.5, 2.0 * score)


def make_scaled(scale):
    def scaled(score, b, h, q_idx, kv_idx):
        return scale * math.tanh(score / scale) + round(scale) * 0.25
    return scaled


def _smooth(x):
    return math.log1p(math.exp(x))


def uses_helper(score, b, h, q_idx, kv_idx, w):
    return _smooth(score * w[0]) - _smooth(-score)


def many(score, b, h, q_idx, kv_idx, w):
    s = score / 4.0
    return (np.sin(s) + math.cos(s * w[0]) + np.arctan(s) + np.sinh(s) * math.cosh(s) + np.tan(s / 4.0)
            + np.clip(score, -1.0, 1.0) * w[1] + np.square(s) + np.log2(abs(s) + 1.0) + math.log10(np.fabs(s) + 2.0)
            + np.expm1(s) + math.copysign(s, w[0]) + np.float64(score % 1.7) + np.sign(score) + (s > 0) * 0.5
            + np.where((q_idx > kv_idx) & ~(h == 1), math.atan(s), math.sqrt(s * s + 1.0)))


def _rng_captures(seed):
    rng = np.random.default_rng(seed)
    return {
        "table_rel": rng.normal(size=(H, 2 * N - 1)),
        "slopes": rng.uniform(0.1, 1.0, size=H),
        "table_t5": rng.normal(size=(32, H)),
        "w3": rng.normal(size=3),
        "positive": rng.uniform(0.5, 2.0, size=3),
        "doc": np.repeat([0, 1, 1, 2], N // 4),
    }


C = _rng_captures(1)
CASES = {
    "softcap": (softcap, ()),
    "softcap_njit": (numba.njit(softcap), ()),
    "rel_bias": (rel_bias, (C["table_rel"],)),
    "alibi": (alibi, (C["slopes"],)),
    "t5_astype": (t5_with(lambda x: x.astype(np.int64)), (C["table_t5"],)),
    "t5_int": (t5_with(int), (C["table_t5"],)),
    "t5_np_int64": (t5_with(np.int64), (C["table_t5"],)),
    "t5_floor": (t5_with(math.floor), (C["table_t5"],)),
    "gated": (gated, (C["slopes"],)),
    "mix": (mix, (C["w3"],)),
    "powers": (powers, (C["positive"],)),
    "divide": (divide, (C["positive"],)),
    "no_score": (no_score, (C["w3"], C["doc"])),
    "indices_only": (indices_only, ()),
    "imported": (imported, ()),
    "closure": (make_scaled(20.0), ()),
    "helper": (uses_helper, (C["positive"],)),
    "many": (many, (C["w3"],)),
}


def _points(seed, n=12):
    rng = np.random.default_rng(seed)
    return (rng.normal(scale=2.0, size=n), rng.integers(0, B, n), rng.integers(0, H, n), rng.integers(0, N, n),
            rng.integers(0, N, n), rng.normal(size=n))


def _loss(fn, captures, s, b, h, q, kv, g, keep):
    """``sum g f`` over the kept points, by the Python function."""
    return sum(g[p] * float(fn(s[p], int(b[p]), int(h[p]), int(q[p]), int(kv[p]), *captures)) for p in keep)


def _finite_differences(fn, captures, s, b, h, q, kv, g, keep):
    """``g * df/dscore`` per point and ``d sum(g f)/d capture`` per floating capture, central differences."""
    e = 1e-5 * np.maximum(1.0, np.abs(s))
    ds = np.array([g[p] * (float(fn(s[p] + e[p], int(b[p]), int(h[p]), int(q[p]), int(kv[p]), *captures))
                           - float(fn(s[p] - e[p], int(b[p]), int(h[p]), int(q[p]), int(kv[p]), *captures)))
                   / (2 * e[p]) if p in keep else 0.0 for p in range(len(s))])
    dcaptures = []
    for at, c in enumerate(captures):
        if c.dtype.kind != "f":
            dcaptures.append(None)
            continue
        grad = np.zeros(c.shape)
        for entry in np.ndindex(c.shape):
            step = 1e-5 * max(1.0, abs(float(c[entry])))
            moved = []
            for sign in (1, -1):
                c2 = c.copy()
                c2[entry] += sign * step
                moved.append(_loss(fn, captures[:at] + (c2,) + captures[at + 1:], s, b, h, q, kv, g, keep))
            grad[entry] = (moved[0] - moved[1]) / (2 * step)
        dcaptures.append(grad)
    return ds, dcaptures


@pytest.mark.parametrize("name", sorted(CASES))
def test_vjp_numpy_values_and_finite_differences_agree(name):
    fn, captures = CASES[name]
    python = getattr(fn, "py_func", fn)
    d = differentiate(fn, captures)
    s, b, h, q, kv, g = _points(7)
    value, ds, dcaptures = d.numpy(s, b, h, q, kv, captures, g)
    expected = [float(python(s[p], int(b[p]), int(h[p]), int(q[p]), int(kv[p]), *captures)) for p in range(len(s))]
    np.testing.assert_allclose(value, expected, rtol=1e-13, atol=1e-15)

    dvjp = tuple(np.zeros(c.shape) if c.dtype.kind == "f" else np.zeros(1) for c in captures)
    ds_vjp = [d.vjp(s[p], b[p], h[p], q[p], kv[p], captures, g[p], dvjp) for p in range(len(s))]
    np.testing.assert_allclose(ds_vjp, ds, rtol=1e-12, atol=1e-14)
    for c, from_vjp, from_numpy in zip(captures, dvjp, dcaptures):
        if c.dtype.kind == "f":
            np.testing.assert_allclose(from_vjp, from_numpy, rtol=1e-12, atol=1e-14)
        else:
            assert from_numpy is None and not from_vjp.any()

    keep = {p for p in range(len(s)) if np.isfinite(value[p])}
    assert np.all(ds[[p for p in range(len(s)) if p not in keep]] == 0.0)
    fd_s, fd_captures = _finite_differences(python, captures, s, b, h, q, kv, g, keep)
    np.testing.assert_allclose(ds, fd_s, rtol=1e-6, atol=1e-7)
    for fd, from_numpy in zip(fd_captures, dcaptures):
        if fd is not None:
            np.testing.assert_allclose(from_numpy, fd, rtol=1e-6, atol=1e-7)


def test_known_derivatives_and_conventions():
    w = np.array([0.5, 2.0, 0.0])
    d = differentiate(lambda s, b, h, i, j, w: max(s, w[0]) + np.minimum(w[0], s) + abs(s - w[0]), (w,))
    dw = np.zeros(3)
    assert d.vjp(0.5, 0, 0, 0, 0, (w,), 1.0, (dw,)) == 1.0  # a tie: halves to each side; abs'(0) = 0
    assert dw[0] == 1.0
    _, ds, (dw_numpy,) = d.numpy(np.array([0.5, 1.0]), 0, 0, 0, 0, (w,), 1.0)
    assert ds.tolist() == [1.0, 2.0] and dw_numpy.tolist() == [1.0, 0.0, 0.0]

    d = differentiate(lambda s, b, h, i, j, w: s ** w[1] + math.sqrt(s) + np.clip(s, w[2], w[0]) * 4.0, (w,))
    dw = np.zeros(3)
    assert d.vjp(0.0, 0, 0, 0, 0, (w,), 1.0, (dw,)) == math.inf  # sqrt'(0)
    assert dw.tolist() == [0.0, 0.0, 0.0]  # d/dy x**y at x = 0 is 0; clip at lo: all to x
    dw = np.zeros(3)
    assert d.vjp(0.25, 0, 0, 0, 0, (w,), 1.0, (dw,)) == 2 * 0.25 + 0.5 / 0.5 + 4.0
    assert dw[1] == 0.25 ** 2 * math.log(0.25) and dw[0] == 0.0 and dw[2] == 0.0


def test_the_branch_not_taken_does_not_poison_the_gradient():
    w = np.array([0.0, 2.0])

    def f(score, b, h, q_idx, kv_idx, w):
        return np.where(score < 10.0, 2.0 * score, np.exp(score * 100.0)) + np.where(
            q_idx >= kv_idx, score * w[1], score / w[0] + np.log(w[0]))

    d = differentiate(f, (w,))
    dw = np.zeros(2)
    assert d.vjp(9.0, 0, 0, 3, 1, (w,), 1.0, (dw,)) == 4.0
    assert dw.tolist() == [0.0, 9.0]
    value, ds, (dw_numpy,) = d.numpy(np.array([9.0, 11.0]), 0, 0, 3, 1, (w,), np.array([1.0, 0.0]))
    assert value[0] == 36.0 and value[1] == math.inf
    assert ds.tolist() == [4.0, 0.0] and dw_numpy.tolist() == [0.0, 9.0]


def doc_bias(score, b, h, q_idx, kv_idx, table, doc):
    return np.where(doc[q_idx] == doc[kv_idx], 20.0 * math.tanh((score + table[h, q_idx - kv_idx + N - 1]) / 20.0),
                    -np.inf)


def test_vjp_called_from_njit_over_a_tile():
    captures = (C["table_rel"].astype(np.float32), C["doc"])  # a float32 capture: read as float64
    d = differentiate(doc_bias, captures)
    vjp = d.vjp

    @numba.njit(fastmath=False)
    def tile(scores, b, h, captures, gbar, dcaptures):
        out = np.empty(scores.shape)
        for i in range(scores.shape[0]):
            for j in range(scores.shape[1]):
                out[i, j] = vjp(scores[i, j], b, h, i, j, captures, gbar[i, j], dcaptures)
        return out

    rng = np.random.default_rng(3)
    scores, gbar = rng.normal(size=(N, N)).astype(np.float32), rng.normal(size=(N, N))
    dcaptures = (np.zeros(C["table_rel"].shape), np.zeros(1))
    ds = tile(scores, 1, 1, captures, gbar, dcaptures)
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    _, ds_numpy, (dtable, ddoc) = d.numpy(scores.astype(np.float64), 1, 1, i, j, captures, gbar)
    np.testing.assert_allclose(ds, ds_numpy, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dcaptures[0], dtable, rtol=1e-12, atol=1e-14)
    assert ddoc is None and not dcaptures[1].any() and dtable[0].sum() == 0.0 and dtable[1].any()


def test_derivatives_are_kept_per_function_and_captures():
    table = C["table_rel"]
    assert differentiate(rel_bias, (table,)) is differentiate(rel_bias, (table.copy(),))
    assert differentiate(rel_bias, (table,)) is not differentiate(rel_bias, (table[:, :5],))


def _branches(score, b, h, q_idx, kv_idx):
    if score > 0:
        return score
    return 0.0


@pytest.mark.parametrize("fn, message", [
    (_branches, "numpy.where"),
    (lambda s, b, h, i, j: s if i > j and s < 1 else 0.0, "numpy.where"),
    (lambda s, b, h, i, j: (s, s), "score_mod must return a number"),
    (lambda s, b, h, i, j: None, "score_mod must return a number"),
    (lambda s, b, h, i, j: math.erf(s), "math.erf"),
    (lambda s, b, h, i, j: np.sort(s), "numpy.sort"),
    (lambda s, b, h, i, j, w: s + w, "capture 0 used as a whole"),
    (lambda s, b, h, i, j, w: s + w[0.5], "capture 0 indexed"),
    (lambda s, b, h, i, j, w: s + [1.0, 2.0][h], "index"),
])
def test_unsupported_constructs_are_type_errors_at_trace_time(fn, message):
    with pytest.raises(TypeError, match=r"^score_mod") as caught:
        differentiate(fn, (np.ones(3),) if fn.__code__.co_argcount == 6 else ())
    assert message in str(caught.value)
