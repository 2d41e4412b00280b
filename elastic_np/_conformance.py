"""The conformance battery: cases, tolerances and the report.

Every case draws seeded inputs, evaluates the float64 oracle on them (after
rounding them to the dtype under test, so that only the computation is
measured, not the rounding of the inputs) and compares what the implementation
returns with it. The allowed error follows the FlashAttention rule:

    allowed = max(2 * error of a naive evaluation in the same dtype,
                  floor * max |oracle|)

with ``floor`` 1e-12 for float64 and 1e-5 for float32 (so a float32 error of
0.1% is always caught). The naive evaluation is the contract's formula
written out with whole arrays in NumPy, every operation in the dtype under
test; the oracle is `elastic_np.reference`.
"""

import dataclasses
import inspect

import numpy as np

from elastic_np import reference
from elastic_np._options import DynamicWindow, prepare, reduce_to_shape, sum_to_shape

#: Keyword options of the attention, in the order of the contract.
OPTION_NAMES = (
    "scale", "causal", "window_size", "kv_lengths", "align", "mask", "nvm", "tau", "beta",
    "dynamic_window", "softcap", "alibi_slopes", "bias",
)
#: The score modifiers among them (a case combining them needs all three).
MODIFIER_NAMES = ("softcap", "alibi_slopes", "bias")
#: Capabilities that are not keyword options and are only declared via ``options``:
#: ``"gqa"``: ``k``, ``v`` with fewer heads than ``q`` (grouped-query attention);
#: ``"bottom_right_causal"``: causal with ``N != M``, aligned bottom-right as in
#: the contract (torch's ``is_causal`` is top-left aligned, so it must not declare it).
CAPABILITIES = ("gqa", "bottom_right_causal")

#: Relative floor of the allowed error, scaled by the largest magnitude of the oracle.
FLOOR = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}
#: Relative tolerance of the oracle's gradients against central differences (the contract).
GRADCHECK_RTOL = 1e-6

_GRAD_NAMES = ("dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias")
#: The option each parameter gradient belongs to (checked when the case sets it).
_GRAD_OPTION = {"dtau": "tau", "dbeta": "beta", "dsigma": "dynamic_window", "dbias": "bias"}


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One battery case: a shape and the options it passes.

    ``quick`` and ``full`` are ``(B, H, Hkv, N, M, D, Dv)``; ``requires`` names
    the options and capabilities the implementation must have for the case to
    run; ``make_options(rng, shape)`` returns the keyword options.
    """

    name: str
    requires: frozenset
    quick: tuple
    full: tuple
    make_options: object

    def shape(self, quick):
        return self.quick if quick else self.full


def _sizes(B=2, H=2, Hkv=None, N=11, M=None, D=8, Dv=6, *, full_scale=5):
    """Quick and full shapes: the full one has longer sequences and head dims."""
    Hkv = H if Hkv is None else Hkv
    M = N if M is None else M
    quick = (B, H, Hkv, N, M, D, Dv)
    full = (B, 2 * H, 2 * Hkv, N * full_scale + 2, M * full_scale + 2, 4 * D, 4 * Dv)
    return quick, full


def _mask(rng, shape):
    """Random boolean mask of shape (B, 1, N, M), each row keeping at least one key."""
    B, H, Hkv, N, M, D, Dv = shape
    mask = rng.random((B, 1, N, M)) < 0.7
    mask[:, :, np.arange(N), rng.integers(0, M, size=N)] = True
    return mask


def _window_threshold(sigma, N, M, start=0.1):
    """A threshold for the dynamic window that no bell value comes close to.

    The gate jumps where the bell crosses the threshold; keeping every bell
    value 0.1% away from it means that no rounding flips an entry in or out.
    """
    offset = np.arange(M)[None, :] - np.arange(N)[:, None] - (M - N)
    x = 2.0 * offset / (M - 1) if M > 1 else np.zeros((N, M))
    s = np.asarray(sigma, dtype=np.float64).reshape(-1)[:, None, None]
    f = np.exp(-(x**2) / (2 * s**2)) / (s * np.sqrt(2 * np.pi))
    for t in start * (1 + 0.037 * np.arange(200)):
        if np.min(np.abs(f - t)) > 1e-3 * t:
            return float(t)
    raise RuntimeError("no threshold away from the bell values found")  # pragma: no cover


def _dynamic_window(rng, shape):
    B, H, Hkv, N, M, D, Dv = shape
    sigma = rng.uniform(0.3, 0.8, size=(B, H))
    return DynamicWindow(sigma, sharpness=4.0, threshold=_window_threshold(sigma, N, M))


def _combined(rng, shape):
    B, H, Hkv, N, M, D, Dv = shape
    lengths = np.array([M - 1, M // 2, 0][:B] + [M] * max(B - 3, 0))
    return {
        "scale": 0.4,
        "causal": True,
        "window_size": (M // 2, -1),
        "kv_lengths": lengths,
        "mask": _mask(rng, shape),
        "nvm": True,
        "tau": rng.uniform(0.5, 1.5, size=H),
        "beta": rng.uniform(0.2, 2.0, size=H),
        "dynamic_window": _dynamic_window(rng, shape),
    }


def _slopes(rng, shape):
    """ALiBi slopes of the usual geometric form, ``2^(-8 (h + 1) / H)``."""
    H = shape[1]
    return 2.0 ** (-8.0 * np.arange(1, H + 1) / H)


def _bias(rng, shape, broadcast=(), neg_inf=0.0):
    """A unit-scale bias of shape ``(B, H, N, M)`` with size 1 on the ``broadcast`` axes.

    A fraction ``neg_inf`` of its entries is ``-inf`` (the entry is removed).
    """
    B, H, Hkv, N, M, D, Dv = shape
    full = [B, H, N, M]
    bias_shape = tuple(1 if axis in broadcast else n for axis, n in enumerate(full))
    bias = rng.standard_normal(bias_shape)
    if neg_inf:
        bias[rng.random(bias_shape) < neg_inf] = -np.inf
    return bias


def _modifiers_combined(rng, shape):
    B, H, Hkv, N, M, D, Dv = shape
    return {
        "causal": True,
        "window_size": (M // 2, -1),
        "nvm": True,
        "tau": rng.uniform(0.5, 1.5, size=H),
        "beta": rng.uniform(0.2, 2.0, size=H),
        "softcap": 1.5,
        "alibi_slopes": _slopes(rng, shape),
        "bias": _bias(rng, shape, broadcast=(0,), neg_inf=0.1),
    }


def _case(name, requires, sizes, make_options):
    quick, full = sizes
    return Case(name, frozenset(requires), quick, full, make_options)


CASES = (
    _case("plain", (), _sizes(), lambda rng, s: {}),
    _case("scale", ("scale",), _sizes(), lambda rng, s: {"scale": 0.3}),
    _case("causal", ("causal",), _sizes(), lambda rng, s: {"causal": True}),
    _case("causal N<M", ("causal", "bottom_right_causal"), _sizes(N=5, M=11),
          lambda rng, s: {"causal": True}),
    _case("causal N>M", ("causal", "bottom_right_causal"), _sizes(N=11, M=5),
          lambda rng, s: {"causal": True}),
    _case("window", ("window_size",), _sizes(), lambda rng, s: {"window_size": (3, 2)}),
    _case("kv_lengths", ("kv_lengths",), _sizes(),
          lambda rng, s: {"kv_lengths": np.array([s[4] - 3, s[4] // 2])}),
    _case("empty rows", ("kv_lengths",), _sizes(),
          lambda rng, s: {"kv_lengths": np.array([s[4], 0])}),
    _case("mask", ("mask",), _sizes(), lambda rng, s: {"mask": _mask(rng, s)}),
    _case("nvm", ("nvm",), _sizes(), lambda rng, s: {"nvm": True}),
    _case("tau", ("tau",), _sizes(), lambda rng, s: {"tau": 0.6}),
    _case("beta", ("beta",), _sizes(), lambda rng, s: {"beta": 1.5}),
    _case("tau, beta per head", ("tau", "beta"), _sizes(),
          lambda rng, s: {"tau": rng.uniform(0.5, 1.5, size=s[1]),
                          "beta": rng.uniform(0.2, 2.0, size=s[1])}),
    _case("dynamic window", ("dynamic_window",), _sizes(),
          lambda rng, s: {"dynamic_window": _dynamic_window(rng, s)}),
    _case("gqa", ("gqa",), _sizes(H=4, Hkv=2), lambda rng, s: {}),
    # new queries at the end of each sequence of a ragged cache
    _case("aligned to kv_lengths", ("causal", "window_size", "kv_lengths", "align"),
          _sizes(B=3, N=5, M=11),
          lambda rng, s: {"causal": True, "window_size": (4, -1), "align": "kv_lengths",
                          "kv_lengths": np.array([s[4], s[4] - 4, 3])}),
    _case("combined", set(OPTION_NAMES) - set(MODIFIER_NAMES) - {"align"} | set(CAPABILITIES),
          _sizes(B=3, H=4, Hkv=2, N=7, M=13), _combined),
    _case("softcap", ("softcap",), _sizes(), lambda rng, s: {"softcap": 0.8}),
    _case("alibi", ("alibi_slopes",), _sizes(N=7, M=13),  # N != M: the offset is aligned
          lambda rng, s: {"alibi_slopes": _slopes(rng, s)}),
    _case("softcap + bias", ("softcap", "bias"), _sizes(),  # the cap comes before the bias
          lambda rng, s: {"softcap": 1.2, "bias": 2 * _bias(rng, s)}),
    _case("bias", ("bias",), _sizes(), lambda rng, s: {"bias": _bias(rng, s)}),
    _case("bias (N, M)", ("bias",), _sizes(),
          lambda rng, s: {"bias": _bias(rng, s, broadcast=(0, 1))[0, 0]}),
    _case("bias keys, -inf", ("bias",), _sizes(),
          lambda rng, s: {"bias": _bias(rng, s, broadcast=(1, 2), neg_inf=0.2)}),
    # a per-query bias cancels out of the softmax unless beta > 0 (the sink)
    _case("bias queries", ("bias", "beta"), _sizes(),
          lambda rng, s: {"bias": _bias(rng, s, broadcast=(0, 3)), "beta": 0.7}),
    _case("modifiers combined", ("causal", "window_size", "nvm", "tau", "beta", "gqa",
                                 "bottom_right_causal") + MODIFIER_NAMES,
          _sizes(B=2, H=4, Hkv=2, N=7, M=13), _modifiers_combined),
)


def draw_inputs(case, dtype, *, quick=True, seed=0, margin=1e-5, dims=None):
    """Seeded inputs of ``case``: ``(q, k, v, dout, options)``.

    ``q, k, v, dout`` (and a ``bias`` option) are float64 arrays holding values
    exactly representable in ``dtype``. Under ``nvm``, the inputs are drawn
    again until no final score lies within ``margin`` (relative to the largest
    score) of 0, where NVM jumps.
    ``dims`` overrides ``(D, Dv)``.
    """
    dtype = np.dtype(dtype)
    B, H, Hkv, N, M, D, Dv = case.shape(quick)
    if dims is not None:
        D, Dv = dims
    shape = (B, H, Hkv, N, M, D, Dv)
    for attempt in range(200):
        rng = np.random.default_rng([seed, attempt, len(case.name)])
        q = rng.standard_normal((B, H, N, D)).astype(dtype).astype(np.float64)
        k = rng.standard_normal((B, Hkv, M, D)).astype(dtype).astype(np.float64)
        v = rng.standard_normal((B, Hkv, M, Dv)).astype(dtype).astype(np.float64)
        dout = rng.standard_normal((B, H, N, Dv)).astype(dtype).astype(np.float64)
        options = case.make_options(rng, shape)
        if "bias" in options:
            options["bias"] = options["bias"].astype(dtype).astype(np.float64)
        if not options.get("nvm"):
            return q, k, v, dout, options
        # NVM jumps where the final score (after soft-cap, ALiBi, bias) is 0
        s = np.abs(reference.scores(prepare(q, k, v, **options))[0])
        s = s[np.isfinite(s)]
        if s.size == 0 or np.min(s) > margin * np.max(s):
            return q, k, v, dout, options
    raise RuntimeError(  # pragma: no cover
        f"could not draw inputs away from the NVM jump for case {case.name!r}")


def select_cases(supported):
    """Split `CASES` into those whose requirements ``supported`` covers and the rest."""
    supported = frozenset(supported)
    run = [c for c in CASES if c.requires <= supported]
    skipped = [(c, sorted(c.requires - supported)) for c in CASES if not c.requires <= supported]
    return run, skipped


# ---------------------------------------------------------------------------
# The naive evaluation in one dtype (the baseline of the tolerance)
# ---------------------------------------------------------------------------


def naive_forward(q, k, v, options, dtype):
    """The contract's forward with whole arrays, every operation in ``dtype``.

    Returns ``(out, lse, cache)``; ``cache`` feeds `naive_backward`.
    """
    dtype = np.dtype(dtype)
    t = dtype.type
    p = prepare(*(np.asarray(a, dtype=dtype) for a in (q, k, v)), dtypes=(dtype,), **options)
    B, H, Hkv, N, M, D, Dv = p.shape
    kk = np.repeat(p.k, p.group_size, axis=1)
    vv = np.repeat(p.v, p.group_size, axis=1)
    s = (p.q @ np.swapaxes(kk, -1, -2)) * t(p.scale)
    cap_slope = None
    if p.softcap is not None:
        cap = t(p.softcap)
        x = s / cap
        s = cap * np.tanh(x)
        cap_slope = reference._tanh_slope(x)
    keep = reference.structural_keep(p)
    if p.alibi is not None:
        distance = np.abs(reference._offsets(p)).astype(dtype)
        s = s - p.alibi.astype(dtype)[:, :, None, None] * distance
    if p.bias is not None:
        bias = p.bias.astype(dtype)
        keep = keep & (bias > -np.inf)
        s = np.where(keep, s + bias, t(0))
    if p.nvm:
        keep = keep & (s >= 0)
    tau = p.tau.astype(dtype)[:, None, None]
    z = s / tau
    gate = None
    if p.sigma is not None:
        x = reference.window_position(p).astype(dtype)
        sigma = p.sigma.astype(dtype)[:, :, None, None]
        f = np.exp(-(x * x) / (t(2) * sigma * sigma)) / (sigma * t(np.sqrt(2 * np.pi)))
        G = np.tanh(t(p.sharpness) * np.where(f > t(p.threshold), f, t(0)))
        keep = keep & (G > 0)
        with np.errstate(divide="ignore"):
            z = z + np.log(G)
        gate = (G, f, x, sigma)
    z = np.where(keep, z, t(-np.inf))
    m = np.max(z, axis=-1, keepdims=True, initial=t(-np.inf))  # M = 0 has no entries
    m = np.where(np.isneginf(m), t(0), m)
    e = np.exp(z - m)
    with np.errstate(divide="ignore", over="ignore"):
        l = e.sum(axis=-1, keepdims=True) + np.exp(np.log(p.beta.astype(dtype))[:, None, None] - m)
        lse = (m + np.log(l))[..., 0]
    probs = np.divide(e, l, out=np.zeros_like(e), where=l > 0)
    out = probs @ vv
    return out, lse, (p, s, keep, probs, kk, vv, gate, cap_slope)


def naive_backward(dout, out, lse, cache, dtype):
    """The contract's backward, every operation in ``dtype``; returns a dict of gradients."""
    dtype = np.dtype(dtype)
    t = dtype.type
    p, s, keep, probs, kk, vv, gate, cap_slope = cache
    B, H, Hkv, N, M, D, Dv = p.shape
    dout = np.asarray(dout, dtype=dtype)
    tau = p.tau.astype(dtype)[:, None, None]
    dP = dout @ np.swapaxes(vv, -1, -2)
    delta = np.sum(dout * out, axis=-1)
    dz = probs * (dP - delta[..., None])
    ds = dz / tau
    ds_raw = ds if cap_slope is None else ds * cap_slope
    dq = t(p.scale) * (ds_raw @ kk)
    dk = t(p.scale) * (np.swapaxes(ds_raw, -1, -2) @ p.q)
    dk = dk.reshape(B, Hkv, p.group_size, M, D).sum(axis=2)
    dv = (np.swapaxes(probs, -1, -2) @ dout).reshape(B, Hkv, p.group_size, M, Dv).sum(axis=2)
    dtau = -np.sum(np.where(keep, dz * s, t(0)), axis=(0, 2, 3)) / (tau[:, 0, 0] ** 2)
    with np.errstate(over="ignore", invalid="ignore"):
        per_row = np.where(delta == 0, t(0), delta * np.exp(-lse))
    dbeta = -per_row.sum(axis=(0, 2))
    grads = {
        "dq": dq, "dk": dk, "dv": dv,
        "dtau": sum_to_shape(dtau, p.tau_shape),
        "dbeta": sum_to_shape(dbeta, p.beta_shape),
    }
    if gate is not None:
        G, f, x, sigma = gate
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            y = t(p.sharpness) * np.where(G > 0, f, t(1))
            dlogG = t(p.sharpness) * reference._log_tanh_slope(y) * f * (x * x / sigma**3 - t(1) / sigma)
            dsigma = np.sum(np.where(keep, dz * dlogG, t(0)), axis=(2, 3))
        grads["dsigma"] = sum_to_shape(dsigma, p.sigma_shape)
    if p.bias is not None:
        grads["dbias"] = reduce_to_shape(ds, p.bias_shape)
    return grads


def naive_orderings(q, k, v, dout, options, dtype, orderings=4, seed=0):
    """`naive_forward` and `naive_backward` in several summation orders.

    An evaluation in float32 has no preferred order of its sums, so the
    baseline of the kernels' float32 rule (`float32_allowed`) is the worst of
    a few equally valid ones: the head dimensions of ``q, k`` (and of ``v,
    dout``) are permuted together, which changes the rounding of every dot
    product and nothing else. The first ordering is the given one.

    Returns
    -------
    list of dict
        One per ordering: ``"out"``, ``"lse"`` and the gradients of
        `naive_backward`, in the caller's head-dimension order.
    """
    rng = np.random.default_rng(seed)
    D, Dv = np.shape(q)[-1], np.shape(v)[-1]
    results = []
    for n in range(orderings):
        pd = np.arange(D) if n == 0 else rng.permutation(D)
        pv = np.arange(Dv) if n == 0 else rng.permutation(Dv)
        out, lse, cache = naive_forward(q[..., pd], k[..., pd], v[..., pv], options, dtype)
        grads = naive_backward(np.asarray(dout)[..., pv], out, lse, cache, dtype)
        ipd, ipv = np.argsort(pd), np.argsort(pv)
        grads.update(dq=grads["dq"][..., ipd], dk=grads["dk"][..., ipd], dv=grads["dv"][..., ipv])
        results.append(dict(grads, out=out[..., ipv], lse=lse))
    return results


def summation_allowance(q, k, v, dout, options):
    """The rounding allowance of the gradients that are one cancelling sum.

    ``dtau``, ``dbeta``, ``dsigma`` and a broadcast ``dbias`` each sum terms
    over many entries (``dz * s / tau**2``, ``delta * exp(-lse)``,
    ``dz * dlogG/dsigma``, ``ds``) that cancel (``sum_j dz_ij = 0`` when
    ``beta = 0``): the rounding of a float32 evaluation of such a sum is of
    the order of ``eps * sum |terms|``, not of the size of the result.

    Returns
    -------
    dict
        ``{name: 2 * eps * max(sum |terms|)}`` for the gradients the options
        produce, ``eps`` float32's.
    """
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    p = prepare(q, k, v, **options)
    out, lse = reference._forward(p)
    s, z, keep, gate, _ = reference._attention_logits(p)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        probs = np.where(keep, np.exp(z - lse[..., None]), 0.0)
        v_h = np.repeat(p.v, p.group_size, axis=1)
        delta = np.sum(dout * out, axis=-1)
        dz = probs * (dout @ np.swapaxes(v_h, -1, -2) - delta[..., None])
        dtau = np.sum(np.abs(np.where(keep, dz * s, 0.0)), axis=(0, 2, 3)) / p.tau**2
        dbeta = np.sum(np.abs(np.where(delta == 0, 0.0, delta * np.exp(-lse))), axis=(0, 2))
        dsigma = None
        if gate is not None:
            G, f, x = gate
            sigma = p.sigma[:, :, None, None]
            y = p.sharpness * np.where(G > 0, f, 1.0)
            dlogg = p.sharpness * reference._log_tanh_slope(y) * f * (x**2 / sigma**3 - 1 / sigma)
            dsigma = np.sum(np.abs(np.where(keep, dz * dlogg, 0.0)), axis=(2, 3))
    bounds = dataclasses.replace(p, bias=None).reduce_grads(None, None, None, dtau, dbeta, dsigma)
    eps = float(np.finfo(np.float32).eps)
    allowance = {
        name: 2 * eps * float(np.max(getattr(bounds, name)))
        for name in ("dtau", "dbeta", "dsigma")
        if getattr(bounds, name) is not None
    }
    if p.bias is not None:
        terms = reduce_to_shape(np.abs(dz / p.tau[:, None, None]), p.bias_shape)
        allowance["dbias"] = 2 * eps * float(np.max(terms, initial=0.0))
    return allowance


def float32_allowed(want, naive, rounding=None):
    """The float32 rule of the kernel tests: the error allowed against the oracle.

    ``min(2 * naive_error + rounding, 1e-5 * scale)`` with ``scale = max(1,
    max |want|)``, where ``naive_error`` is the worst error of ``naive``, the
    same quantity from each ordering of `naive_orderings`: twice a naive
    float32 evaluation's error (FlashAttention's rule), an allowance for
    rounding the result itself, and never more than the contract's ``1e-5``.

    Parameters
    ----------
    want : array_like
        The float64 oracle's value.
    naive : list of array_like
        The naive evaluations' values.
    rounding : float, optional
        Default one float32 ulp of ``scale``; `summation_allowance` gives the
        one of the gradients that are a cancelling sum.

    Returns
    -------
    allowed, naive_error : float
    """
    scale = max(1.0, _magnitude(want))
    naive_error = max(worst_error(n, want)[0] for n in naive)
    if rounding is None:
        rounding = float(np.finfo(np.float32).eps) * scale
    return min(2.0 * naive_error + rounding, FLOOR[np.dtype(np.float32)] * scale), naive_error


# ---------------------------------------------------------------------------
# Errors and the report
# ---------------------------------------------------------------------------


def worst_error(got, want):
    """Largest absolute difference; infinite for NaN, a wrong shape or mismatched infinities."""
    want = np.asarray(want, dtype=np.float64)
    try:
        got = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        return np.inf, f"not an array of numbers: {type(got).__name__}"
    if got.shape != want.shape:
        return np.inf, f"shape {got.shape}, expected {want.shape}"
    if np.isnan(got).any():
        return np.inf, "NaN in result"
    finite = np.isfinite(want)
    if (got[~finite] != want[~finite]).any() or not np.isfinite(got[finite]).all():
        return np.inf, "infinities differ from the oracle's"
    if not finite.any():
        return 0.0, ""
    return float(np.max(np.abs(got[finite] - want[finite]))), ""


def _magnitude(want):
    want = np.asarray(want, dtype=np.float64)
    finite = want[np.isfinite(want)]
    return float(np.max(np.abs(finite))) if finite.size else 0.0


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of a report: a quantity of one case in one dtype."""

    case: str
    dtype: str
    quantity: str
    error: float
    allowed: float
    passed: bool
    note: str = ""
    baseline: float = float("nan")  # error of the naive evaluation in the same dtype


@dataclasses.dataclass
class ConformanceReport:
    """The result of a conformance run: true when every row passed.

    Attributes
    ----------
    title : str
        What was checked.
    rows : list of Row
        One per case, dtype and quantity compared.
    skipped : list of (str, list of str)
        Cases not run and the options or capabilities they needed.
    """

    title: str
    rows: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)

    def __bool__(self):
        return bool(self.rows) and all(r.passed for r in self.rows)

    @property
    def failures(self):
        """The rows that failed."""
        return [r for r in self.rows if not r.passed]

    @property
    def failed_cases(self):
        """Names of the cases with at least one failed row."""
        return sorted({r.case for r in self.failures})

    def __str__(self):
        width = max([len(r.case) for r in self.rows] + [4])
        lines = [self.title,
                 f"  {'case':<{width}}  {'dtype':<7}  {'quantity':<8}  {'worst error':>11}  "
                 f"{'allowed':>9}  result"]
        for r in self.rows:
            lines.append(
                f"  {r.case:<{width}}  {r.dtype:<7}  {r.quantity:<8}  {r.error:>11.2e}  "
                f"{r.allowed:>9.2e}  {'pass' if r.passed else 'FAIL'}"
                + (f"  ({r.note})" if r.note else "")
            )
        if not self.rows:
            lines.append("  (nothing was run)")
        passed = sum(r.passed for r in self.rows)
        lines.append(f"  {passed}/{len(self.rows)} passed")
        if self.skipped:
            lines.append("  skipped: " + "; ".join(
                f"{name} (needs {', '.join(needs)})" for name, needs in self.skipped))
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Running an implementation through the battery
# ---------------------------------------------------------------------------


def supported_options(fn, options=None):
    """Option and capability names ``fn`` takes: its keyword parameters plus ``options``."""
    known = set(OPTION_NAMES) | set(CAPABILITIES)
    declared = set(options or ())
    unknown = declared - known
    if unknown:
        raise ValueError(
            f"`options` names unknown options {sorted(unknown)}; known: {sorted(known)}"
        )
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    from_signature = {
        name for name, param in params.items()
        if name in OPTION_NAMES and param.kind is not inspect.Parameter.VAR_KEYWORD
    }
    return from_signature | declared


def _unpack_forward(result):
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise TypeError(
                f"fn returned a sequence of {len(result)} items; expected out or (out, lse)")
        return result[0], result[1]
    return result, None


def _unpack_backward(result):
    if isinstance(result, dict):
        return {name: result.get(name) for name in _GRAD_NAMES}
    if isinstance(result, (tuple, list)):
        if not 3 <= len(result) <= 6:
            raise TypeError(
                f"backward returned {len(result)} items; expected 3 to 6 (dq, dk, dv, ...)")
        return dict(zip(_GRAD_NAMES, result))
    return {name: getattr(result, name, None) for name in _GRAD_NAMES}


def _compare(report, case, dtype, quantity, got, want, naive):
    error, note = worst_error(got, want)
    naive_error, _ = worst_error(naive, want)
    allowed = max(2.0 * naive_error, FLOOR[np.dtype(dtype)] * _magnitude(want))
    report.rows.append(Row(case, np.dtype(dtype).name, quantity, error, allowed,
                           bool(error <= allowed), note, naive_error))


def _fail(report, case, dtype, quantity, exc):
    message = f"raised {type(exc).__name__}: {exc}".splitlines()[0][:100]
    report.rows.append(Row(case, np.dtype(dtype).name, quantity, np.inf, np.nan, False, message))


def run_battery(fn, *, backward=None, supported=(), dtypes=(np.float32, np.float64),
                quick=True, seed=0, title="conformance", progress=None):
    """Run every case ``supported`` covers through ``fn`` (and ``backward``).

    See `elastic_np.testing.check_attention` for the calling conventions.
    ``progress`` is called as ``progress(step_label)`` after each case and dtype.
    """
    dtypes = [np.dtype(d) for d in dtypes]
    for d in dtypes:
        if d not in FLOOR:
            raise ValueError(f"`dtypes` may hold float32 and float64, got {d}")
    cases, skipped = select_cases(supported)
    report = ConformanceReport(title=title, skipped=[(c.name, needs) for c, needs in skipped])
    for case in cases:
        for dtype in dtypes:
            _run_case(report, case, dtype, fn, backward, quick, seed)
            if progress is not None:
                progress(f"{case.name} {dtype.name}")
    return report


def _run_case(report, case, dtype, fn, backward, quick, seed):
    q, k, v, dout, options = draw_inputs(case, dtype, quick=quick, seed=seed)
    out_ref, lse_ref = reference.attention(q, k, v, **options)
    out_naive, lse_naive, cache = naive_forward(q, k, v, options, dtype)
    args = [np.array(a, dtype=dtype) for a in (q, k, v)]
    if "bias" in options:  # the implementation gets the bias in the dtype under test
        options = dict(options, bias=options["bias"].astype(dtype))
    try:
        out, lse = _unpack_forward(fn(*args, **options))
    except Exception as exc:  # the implementation under test failed: report, go on
        _fail(report, case.name, dtype, "out", exc)
        return
    _compare(report, case.name, dtype, "out", out, out_ref, out_naive)
    if lse is not None:
        _compare(report, case.name, dtype, "lse", lse, lse_ref, lse_naive)
    if backward is None:
        return
    with np.errstate(invalid="ignore", divide="ignore"):  # inf * 0 off the band; masked out
        grads_ref = reference.attention_backward(dout, q, k, v, out_ref, lse_ref, **options)
    grads_naive = naive_backward(dout, out_naive, lse_naive, cache, dtype)
    try:
        grads = _unpack_backward(backward(np.array(dout, dtype=dtype), *args, **options))
    except Exception as exc:
        _fail(report, case.name, dtype, "grads", exc)
        return
    for name in _GRAD_NAMES:
        want = getattr(grads_ref, name)
        if name in ("dq", "dk", "dv"):
            got = grads[name]
        else:
            # tau, beta, sigma, bias gradients: checked when the case sets the
            # option and the implementation returns them.
            got = grads.get(name)
            if _GRAD_OPTION[name] not in options or got is None:
                continue
        _compare(report, case.name, dtype, name, got, want, grads_naive[name])


# ---------------------------------------------------------------------------
# The oracles' own gradients
# ---------------------------------------------------------------------------


def check_oracle_gradients(*, quick=True, seed=0, progress=None):
    """`elastic_np.reference.attention_backward` against central differences, every case.

    Runs in float64 with head dims 4 and 3 (every element of every input is
    perturbed twice); inputs are drawn away from the NVM jump and the window
    threshold. Returns a `ConformanceReport`.
    """
    from elastic_np.testing import gradcheck

    report = ConformanceReport(title="float64 oracle gradients vs central differences")
    for case in CASES:
        q, k, v, dout, options = draw_inputs(case, np.float64, quick=True, seed=seed,
                                             margin=1e-3, dims=(4, 3))
        out, lse = reference.attention(q, k, v, **options)
        with np.errstate(invalid="ignore", divide="ignore"):
            grads = reference.attention_backward(dout, q, k, v, out, lse, **options)
        learnable = ("tau", "beta", "dynamic_window", "bias")
        fixed = {n: options[n] for n in options if n not in learnable}
        window = options.get("dynamic_window")
        inputs = {"q": q, "k": k, "v": v}
        claimed = {"dq": grads.dq, "dk": grads.dk, "dv": grads.dv}
        for name, grad in (("tau", grads.dtau), ("beta", grads.dbeta), ("bias", grads.dbias)):
            if name in options:
                inputs[name] = options[name]
                claimed["d" + name] = grad
        if window is not None:
            inputs["sigma"] = np.array(window.sigma)
            claimed["dsigma"] = grads.dsigma
        # -inf bias entries stay -inf: they are removed, and their gradient is 0
        removed = np.isneginf(options["bias"]) if "bias" in options else False
        if "bias" in options:
            inputs["bias"] = np.where(removed, 0.0, options["bias"])

        def loss_fn(q, k, v, tau=1.0, beta=0.0, sigma=None, bias=None):
            dw = None if sigma is None else DynamicWindow(
                sigma, sharpness=window.sharpness, threshold=window.threshold)
            if bias is not None:
                bias = np.where(removed, -np.inf, bias)
            return reference.attention(q, k, v, tau=tau, beta=beta, dynamic_window=dw,
                                       bias=bias, **fixed)[0]

        result = gradcheck(
            loss_fn, inputs, {name[1:]: g for name, g in claimed.items()},
            dout=dout, rtol=GRADCHECK_RTOL, raise_on_failure=False,
        )
        for entry in result.entries:
            report.rows.append(Row(case.name, "float64", "d" + entry.name, entry.error,
                                   GRADCHECK_RTOL, entry.passed, "relative"))
        if progress is not None:
            progress(case.name)
    return report
