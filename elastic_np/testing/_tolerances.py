"""The allowed errors: the floors, and the naive evaluation in one dtype that sets the float32 rule.

The naive evaluation is the contract's formula written out with whole arrays
in NumPy, every operation in the dtype under test (in float32 for bfloat16
and float16, its inputs and outputs rounded to them); twice its error against
the float64 oracle is the error a kernel is allowed (the FlashAttention rule).
"""

import dataclasses
import math

import numpy as np

from elastic_np import reference
from elastic_np._contract._grads import direction, reduce_to_shape, sum_to_shape
from elastic_np._contract._problem import prepare
from elastic_np._contract._validation import HALF_DTYPES, compute_dtype
from elastic_np.reference._variant import has_score, modified_scores
from elastic_np.reference._variant import score_gradient as variant_gradient
from elastic_np.reference._attention import (
    kept_scores, log_tanh_elasticity, modify_scores, scores, window_gate, with_variant, without_padding,
)
from elastic_np.reference._backend import double_backward as oracle_double_backward
from elastic_np.reference._backend import forward as oracle_forward
from elastic_np.reference._backward import dlog_gate, dtau_terms, score_gradient
from elastic_np.reference._double_backward import d2log_gate, tangent_terms
from elastic_np.testing._cases import variant_arguments
from elastic_np.testing._report import _magnitude, worst_error

#: Relative floor of the allowed error, scaled by the largest magnitude of the oracle, by dtype name:
#: for bfloat16 and float16 their machine epsilon (one unit in the last place at that magnitude).
FLOOR = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2.0**-7, "float16": 2.0**-10}
#: The results in the inputs' dtype (for halves ``lse`` is float32, the parameters' gradients float64).
ROUNDED = ("dq", "dk", "dv", "dbias")
#: Relative tolerance of the oracle's gradients against central differences (the contract).
GRADCHECK_RTOL = 1e-6


def naive_forward(q, k, v, options, dtype):
    """The contract's forward with whole arrays, every operation in ``dtype``.

    The normalisation is the softmax of each row's logits and the sink's
    logit ``log beta`` (taken in float64 and rounded to ``dtype``, as the
    kernels take it: a ``beta`` of ``1e-50``, a tiny sink the contract
    accepts, is 0 in float32, its logit is not), stable: the exponentials
    are taken relative to the largest of them all, ``log beta`` included (a
    row whose logits all lie far below ``log beta`` would otherwise overflow
    ``exp(log beta - m)`` and give ``lse = inf`` where the oracle's is
    ``log beta``). The dynamic window's gate is `_naive_gate`'s. For
    bfloat16 and float16, every operation in float32 (their values are
    exact there); the caller rounds the results (`rounded`).
    Returns ``(out, lse, cache)``; ``cache`` feeds `naive_backward`.
    """
    dtype = compute_dtype(dtype)
    t = dtype.type
    p = _prepared(options, *(np.asarray(a, dtype=dtype) for a in (q, k, v)), dtypes=(dtype,))
    B, H, Hkv, N, M, D, Dv = p.shape
    kk = np.repeat(p.k, p.group_size, axis=1)
    vv = np.repeat(p.v, p.group_size, axis=1)
    # the score modifiers, a user's score_mod (called on scalars of dtype) and the keep mask are the oracle's;
    # the product, the gate and the normalisation are the plain forms whose rounding sets the rule
    s, cap_slope = modify_scores(p, (p.q @ np.swapaxes(kk, -1, -2)) * t(p.scale))
    s_before = s
    if has_score(p):
        s = modified_scores(p, s)
    s, keep = kept_scores(p, s)
    tau = p.tau.astype(dtype)[:, None, None]
    z = s / tau
    gate = None
    if p.sigma is not None:
        is_open, log_gate, gate = _naive_gate(p, dtype)
        keep = keep & is_open
        z = z + log_gate
    z = np.where(keep, z, t(-np.inf))
    with np.errstate(divide="ignore"):  # the sink's logit, rounded to dtype (beta may not fit); -inf without one
        log_beta = np.log(np.asarray(p.beta, dtype=np.float64)).astype(dtype)[:, None, None]
    # the row's maximum over the sink's logit too, as softmax over [z, log beta]
    # takes it: a row whose logits all lie far below log beta would overflow exp(log beta - m)
    m = np.maximum(np.max(z, axis=-1, keepdims=True, initial=t(-np.inf)), log_beta)  # M = 0 has no entries
    m = np.where(np.isneginf(m), t(0), m)
    e = np.exp(z - m)
    with np.errstate(divide="ignore"):
        l = e.sum(axis=-1, keepdims=True) + np.exp(log_beta - m)
        lse = (m + np.log(l))[..., 0]
    probs = np.divide(e, l, out=np.zeros_like(e), where=l > 0)
    out = probs @ vv
    return out, lse, (p, s, z, keep, kk, vv, gate, cap_slope, s_before)


def _prepared(options, q, k, v, **kwargs):
    """The problem of ``q, k, v`` and ``options``, a user's variant among them (`VARIANT_NAMES`)."""
    fixed, given = variant_arguments(options)
    return with_variant(prepare(q, k, v, **kwargs, **fixed), given.get("score_mod"), given.get("mask_mod"),
                        given.get("block_mask"), given.get("captures", ()))


def _naive_gate(p, dtype):
    """The dynamic window's gate in ``dtype``: ``(open, log G, (f, x, sigma))``, each ``(B, H, N, M)`` or broadcast.

    Which gates are open is the oracle's
    (`elastic_np.reference._attention.window_gate`), as the keep mask is: it
    is the problem's structure, which the kernels decide in float64 too,
    not a rounding. ``log G`` is the plain form, ``log tanh(sharpness f)``
    of the bell ``f = exp(-x^2 / (2 sigma^2)) / (sigma sqrt(2 pi))``,
    wherever its ``exp`` and ``y = sharpness f`` are normal numbers of
    ``dtype``. Below (a narrow window, a row far from its keys: ``f`` under
    ``1e-38`` in float32, where the oracle's float64 ``f`` reaches
    ``1e-308``) ``G`` rounds to few bits or to 0, and a row could lose
    every key the oracle keeps (``lse = -inf`` where the oracle's is
    finite). There ``log G = log(sharpness) + log f``, ``log f = -x^2 / (2
    sigma^2) - log(sigma sqrt(2 pi))`` in ``dtype`` (``tanh y = y`` to
    within ``y^2 / 3`` relative).
    """
    t = dtype.type
    is_open = window_gate(dataclasses.replace(p, q=p.q.astype(np.float64)))[0] > 0
    x = reference.window_position(p).astype(dtype)
    sigma = p.sigma.astype(dtype)[:, :, None, None]
    exponent = -(x * x) / (t(2) * sigma * sigma)
    bell = np.exp(exponent)
    f = bell / (sigma * t(np.sqrt(2 * np.pi)))
    y = t(p.sharpness) * np.where(is_open, f, t(0))
    plain = (bell >= np.finfo(dtype).tiny) & (y >= np.finfo(dtype).tiny)
    with np.errstate(divide="ignore"):
        log_f = exponent - np.log(sigma * t(np.sqrt(2 * np.pi)))
        log_gate = np.where(plain, np.log(np.tanh(y)), np.log(t(p.sharpness)) + log_f)
    return is_open, np.where(is_open, log_gate, t(-np.inf)), (f, x, sigma)


def naive_backward(dout, out, lse, cache, dtype, dlse=None):
    """The contract's backward, every operation in ``dtype``; returns a dict of gradients.

    Like the oracle and every fused kernel, it takes the probabilities from
    ``lse`` in ``dtype`` (``exp(z - lse)``), the backward's input, not from
    the forward's own: at large ``|lse|`` the rounding of a float32 ``lse``
    moves every probability of its row by as much relative to itself.
    ``dlse``, the cotangent of ``lse`` (None: zeros), enters as ``delta - dlse``.
    """
    dtype = compute_dtype(dtype)
    t = dtype.type
    p, s, z, keep, kk, vv, gate, cap_slope, s_before = cache
    with np.errstate(invalid="ignore", over="ignore"):
        probs = np.where(keep, np.exp(z - np.asarray(lse, dtype=dtype)[..., None]), t(0))
    B, H, Hkv, N, M, D, Dv = p.shape
    dout = np.asarray(dout, dtype=dtype)
    tau = p.tau.astype(dtype)[:, None, None]
    dP = dout @ np.swapaxes(vv, -1, -2)
    delta = np.sum(dout * out, axis=-1)
    if dlse is not None:
        delta = delta - np.asarray(dlse, dtype=dtype)
    dz = probs * (dP - delta[..., None])
    ds = dz / tau
    dcaptures = None
    if has_score(p):  # through score_mod (its exact derivative, as the oracle takes it)
        ds, dcaptures = variant_gradient(p, s_before, ds)
    ds_raw = ds if cap_slope is None else ds * cap_slope
    dq = t(p.scale) * (ds_raw @ kk)
    dk = t(p.scale) * (np.swapaxes(ds_raw, -1, -2) @ p.q)
    dk = dk.reshape(B, Hkv, p.group_size, M, D).sum(axis=2)
    dv = (np.swapaxes(probs, -1, -2) @ dout).reshape(B, Hkv, p.group_size, M, Dv).sum(axis=2)
    dtau = -np.sum(np.where(keep, dz * s, t(0)), axis=(0, 2, 3)) / (tau[:, 0, 0] ** 2)
    grads = {
        "dq": dq, "dk": dk, "dv": dv,
        "dtau": sum_to_shape(dtau, p.tau_shape),
        "dbeta": naive_sink_gradient(delta, np.asarray(lse, dtype=dtype), p.beta_shape),
    }
    if gate is not None:
        f, x, sigma = gate
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            y = t(p.sharpness) * f  # 0 where f underflowed (`_naive_gate`): there tanh y = y, elasticity 1
            elasticity = np.where(y > 0, log_tanh_elasticity(np.where(y > 0, y, t(1))), t(1))
            dlogG = elasticity * (x * x / sigma**3 - t(1) / sigma)
            dsigma = np.sum(np.where(keep, dz * dlogG, t(0)), axis=(2, 3))
        grads["dsigma"] = sum_to_shape(dsigma, p.sigma_shape)
    if p.bias is not None:
        grads["dbias"] = reduce_to_shape(ds, p.bias_shape)
    if dcaptures is not None:
        grads["dcaptures"] = dcaptures
    return grads


def naive_sink_gradient(delta, lse, beta_shape):
    """``dbeta = -sum_{b,i} delta_i exp(-lse_i)``, every term in the dtype of ``delta`` and ``lse``.

    The plain sum, its terms and their sum over the rows in that dtype (the
    heads of a shared ``beta`` then added in float64, as
    `elastic_np._contract._grads.sum_to_shape` does), wherever it is finite. Where it is not (``exp(-lse)`` overflows float32 for ``lse``
    below -88.7: rows whose logits all lie far below zero, with no sink or a
    tiny one), the true ``dbeta`` may lie outside float32's range, and the
    kernels return it in float64 (`elastic_np._contract._grads.sink_gradient`). There
    the same sum is taken with every term scaled by ``exp(-top)`` in that
    dtype, ``top`` the largest ``-lse_i`` of the rows that count (per head,
    or over every head for a shared ``beta``, as the oracle does), and the
    factor restored in float64: the dtype's rounding of every term, relative
    to itself, without the limit of its exponent range, which is no part of
    its precision. Either way a row with ``delta = 0`` or ``lse = -inf``
    adds nothing.
    """
    t = delta.dtype.type
    live = (delta != 0) & ~np.isneginf(lse)
    with np.errstate(over="ignore", invalid="ignore"):
        plain = sum_to_shape(-np.where(live, delta * np.exp(-lse), t(0)).sum(axis=(0, 2)), beta_shape)
    if np.isfinite(plain).all():
        return plain
    axes = (0, 2) if math.prod(beta_shape) > 1 else (0, 1, 2)
    top = np.max(np.where(live, -lse, t(-np.inf)), axis=axes, keepdims=True, initial=t(-np.inf))
    top = np.where(np.isneginf(top), t(0), top)  # 0 where no row counts
    scaled = np.asarray(sum_to_shape(-np.where(live, delta * np.exp(-lse - top), t(0)).sum(axis=(0, 2)), beta_shape))
    with np.errstate(over="ignore"):
        restored = np.where(scaled == 0, 0.0, scaled * np.exp(top.astype(np.float64)).reshape(scaled.shape))
    result = np.where(np.isfinite(plain), plain, restored)
    return float(result) if beta_shape == () else result

def rounded(x, dtype):
    """``x`` rounded to ``dtype`` when that is bfloat16 or float16 (as float64); else ``x``."""
    if np.dtype(dtype).name not in HALF_DTYPES:
        return x
    return np.asarray(x).astype(dtype).astype(np.float64)


def naive_orderings(q, k, v, dout, options, dtype, orderings=4, seed=0, dlse=None, backward=True):
    """`naive_forward` and `naive_backward` in several summation orders.

    An evaluation in float32 has no preferred order of its sums, so the
    baseline of the kernels' float32 rule (`float32_allowed`) is the worst of
    a few equally valid ones: the head dimensions of ``q, k`` (and of ``v,
    dout``) are permuted together, which changes the rounding of every dot
    product and nothing else. The first ordering is the given one.
    ``dlse`` is the cotangent of ``lse``, if any; without ``backward`` the
    gradients are left out.

    Returns
    -------
    list of dict
        One per ordering: ``"out"``, ``"lse"`` and the gradients of
        `naive_backward`, in the caller's head-dimension order; for bfloat16
        and float16, ``out`` and the gradients in their dtype are `rounded`.
    """
    rng = np.random.default_rng(seed)
    D, Dv = np.shape(q)[-1], np.shape(v)[-1]
    results = []
    for n in range(orderings):
        pd = np.arange(D) if n == 0 else rng.permutation(D)
        pv = np.arange(Dv) if n == 0 else rng.permutation(Dv)
        out, lse, cache = naive_forward(q[..., pd], k[..., pd], v[..., pv], options, dtype)
        out = rounded(out, dtype)
        ipd, ipv = np.argsort(pd), np.argsort(pv)
        grads = {}
        if backward:
            grads = naive_backward(np.asarray(dout)[..., pv], out, lse, cache, dtype, dlse)
            grads.update(dq=grads["dq"][..., ipd], dk=grads["dk"][..., ipd], dv=grads["dv"][..., ipv])
            grads.update({name: rounded(grads[name], dtype) for name in ROUNDED if name in grads})
        results.append(dict(grads, out=out[..., ipv], lse=lse))
    return results


def _logit_condition(p, s, probs, lse, cap_slope=None):
    """``1 + max(|z_ij|, |lse_i|)`` per row: the factor the logits' rounding puts on every term of the row.

    ``|z_ij|`` is the magnitude a logit is computed from: its own, or its
    product's terms', ``|scale| sum_d |q_id k_jd| / tau`` (times the
    soft-cap's slope ``1 - tanh^2``, given as ``cap_slope``), when that is
    larger. A sum is rounded at the magnitude of its terms, not of its
    value: a product that cancels (``|q . k|`` far below ``sum |q_d k_d|``)
    is off by up to ``eps sum |q_d k_d|`` in any order, which the four
    orders of `naive_orderings` sample poorly (NumPy's products sum in
    blocks, a tiled kernel otherwise: on a product of 12 from terms of 900
    the CPU kernel's was off by 1.4e-4, NumPy's by 2e-6 to 3e-5).
    """
    products = _products(p)[1]
    if cap_slope is not None:
        products = products * cap_slope
    z = np.maximum(np.abs(s), products) / p.tau[:, None, None]
    z = np.where(probs > 0, z, 0.0).max(axis=-1, initial=0.0)
    return 1.0 + np.maximum(z, np.where(np.isfinite(lse), np.abs(lse), 0.0))


def _products(p):
    """``(scale q . k, |scale| sum_d |q_d k_d|)``, ``(B, H, N, M)``: the raw scores and their terms' magnitudes."""
    k = np.repeat(p.k, p.group_size, axis=1)
    raw = p.scale * (p.q @ np.swapaxes(k, -1, -2))
    return raw, abs(p.scale) * (np.abs(p.q) @ np.swapaxes(np.abs(k), -1, -2))


def _slope_condition(p):
    """``2 |tanh(x)| max(|x|, |scale| sum_d |q_d k_d| / softcap)``, ``x = scale q . k / softcap``: the soft-cap's slope's factor.

    The slope ``1 - tanh(x)^2`` moves by ``2 |tanh(x)| |dx|`` relative to
    itself, and ``x`` is off by ``eps`` times the magnitude it is computed
    from (`_logit_condition`): once the cap saturates (``|x|`` of 10 to 40,
    where the slope is ``4 exp(-2 |x|)``, tiny but not 0 in float32) the
    slope, and every gradient through it, is off by ``eps`` times ``2 |x|``
    relative to itself.
    """
    raw, products = _products(p)
    x = raw / p.softcap
    return 2 * np.abs(np.tanh(x)) * np.maximum(np.abs(x), products / p.softcap)


def _delta_magnitude(dout, out, dlse):
    """``sum |dout * out| + |dlse|`` per row: the magnitude of ``delta``'s terms."""
    return np.sum(np.abs(dout * out), axis=-1) + (0.0 if dlse is None else np.abs(dlse))


def _sink_allowance(p, delta, delta_mag, lse, cond, dtype):
    """``2 eps sum_{b,i} |delta_i| cond_i exp(-lse_i)``, the largest over ``dbeta``'s entries: its rounding allowance.

    Summed in the exponent (a log-sum-exp over the rows of each head, and
    over the heads of a shared ``beta``), so that a ``dbeta`` near float64's
    largest number, whose terms' magnitudes with their factors overflow it,
    still gets its allowance. An entry whose ``dbeta`` overflows float64 in
    the oracle gets none: the kit compares its infinity exactly
    (`worst_error`), and it must not make the others' allowance infinite.
    """
    eps = float(np.finfo(compute_dtype(dtype)).eps)
    live = (delta != 0) & ~np.isneginf(lse)
    log_terms = np.where(live, np.log(delta_mag * cond) - lse, -np.inf)
    log_sums = np.logaddexp.reduce(log_terms, axis=(0, 2) if math.prod(p.beta_shape) > 1 else (0, 1, 2))
    oracle = np.reshape(p.sink_gradient(delta, lse), np.shape(log_sums))
    log_bound = np.max(np.where(np.isfinite(oracle), log_sums, -np.inf), initial=-np.inf)
    return float(np.minimum(np.exp(np.log(2 * eps) + log_bound), np.finfo(np.float64).max))


def _allowances(terms, dtype):
    """``{name: 2 * eps * max(terms)}`` for the terms that are not None, ``eps`` that of ``dtype``'s computation."""
    eps = float(np.finfo(compute_dtype(dtype)).eps)
    return {name: 2 * eps * float(np.max(t, initial=0.0)) for name, t in terms.items() if t is not None}


def rounding_allowance(q, k, v, dout, options, dlse=None, dtype=np.float32):
    """The rounding allowance of each quantity, beyond twice the naive evaluation's error.

    The effects no reordering of a naive evaluation samples, each given
    ``2 eps`` times the sum of the magnitudes of the terms it scales:

    - **the logits' rounding.** A logit ``z`` computed in float32 is off by
      ``eps`` times the magnitude it is computed from, its own ``|z|`` or
      its product's terms' (`_logit_condition`), which moves ``p = exp(z -
      lse)`` by as much relative to itself, and ``lse`` is rounded at its
      own magnitude: every term of row ``i`` carries a factor ``1 +
      max(|z_ij|, |lse_i|)``. At unit scale this is below the float32
      floor; with logits in the hundreds (``tau = 0.03``, ALiBi over long
      offsets) or products that cancel it is what float32 can resolve.
    - **cancelling sums.** ``dtau``, ``dbeta``, ``dsigma`` and a broadcast
      ``dbias`` sum terms that cancel (``sum_j dz_ij = 0`` when ``beta =
      0``), and every gradient of the logits is a difference, ``dz = p (dP -
      delta)`` of dot products, which ``dq``, ``dk`` and ``dbias`` carry:
      ``|dz|`` is taken as ``p (|dP| + |delta|)``, ``|delta|`` as ``sum
      |dout * out| + |dlse|`` (a single key gives ``dz = 0`` and ``dq = 0``
      exactly, and every float32 evaluation a rounding of ``dP - delta``).
    - **the soft-cap's slope.** ``dq`` and ``dk`` carry ``1 - tanh(x)^2``,
      which moves by ``2 |tanh(x)|`` times the error of ``x``, relative to
      itself (`_slope_condition`): large once the cap saturates.

    ``dbeta``'s terms are summed in the exponent (`_sink_allowance`).
    ``dlse`` is the cotangent of ``lse``, if any (``delta`` is then ``delta - dlse``).

    Returns
    -------
    dict
        ``{name: 2 * eps * max(sum |terms|)}`` for ``out``, ``lse`` and the
        gradients the options produce, ``eps`` that of the dtype ``dtype``
        computes in (float32's for float32, bfloat16 and float16).
    """
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    p = _prepared(options, q, k, v)
    B, H, Hkv, N, M, D, Dv = p.shape
    out, lse = oracle_forward(p)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        s, keep, gate, cap_slope, probs, delta, dz = score_gradient(
            without_padding(p), dout, out, lse,
            None if dlse is None else np.asarray(dlse, dtype=np.float64))
        cond = _logit_condition(p, s, probs, lse, cap_slope)
        weights = probs * cond[..., None]
        v_abs = np.abs(np.repeat(p.v, p.group_size, axis=1))
        delta_mag = _delta_magnitude(dout, out, dlse)
        dz_mag = weights * (np.abs(dout) @ np.swapaxes(v_abs, -1, -2) + delta_mag[..., None])
        dtau = np.sum(np.abs(dtau_terms(s, probs, dz_mag)), axis=(0, 2, 3)) / p.tau**2
        dbeta = _sink_allowance(p, delta, delta_mag, lse, cond, dtype)
        dsigma = None
        if gate is not None:
            dlogg = dlog_gate(p, *gate)
            dsigma = np.sum(np.abs(np.where(keep, dz_mag * dlogg, 0.0)), axis=(2, 3))
        ds_mag = dz_mag / p.tau[:, None, None]
        dcaptures = None
        if has_score(p):  # magnitudes through score_mod's derivative
            ds_mag, dcaptures = variant_gradient(p, scores(p)[0], ds_mag)
            ds_mag = np.abs(ds_mag)
        ds_raw_mag = ds_mag if cap_slope is None else ds_mag * cap_slope * (1 + _slope_condition(p) / cond[..., None])
        dq = abs(p.scale) * ds_raw_mag @ np.abs(np.repeat(p.k, p.group_size, axis=1))
        dk = (abs(p.scale) * np.swapaxes(ds_raw_mag, -1, -2) @ np.abs(p.q)).reshape(B, Hkv, p.group_size, M, D)
        dv = (np.swapaxes(weights, -1, -2) @ np.abs(dout)).reshape(B, Hkv, p.group_size, M, Dv)
        terms = {"out": weights @ v_abs, "lse": cond}
    bounds = dataclasses.replace(p, bias=None).reduce_grads(dq, dk.sum(axis=2), dv.sum(axis=2), dtau, np.zeros(H), dsigma)
    terms.update({name: getattr(bounds, name) for name in ("dq", "dk", "dv", "dtau", "dsigma")})
    if p.bias is not None:
        terms["dbias"] = reduce_to_shape(ds_mag, p.bias_shape)
    allowances = dict(_allowances(terms, dtype), dbeta=dbeta)
    if dcaptures is not None:
        allowances["dcaptures"] = tuple(None if d is None else _allowances({"d": np.abs(d)}, dtype)["d"]
                                        for d in dcaptures)
    return allowances


def kit_allowed(want, naive, dtype, rounding=0.0):
    """The conformance kit's rule: the error allowed against the oracle, and the naive baseline.

    ``max(2 * naive_error + rounding, floor * max |want|)``, ``naive_error``
    the worst error of ``naive`` (the quantity from each ordering of
    `naive_orderings`: a naive evaluation has no preferred order of its sums,
    and one order alone is a noisy yardstick), ``rounding`` the quantity's
    `rounding_allowance` (what no reordering samples), ``floor`` the dtype's
    `FLOOR`. It is never below the smallest normal number of the dtype the
    computation takes (``1.2e-38`` for float32 and the halves): below it a
    float holds no relative precision, its subnormals lie ``1.4e-45`` apart
    and every term of a sum there may be off by that much, which no relative
    allowance counts. The allowance is finite wherever the oracle is (the
    naive evaluation stays finite there, see `naive_forward` and
    `naive_sink_gradient`); an oracle with no finite value allows nothing:
    its infinities must be matched exactly.
    """
    naive_error = max(worst_error(n, want)[0] for n in naive)
    if not np.isfinite(want).any():  # nothing to allow: `worst_error` compares the infinities exactly
        return 0.0, naive_error
    floor = max(FLOOR[np.dtype(dtype).name] * _magnitude(want), float(np.finfo(compute_dtype(dtype)).tiny))
    return max(2.0 * naive_error + rounding, floor), naive_error


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
        The quantity's `rounding_allowance`; never less than one float32
        ulp of ``scale`` (the default).

    Returns
    -------
    allowed, naive_error : float
    """
    scale = max(1.0, _magnitude(want))
    naive_error = max(worst_error(n, want)[0] for n in naive)
    ulp = float(np.finfo(np.float32).eps) * scale
    rounding = ulp if rounding is None else max(rounding, ulp)
    return min(2.0 * naive_error + rounding, FLOOR["float32"] * scale), naive_error


def double_backward_rounding(q, k, v, dout, cotangents, options, dlse=None, dtype=np.float32):
    """`rounding_allowance` for the double backward: ``2 eps`` times the largest sum of its terms' magnitudes.

    ``cotangents = (ddq, ddk, ddv, ddtau, ddbeta, ddsigma, ddbias)`` as
    `elastic_np.reference.attention_double_backward` takes them (None for
    zeros). The same two effects, on the terms of the oracle's steps
    (`elastic_np.reference._double_backward.tangent_terms`) in magnitude:
    every weight ``p`` carries the logits' factor ``1 + max(|z|, |lse|)``,
    every difference is taken as the sum of its parts' magnitudes (``pdot =
    p (zdot - lsedot)`` as ``p (|zdot| + |lsedot|)``, ``dz`` and ``dzdot``
    likewise from ``|dout| |v|``, ``|dout| |vdot|``, ``|delta|`` and
    ``|deltadot|``), and the soft-cap's ``|tanh|`` as 1. Beyond those of
    the backward, the sums that cancel are ``outdot`` (the kernels take it
    as ``sum p zdot v - lsedot sum p v + sum p vdot``, since ``lsedot`` is
    known only after a whole row) and the tangents of ``dtau``, ``dbeta``,
    ``dsigma`` and a broadcast ``dbias``.

    Returns
    -------
    dict
        ``{name: 2 * eps * max(sum |terms|)}`` for ``ddout``, ``ddlse`` and
        the gradients the options produce.
    """
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    p = _prepared(options, q, k, v)
    B, H, Hkv, N, M, D, Dv = p.shape
    out, lse = oracle_forward(p)
    d = direction(p, cotangents[:3], cotangents[3:], True)
    p = without_padding(p)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        t = tangent_terms(p, dout, out, lse, None if dlse is None else np.asarray(dlse, np.float64), d)
        cond = _logit_condition(p, t.s, t.probs, lse, t.cap_slope)
        w = t.probs * cond[..., None]
        v_abs, vdot_abs, k_abs, kdot_abs = (np.abs(np.repeat(a, p.group_size, axis=1)) for a in (p.v, d.v, p.k, d.k))
        delta_mag = _delta_magnitude(dout, out, dlse)
        pdot_mag = w * (np.abs(t.zdot) + np.abs(t.lsedot)[..., None])
        outdot_mag = pdot_mag @ v_abs + w @ vdot_abs
        deltadot_mag = np.sum(np.abs(dout) * outdot_mag, axis=-1)
        dp_mag = np.abs(dout) @ np.swapaxes(v_abs, -1, -2) + delta_mag[..., None]
        dz_mag = w * dp_mag
        dzdot_mag = pdot_mag * dp_mag + w * (np.abs(dout) @ np.swapaxes(vdot_abs, -1, -2) + deltadot_mag[..., None])
        tau, ratio = p.tau[:, None, None], np.abs(d.tau / p.tau)[:, None, None]
        dsdot_mag = (dzdot_mag + dz_mag * ratio) / tau
        dr_mag, drdot_mag = dz_mag / tau, dsdot_mag
        if t.cap_slope is not None:
            cdot_mag = 2.0 * t.cap_slope * np.abs(t.rdot) / p.softcap
            dr_mag, drdot_mag = dr_mag * t.cap_slope, dsdot_mag * t.cap_slope + dr_mag * cdot_mag
        dq = abs(p.scale) * (drdot_mag @ k_abs + dr_mag @ kdot_abs)
        dk = abs(p.scale) * (np.swapaxes(drdot_mag, -1, -2) @ np.abs(p.q) + np.swapaxes(dr_mag, -1, -2) @ np.abs(d.q))
        dv = np.swapaxes(pdot_mag, -1, -2) @ np.abs(dout)
        s_abs, sdot_abs = (np.where(t.probs > 0, np.abs(a), 0.0) for a in (t.s, t.sdot))
        dtau = (np.sum(dzdot_mag * s_abs + dz_mag * sdot_abs, axis=(0, 2, 3)) / p.tau**2
                + 2.0 * np.abs(d.tau) * np.sum(dz_mag * s_abs, axis=(0, 2, 3)) / p.tau**3)
        exp_lse = np.where(np.isneginf(lse), 0.0, np.exp(-lse)) * cond
        dbeta = np.sum((deltadot_mag + delta_mag * np.abs(t.lsedot)) * exp_lse, axis=(0, 2))
        dsigma = None
        if t.gate is not None:
            d2log = np.where(t.keep, d2log_gate(p, *t.gate), 0.0) * np.abs(d.sigma)[:, :, None, None]
            dsigma = np.sum(dzdot_mag * np.abs(t.dlog) + dz_mag * np.abs(d2log), axis=(2, 3))
        terms = {"ddout": outdot_mag, "ddlse": np.sum(w * np.abs(t.zdot), axis=-1) + np.abs(d.beta)[:, None] * exp_lse}
    group = (B, Hkv, p.group_size, M)
    bounds = dataclasses.replace(p, bias=None).reduce_grads(
        dq, dk.reshape(*group, D).sum(axis=2), dv.reshape(*group, Dv).sum(axis=2), dtau, dbeta, dsigma)
    terms.update({name: getattr(bounds, name) for name in ("dq", "dk", "dv", "dtau", "dbeta", "dsigma")})
    if p.bias is not None:
        terms["dbias"] = reduce_to_shape(dsdot_mag, p.bias_shape)
    return _allowances(terms, dtype)


def naive_double_backward(q, k, v, dout, cotangents, options, dtype=np.float32, dlse=None, orderings=4, seed=0):
    """The oracle's double backward evaluated in ``dtype``, in several summation orders: the float32 baseline.

    `elastic_np.reference._double_backward._double_backward` is generic in
    dtype: run on ``dtype`` arrays (``out`` and ``lse`` from the oracle's
    forward in ``dtype``, the cotangents ``(ddq, ddk, ddv, ddtau, ddbeta,
    ddsigma, ddbias)`` and ``dlse`` rounded to it) it is the naive
    evaluation, every operation in ``dtype``. As in `naive_orderings`, the
    head dimensions of ``q, k, ddq, ddk`` (and of ``v, dout, ddv``) are
    permuted together from the second ordering on.

    Returns
    -------
    list of dict
        One per ordering: ``ddout``, ``ddlse``, ``dq``, ``dk``, ``dv``,
        ``dtau``, ``dbeta``, ``dsigma``, ``dbias`` (None where the options
        have none), in the caller's layout and head-dimension order.
    """
    dtype = compute_dtype(dtype)
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(a) for a in (q, k, v, dout)]
    moving = [np.zeros(a.shape) if c is None else np.asarray(c) for a, c in zip(arrays, cotangents[:3])]
    D, Dv = arrays[0].shape[-1], arrays[2].shape[-1]
    results = []
    for n in range(orderings):
        pd = np.arange(D) if n == 0 else rng.permutation(D)
        pv = np.arange(Dv) if n == 0 else rng.permutation(Dv)
        perms = (pd, pd, pv, pv)
        q_n, k_n, v_n, dout_n = (np.asarray(a[..., perm], dtype=dtype) for a, perm in zip(arrays, perms))
        p = prepare(q_n, k_n, v_n, dtypes=(dtype.name,), **options)
        out, lse = oracle_forward(p)
        d = direction(p, [c[..., perm] for c, perm in zip(moving, perms)], cotangents[3:], True)
        d = d._replace(**{f: None if a is None else a.astype(dtype) for f, a in d._asdict().items()})
        with np.errstate(all="ignore"):
            outdot, lsedot, g = oracle_double_backward(
                p, p.as_bhnd(dout_n), out, lse, None if dlse is None else np.asarray(dlse, dtype=dtype), d)
        g = p.grads_as_given(g)
        back_d, back_v = np.argsort(pd), np.argsort(pv)
        results.append({"ddout": p.as_given(outdot)[..., back_v], "ddlse": lsedot, "dq": g.dq[..., back_d],
                        "dk": g.dk[..., back_d], "dv": g.dv[..., back_v], "dtau": g.dtau, "dbeta": g.dbeta,
                        "dsigma": g.dsigma, "dbias": g.dbias})
    return results
