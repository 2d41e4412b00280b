"""The allowed errors: the floors, and the naive evaluation in one dtype that sets the float32 rule.

The naive evaluation is the contract's formula written out with whole arrays
in NumPy, every operation in the dtype under test (in float32 for bfloat16
and float16, its inputs and outputs rounded to them); twice its error against
the float64 oracle is the error a kernel is allowed (the FlashAttention rule).
"""

import dataclasses

import numpy as np

from elastic_np import reference
from elastic_np._grads import reduce_to_shape, sum_to_shape
from elastic_np._problem import prepare
from elastic_np._validation import HALF_DTYPES, compute_dtype
from elastic_np.reference import _attention, _backward
from elastic_np.testing._report import _magnitude, worst_error

#: Relative floor of the allowed error, scaled by the largest magnitude of the oracle, by dtype name:
#: for bfloat16 and float16 their machine epsilon (one unit in the last place at that magnitude).
FLOOR = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2.0**-7, "float16": 2.0**-10}
#: Relative tolerance of the oracle's gradients against central differences (the contract).
GRADCHECK_RTOL = 1e-6


def naive_forward(q, k, v, options, dtype):
    """The contract's forward with whole arrays, every operation in ``dtype``.

    For bfloat16 and float16, every operation in float32 (their values are
    exact there); the caller rounds the results (`rounded`).
    Returns ``(out, lse, cache)``; ``cache`` feeds `naive_backward`.
    """
    dtype = compute_dtype(dtype)
    t = dtype.type
    p = prepare(*(np.asarray(a, dtype=dtype) for a in (q, k, v)), dtypes=(dtype,), **options)
    B, H, Hkv, N, M, D, Dv = p.shape
    kk = np.repeat(p.k, p.group_size, axis=1)
    vv = np.repeat(p.v, p.group_size, axis=1)
    # the score modifiers and the keep mask are the oracle's; the product, the
    # gate and the normalisation are the plain forms whose rounding sets the rule
    s, cap_slope = _attention._modify_scores(p, (p.q @ np.swapaxes(kk, -1, -2)) * t(p.scale))
    s, keep = _attention._kept_scores(p, s)
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


def naive_backward(dout, out, lse, cache, dtype, dlse=None):
    """The contract's backward, every operation in ``dtype``; returns a dict of gradients.

    ``dlse``, the cotangent of ``lse`` (None: zeros), enters as ``delta - dlse``.
    """
    dtype = compute_dtype(dtype)
    t = dtype.type
    p, s, keep, probs, kk, vv, gate, cap_slope = cache
    B, H, Hkv, N, M, D, Dv = p.shape
    dout = np.asarray(dout, dtype=dtype)
    tau = p.tau.astype(dtype)[:, None, None]
    dP = dout @ np.swapaxes(vv, -1, -2)
    delta = np.sum(dout * out, axis=-1)
    if dlse is not None:
        delta = delta - np.asarray(dlse, dtype=dtype)
    dz = probs * (dP - delta[..., None])
    ds = dz / tau
    ds_raw = ds if cap_slope is None else ds * cap_slope
    dq = t(p.scale) * (ds_raw @ kk)
    dk = t(p.scale) * (np.swapaxes(ds_raw, -1, -2) @ p.q)
    dk = dk.reshape(B, Hkv, p.group_size, M, D).sum(axis=2)
    dv = (np.swapaxes(probs, -1, -2) @ dout).reshape(B, Hkv, p.group_size, M, Dv).sum(axis=2)
    dtau = -np.sum(np.where(keep, dz * s, t(0)), axis=(0, 2, 3)) / (tau[:, 0, 0] ** 2)
    with np.errstate(over="ignore", invalid="ignore"):
        per_row = np.where((delta == 0) | np.isneginf(lse), t(0), delta * np.exp(-lse))
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
            dlogG = t(p.sharpness) * _attention._log_tanh_slope(y) * f * (x * x / sigma**3 - t(1) / sigma)
            dsigma = np.sum(np.where(keep, dz * dlogG, t(0)), axis=(2, 3))
        grads["dsigma"] = sum_to_shape(dsigma, p.sigma_shape)
    if p.bias is not None:
        grads["dbias"] = reduce_to_shape(ds, p.bias_shape)
    return grads


def rounded(x, dtype):
    """``x`` rounded to ``dtype`` when that is bfloat16 or float16 (as float64); else ``x``."""
    if np.dtype(dtype).name not in HALF_DTYPES:
        return x
    return np.asarray(x).astype(dtype).astype(np.float64)


def naive_orderings(q, k, v, dout, options, dtype, orderings=4, seed=0, dlse=None):
    """`naive_forward` and `naive_backward` in several summation orders.

    An evaluation in float32 has no preferred order of its sums, so the
    baseline of the kernels' float32 rule (`float32_allowed`) is the worst of
    a few equally valid ones: the head dimensions of ``q, k`` (and of ``v,
    dout``) are permuted together, which changes the rounding of every dot
    product and nothing else. The first ordering is the given one.
    ``dlse`` is the cotangent of ``lse``, if any.

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
        grads = naive_backward(np.asarray(dout)[..., pv], out, lse, cache, dtype, dlse)
        ipd, ipv = np.argsort(pd), np.argsort(pv)
        grads.update(dq=grads["dq"][..., ipd], dk=grads["dk"][..., ipd], dv=grads["dv"][..., ipv])
        results.append(dict(grads, out=out[..., ipv], lse=lse))
    return results


def summation_allowance(q, k, v, dout, options, dlse=None):
    """The rounding allowance of the gradients that are one cancelling sum.

    ``dtau``, ``dbeta``, ``dsigma`` and a broadcast ``dbias`` each sum terms
    over many entries (``dz * s / tau**2``, ``delta * exp(-lse)``,
    ``dz * dlogG/dsigma``, ``ds``) that cancel (``sum_j dz_ij = 0`` when
    ``beta = 0``): the rounding of a float32 evaluation of such a sum is of
    the order of ``eps * sum |terms|``, not of the size of the result.
    ``dlse`` is the cotangent of ``lse``, if any (``delta`` is then ``delta - dlse``).

    Returns
    -------
    dict
        ``{name: 2 * eps * max(sum |terms|)}`` for the gradients the options
        produce, ``eps`` float32's.
    """
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    p = prepare(q, k, v, **options)
    out, lse = _attention._forward(p)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        s, keep, gate, _, probs, delta, dz = _backward._score_gradient(
            _attention._without_padding(p), dout, out, lse,
            None if dlse is None else np.asarray(dlse, dtype=np.float64))
        dtau = np.sum(np.abs(_backward._dtau_terms(s, probs, dz)), axis=(0, 2, 3)) / p.tau**2
        dbeta_terms = np.where((delta == 0) | np.isneginf(lse), 0.0, delta * np.exp(-lse))
        dbeta = np.sum(np.abs(dbeta_terms), axis=(0, 2))
        dsigma = None
        if gate is not None:
            dlogg = _backward._dlog_gate(p, *gate)
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
    return min(2.0 * naive_error + rounding, FLOOR["float32"] * scale), naive_error
