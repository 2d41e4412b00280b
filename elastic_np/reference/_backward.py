"""The hand-derived attention backward (the steps of the derivations page), generic in dtype like `_attention`."""

import numpy as np

from elastic_np._contract import _spec, _validation
from elastic_np._contract._problem import prepare
from elastic_np.reference import _variant as variant
from elastic_np.reference._attention import (
    _attention_logits, log_tanh_elasticity, scores, with_variant, without_padding,
)


@_spec.takes_options()
def attention_backward(dout, q, k, v, out, lse, *, dlse=None, score_mod=None, mask_mod=None, block_mask=None,
                       captures=(), check_finite=True, **options):
    r"""Hand-derived backward of `attention`: gradients for ``q, k, v, tau, beta, sigma, bias``.

    With :math:`p_{ij} = e^{z_{ij} - \mathrm{lse}_i}` on kept entries:

    .. math::

        dP_{ij} = dout_i \cdot v_j, \quad \delta_i = dout_i \cdot out_i - dlse_i, \quad
        dz_{ij} = p_{ij}(dP_{ij} - \delta_i), \quad ds_{ij} = dz_{ij}/\tau_h

    .. math::

        dv_j = \sum_i p_{ij}\, dout_i, \quad
        dq_i = \mathrm{scale}\sum_j ds_{ij} k_j, \quad
        dk_j = \mathrm{scale}\sum_i ds_{ij} q_i

    .. math::

        d\tau_h = -\frac{1}{\tau_h^2}\sum_{b,i,j} dz_{ij} s_{ij}, \quad
        d\beta_h = -\sum_{b,i} \delta_i e^{-\mathrm{lse}_i}, \quad
        d\sigma_{bh} = \sum_{i,j} dz_{ij}\,\frac{\partial \log G_{ij}}{\partial\sigma}, \quad
        d\mathrm{bias}_{bhij} = ds_{ij}

    With a soft-cap, ``dq`` and ``dk`` take ``ds * (1 - tanh^2(s_raw / softcap))``.
    The probabilities are recomputed from ``lse``, as a fused kernel does.

    Parameters
    ----------
    dout : array_like, shape (B, H, N, Dv)
        Cotangent of ``out``.
    q, k, v : array_like
        The inputs of the forward.
    out, lse : array_like
        The forward's outputs. Only their shapes and values (no NaN or inf;
        ``lse`` may be ``-inf``) are checked, not that they are what the
        forward returned for these inputs: an inconsistent ``lse`` (``-inf``
        for a row that keeps entries, say) gives meaningless gradients.
    dlse : array_like, shape (B, H, N), optional
        Cotangent of ``lse``; None (default) stands for zeros. A row with
        ``lse = -inf`` takes no gradient from it.
    %(other_names)s
        The options given to the forward (see `attention`).
    check_finite : bool, optional
        As for `attention`.

    Returns
    -------
    AttentionGrads
        ``dq, dk, dv`` in float64 and the shapes of ``q, k, v``; ``dtau``,
        ``dbeta``, ``dsigma``, ``dbias`` in the shapes ``tau``, ``beta``,
        ``sigma`` and ``bias`` were given in (``dsigma`` is None without a
        dynamic window, ``dbias`` None without a bias).

    Raises
    ------
    TypeError, ValueError
        As for `attention`, and for ``dout``, ``out``, ``lse``, ``dlse`` of the wrong
        shape or with NaN or inf (``lse`` may be ``-inf``: an empty row with ``beta = 0``).

    Examples
    --------
    >>> import numpy as np
    >>> from elastic_np import reference as ref
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    >>> out, lse = ref.attention(q, k, v, beta=0.5)
    >>> g = ref.attention_backward(np.ones_like(out), q, k, v, out, lse, beta=0.5)
    >>> g.dq.shape, type(g.dbeta).__name__
    ((1, 2, 3, 4), 'float')
    """
    p = with_variant(prepare(q, k, v, check_finite=check_finite, **_spec.complete(options, "attention_backward")),
                     score_mod, mask_mod, block_mask, captures)
    dout, out, lse, dlse = check_backward_arrays(p, dout, out, lse, dtype=np.float64, dlse=dlse)
    return p.grads_as_given(_backward(p, dout, out, lse, dlse))


def check_backward_arrays(p, dout, out, lse, dtype=None, dlse=None):
    """Validate ``dout``, ``out``, ``lse`` and ``dlse`` against the problem's shapes.

    ``dout`` and ``out`` are in the problem's ``layout``. ``dtype=None``
    requires the problem's dtype (the kernels; ``lse`` and ``dlse`` in the
    dtype of the computation, float32 for bfloat16 and float16 inputs); a dtype converts to it (the
    reference). Returns ``(dout, out, lse, dlse)``, ``dout`` and ``out`` as
    ``(B, H, N, Dv)`` (views), ``dlse`` None when it was.
    """
    if p.quantized:
        raise TypeError(f"no gradient through a quantized cache: `k` and `v` are {p.quantized} (with `k_scale`, "
                        "`v_scale`); the backward takes float `k` and `v`")
    named = list(zip(p.backward_shapes, (dout, out, lse)))
    if dlse is not None:
        named.append((("dlse", p.backward_shapes[2][1]), dlse))
    arrays = []
    for (name, shape), a in named:
        a = np.asarray(a)
        _validation.check_real_float_dtype(a, name)
        if a.shape != shape:
            layout = f" (layout={p.layout!r})" if a.ndim == 4 else ""
            raise ValueError(f"`{name}` must have shape {shape}{layout}, got {a.shape}")
        if a.ndim == 4:
            a = p.as_bhnd(a)
        expected = p.compute_dtype if name in ("lse", "dlse") else p.dtype
        if dtype is None and a.dtype != expected:
            like = "the forward's `lse`" if name in ("lse", "dlse") else "`q`"
            raise TypeError(f"`{name}` has dtype {a.dtype}, expected {expected} like {like}")
        bad = np.isnan(a) | (a == np.inf) if name == "lse" else ~np.isfinite(a)
        if bad.any():
            raise ValueError(f"`{name}` contains NaN or inf")
        arrays.append(a.astype(dtype, copy=False) if dtype is not None else a)
    return (*arrays, None) if dlse is None else tuple(arrays)


def _backward(p, dout, out, lse, dlse=None):
    """The gradients in the dtype of ``p.q``, as `AttentionGrads`; ``dbeta`` in float64 (see `sink_gradient`)."""
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.q.dtype
    t = dtype.type
    p = without_padding(p)
    s, keep, gate, cap_slope, probs, delta, dz = score_gradient(p, dout, out, lse, dlse)
    k = np.repeat(p.k, p.group_size, axis=1)
    ds = dz / p.tau.astype(dtype)[:, None, None]  # d loss / d s, the final score: also dbias
    dcaptures = None
    if variant.has_score(p):  # ds of the score before score_mod: the bias's, and the soft-cap's input
        ds, dcaptures = variant.score_gradient(p, scores(p)[0], ds)
    ds_raw = ds if cap_slope is None else ds * cap_slope

    dq = t(p.scale) * ds_raw @ k
    dk_h = t(p.scale) * np.swapaxes(ds_raw, -1, -2) @ p.q
    dv_h = np.swapaxes(probs, -1, -2) @ dout
    dk = dk_h.reshape(B, Hkv, p.group_size, M, D).sum(axis=2)
    dv = dv_h.reshape(B, Hkv, p.group_size, M, Dv).sum(axis=2)

    tau = p.tau.astype(dtype)
    dtau = -(np.sum(dtau_terms(s, probs, dz), axis=(0, 2, 3)) / tau) / tau
    dbeta = p.sink_gradient(delta, lse)
    dsigma = None
    if gate is not None:
        dsigma = np.sum(dz * np.where(keep, dlog_gate(p, *gate), t(0)), axis=(2, 3))
    return p.reduce_grads(dq, dk, dv, dtau, dbeta, dsigma, dbias=ds, dcaptures=dcaptures)


def score_gradient(p, dout, out, lse, dlse=None):
    """The forward recomputed from ``lse`` and ``dz = d loss / d z``, the gradient of the logits.

    Returns ``(s, keep, gate, cap_slope, probs, delta, dz)``: `_attention_logits`'s
    terms, ``p = exp(z - lse)`` on kept entries, ``delta = dout . out - dlse``
    (``dlse`` None: ``dout . out``) and ``dz = p (dout . v - delta)``, in the
    dtype of ``p.q``.
    """
    s, z, keep, gate, cap_slope = _attention_logits(p)
    with np.errstate(invalid="ignore"):
        probs = np.where(keep, np.exp(z - lse[..., None]), z.dtype.type(0))
    v = np.repeat(p.v, p.group_size, axis=1)
    dP = dout @ np.swapaxes(v, -1, -2)
    delta = np.sum(dout * out, axis=-1)
    if dlse is not None:
        delta = delta - dlse  # d lse_i / d z_ij = p_ij: the lse term joins the row's delta
    dz = probs * (dP - delta[..., None])  # zero where not kept, since probs is
    return s, keep, gate, cap_slope, probs, delta, dz


def dtau_terms(s, probs, dz):
    """``dz * s`` on the entries with weight, the terms of ``-tau**2 dtau``.

    A score of -inf (a slope ``|off|`` beyond the dtype) has ``p = dz = 0``
    and no term; the sum is divided by ``tau`` twice, as ``tau**2`` may underflow.
    """
    with np.errstate(invalid="ignore"):
        return np.where(probs > 0, dz * s, s.dtype.type(0))


def dlog_gate(p, G, f, x):
    """``d log G / d sigma`` per entry of the dynamic window (see `window_gate`).

    ``(d log G / d log y) (d log f / d sigma)`` at ``y = sharpness f``: the
    gate's `log_tanh_elasticity` times ``(u^2 - 1) / sigma``, ``u = x /
    sigma``, finite however small ``f`` is (a row far from all its keys).
    Where ``G = 0``, ``y = sharpness`` (any finite value, removed by keep).
    """
    t = f.dtype.type
    sigma = p.sigma.astype(f.dtype)[:, :, None, None]
    y = t(p.sharpness) * np.where(G > 0, f, t(1))
    with np.errstate(over="ignore", invalid="ignore"):  # inf * 0 only where the gate is closed
        u = x / sigma  # (x^2 / sigma^2 - 1) / sigma without sigma**3, which underflows
        return log_tanh_elasticity(y) * ((u * u - 1) / sigma)
