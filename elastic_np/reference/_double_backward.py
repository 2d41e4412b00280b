"""The second-order VJP of the attention ("double backward"): tangents of the forward and of the backward.

The backward ``G = grad_x L`` of ``L = <dout, out(x)> + <dlse, lse(x)>`` is
linear in ``(dout, dlse)`` and its Jacobian in ``x = (q, k, v, tau, beta,
sigma, bias)`` is the Hessian of ``L``, which is symmetric. So the VJP of
``G`` with cotangent ``u`` is the JVP of ``G`` along ``xdot = u`` for ``x``,
and the JVPs of ``out`` and ``lse`` along ``u`` for ``dout`` and ``dlse``:
forward-mode derivatives of the formulas of `_attention` and `_backward`.
`_double_backward` is generic in dtype like them: the conformance kit's naive
float32 evaluation, which sets the CPU kernels' float32 tolerance, is the
same code on float32 arrays.
"""

from typing import NamedTuple, Optional

import numpy as np

from elastic_np._contract import _grads, _spec
from elastic_np._contract._problem import prepare
from elastic_np.reference._attention import log_tanh_elasticity, without_padding
from elastic_np.reference._backward import dlog_gate, dtau_terms, score_gradient, check_backward_arrays


@_spec.takes_options()
def attention_double_backward(ddq, ddk, ddv, dout, q, k, v, out, lse, *, ddtau=None, ddbeta=None,
                              ddsigma=None, ddbias=None, dlse=None, check_finite=True, **options):
    r"""Second-order VJP of `attention_backward`: the gradients of ``<u, attention_backward(...)>``.

    ``u = (ddq, ddk, ddv, ddtau, ddbeta, ddsigma, ddbias)`` is a cotangent
    of the backward's outputs ``(dq, dk, dv, dtau, dbeta, dsigma, dbias)``.
    The result is the gradient of :math:`\langle u, G\rangle` with respect to
    the backward's inputs ``dout``, ``dlse``, ``q``, ``k``, ``v``, ``tau``,
    ``beta``, ``sigma`` and ``bias``, with ``out`` and ``lse`` the functions
    of them the forward computes (a cache, not inputs of their own). With
    :math:`L = \langle dout, out\rangle + \langle dlse, lse\rangle` and
    :math:`G = \nabla_x L`, :math:`x = (q, k, v, \tau, \beta, \sigma, \mathrm{bias})`:

    .. math::

        d\,dout = J_{out}\, u, \qquad d\,dlse = J_{\lse}\, u, \qquad
        dx = \nabla_x^2 L\; u,

    the tangents of ``out``, ``lse`` and of the backward along ``u``, as the
    Hessian is symmetric (see the derivations page).

    Parameters
    ----------
    ddq, ddk, ddv : array_like or None
        Cotangents of ``dq``, ``dk``, ``dv``, in the shapes of ``q``, ``k``,
        ``v``; None stands for zeros.
    dout, q, k, v, out, lse : array_like
        As for `attention_backward`.
    ddtau, ddbeta, ddsigma, ddbias : array_like or float, optional
        Cotangents of ``dtau``, ``dbeta``, ``dsigma``, ``dbias``, in the
        shapes ``tau``, ``beta``, ``sigma``, ``bias`` were given in; None
        (default) stands for zeros. ``ddsigma`` needs a dynamic window,
        ``ddbias`` a bias.
    dlse : array_like, shape (B, H, N), optional
        The cotangent of ``lse`` given to the backward; None stands for zeros.
    %(other_names)s
        The options given to the forward (see `attention`).
    check_finite : bool, optional
        As for `attention`; the cotangents are checked too.

    Returns
    -------
    DoubleBackwardGrads
        ``ddout`` (the shape of ``dout``), ``ddlse`` ``(B, H, N)``, and
        ``dq, dk, dv, dtau, dbeta, dsigma, dbias`` as `attention_backward`
        returns them (a Python float for a scalar parameter), float64.

    Raises
    ------
    TypeError, ValueError
        As for `attention_backward`, and for a cotangent of the wrong shape
        or dtype or with NaN or inf; the message names it.

    Notes
    -----
    As for the first-order gradients, the kept set is taken as locally
    constant (away from the NVM jump and the gate's threshold), and a row
    with ``lse = -inf`` takes nothing.

    Examples
    --------
    ``ddout`` is the tangent of ``out`` along ``u``:

    >>> import numpy as np
    >>> from elastic_np import reference as ref
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, ddq = (rng.standard_normal((1, 2, 3, 4)) for _ in range(4))
    >>> out, lse = ref.attention(q, k, v, beta=0.5)
    >>> dout = np.ones_like(out)
    >>> g = ref.attention_double_backward(ddq, None, None, dout, q, k, v, out, lse, beta=0.5)
    >>> g.dq.shape, type(g.dbeta).__name__
    ((1, 2, 3, 4), 'float')
    >>> h = 1e-6
    >>> up, down = (ref.attention(q + e * ddq, k, v, beta=0.5)[0] for e in (h, -h))
    >>> bool(np.allclose(g.ddout, (up - down) / (2 * h), rtol=0, atol=1e-8))
    True
    """
    p = prepare(q, k, v, check_finite=check_finite, **_spec.complete(options, "attention_double_backward"))
    dout, out, lse, dlse = check_backward_arrays(p, dout, out, lse, dtype=np.float64, dlse=dlse)
    direction = _grads.direction(p, (ddq, ddk, ddv), (ddtau, ddbeta, ddsigma, ddbias), check_finite)
    return _grads.double_backward_as_given(p, *_double_backward(p, dout, out, lse, dlse, direction))


class _Terms(NamedTuple):
    """The forward's and the backward's terms and their tangents, ``(B, H, N, M)`` or per row ``(B, H, N)``."""

    s: np.ndarray
    keep: np.ndarray
    gate: Optional[tuple]
    dlog: Optional[np.ndarray]
    cap_slope: Optional[np.ndarray]
    probs: np.ndarray
    delta: np.ndarray
    dz: np.ndarray
    zdot: np.ndarray
    sdot: np.ndarray
    rdot: np.ndarray
    lsedot: np.ndarray
    pdot: np.ndarray
    outdot: np.ndarray
    deltadot: np.ndarray
    dzdot: np.ndarray
    dsdot: np.ndarray


def _double_backward(p, dout, out, lse, dlse, d):
    """``(outdot, lsedot, grads)``: the tangents of ``out``, ``lse`` and of the backward's gradients along ``d``.

    ``grads`` is an `AttentionGrads` in the parameters' given shapes. Computed in the
    dtype of ``p.q`` (``d``'s arrays in it too); ``dbeta`` in float64 (see `sink_gradient`).
    """
    B, H, Hkv, N, M, D, Dv = p.shape
    p = without_padding(p)
    t = tangent_terms(p, dout, out, lse, dlse, d)
    tau = p.tau.astype(p.q.dtype)[:, None, None]
    dq, dk_h = _product_tangents(p, d, t.dz / tau, t.dsdot, t.cap_slope, t.rdot)
    dk = dk_h.reshape(B, Hkv, p.group_size, M, D).sum(axis=2)
    dv = (np.swapaxes(t.pdot, -1, -2) @ dout).reshape(B, Hkv, p.group_size, M, Dv).sum(axis=2)
    dtau = _dtau_tangent(p, d, t.s, t.sdot, t.probs, t.dz, t.dzdot)
    # dbeta = -sum delta exp(-lse): its tangent is -sum (deltadot - delta lsedot) exp(-lse)
    dbeta = p.sink_gradient(t.deltadot - t.delta * t.lsedot, lse)
    dsigma = None
    if t.gate is not None:
        terms = t.dzdot * t.dlog + t.dz * d2log_gate(p, *t.gate) * d.sigma[:, :, None, None]
        dsigma = np.sum(np.where(t.keep, terms, 0.0), axis=(2, 3))
    return t.outdot, t.lsedot, p.reduce_grads(dq, dk, dv, dtau, dbeta, dsigma, dbias=t.dsdot)


def tangent_terms(p, dout, out, lse, dlse, d):
    """The `_Terms` of a problem ``p`` without padding (`without_padding`): the steps of the derivations page."""
    s, keep, gate, cap_slope, probs, delta, dz = score_gradient(p, dout, out, lse, dlse)
    dlog = None if gate is None else np.where(keep, dlog_gate(p, *gate), 0.0)
    zdot, sdot, rdot = _logit_tangent(p, d, s, dlog, cap_slope, probs)
    with np.errstate(over="ignore"):
        exp_lse = np.where(np.isneginf(lse), 0.0, np.exp(-lse))  # d lse / d beta; none for lse = -inf
    lsedot = np.sum(probs * zdot, axis=-1) + d.beta[:, None] * exp_lse
    pdot = probs * (zdot - lsedot[..., None])
    v, vdot = (np.repeat(a, p.group_size, axis=1) for a in (p.v, d.v))
    outdot = pdot @ v + probs @ vdot
    # the backward's tangent: dz = p (dout . v - delta) with delta = dout . out - dlse
    dP = dout @ np.swapaxes(v, -1, -2)
    deltadot = np.sum(dout * outdot, axis=-1)
    dzdot = pdot * (dP - delta[..., None]) + probs * (dout @ np.swapaxes(vdot, -1, -2) - deltadot[..., None])
    tau, taudot = p.tau.astype(p.q.dtype)[:, None, None], d.tau[:, None, None]
    dsdot = dzdot / tau - dz * (taudot / tau / tau)  # the tangent of ds = dz / tau, and of dbias
    return _Terms(s, keep, gate, dlog, cap_slope, probs, delta, dz, zdot, sdot, rdot, lsedot, pdot, outdot,
                  deltadot, dzdot, dsdot)


def _logit_tangent(p, d, s, dlog, cap_slope, probs):
    """``(zdot, sdot, rdot)``: tangents of the logits, the final and the raw scores along ``d``.

    ``dlog`` is ``d log G / d sigma`` (None without a dynamic window); ``zdot``
    is 0 on the entries without weight (``p = 0``).
    """
    k, kdot = (np.repeat(a, p.group_size, axis=1) for a in (p.k, d.k))
    rdot = p.scale * (np.einsum("bhnd,bhmd->bhnm", d.q, k) + np.einsum("bhnd,bhmd->bhnm", p.q, kdot))
    sdot = rdot if cap_slope is None else cap_slope * rdot
    if d.bias is not None:
        sdot = sdot + d.bias
    tau = p.tau.astype(s.dtype)[:, None, None]
    with np.errstate(invalid="ignore"):
        zdot = sdot / tau - s * (d.tau[:, None, None] / tau / tau)
        if dlog is not None:
            zdot = zdot + dlog * d.sigma[:, :, None, None]
        return np.where(probs > 0, zdot, 0.0), sdot, rdot


def _product_tangents(p, d, ds, dsdot, cap_slope, rdot):
    """Tangents of ``dq`` and of ``dk`` per query head, from those of ``ds`` and the scores."""
    k, kdot = (np.repeat(a, p.group_size, axis=1) for a in (p.k, d.k))
    ds_raw, ds_rawdot = ds, dsdot
    if cap_slope is not None:
        # the cap's slope c = 1 - tanh^2(r / cap) moves with r: dc/dr = -2 tanh(r / cap) c / cap
        x = p.scale * np.einsum("bhnd,bhmd->bhnm", p.q, k) / p.softcap
        cap_slopedot = -2.0 * np.tanh(x) * cap_slope * rdot / p.softcap
        ds_raw, ds_rawdot = ds * cap_slope, dsdot * cap_slope + ds * cap_slopedot
    dq = p.scale * (ds_rawdot @ k + ds_raw @ kdot)
    dk_h = p.scale * (np.swapaxes(ds_rawdot, -1, -2) @ p.q + np.swapaxes(ds_raw, -1, -2) @ d.q)
    return dq, dk_h


def _dtau_tangent(p, d, s, sdot, probs, dz, dzdot):
    """The tangent of ``dtau = -sum dz s / tau^2`` per head (divided by ``tau`` step by step, as `_backward`)."""
    tau = p.tau.astype(s.dtype)
    with np.errstate(invalid="ignore"):
        moved = np.sum(np.where(probs > 0, dzdot * s + dz * sdot, 0.0), axis=(0, 2, 3))
    first = np.sum(dtau_terms(s, probs, dz), axis=(0, 2, 3))
    return -(moved / tau) / tau + 2.0 * d.tau * ((first / tau) / tau) / tau


def d2log_gate(p, G, f, x):
    """``d^2 log G / d sigma^2`` per entry of the dynamic window, beside `dlog_gate`'s first derivative.

    With ``y = sharpness f``, ``u = x / sigma`` and ``phi(y) = d log tanh(y) / dy``,
    ``d log G / d sigma = y phi(y) (u^2 - 1) / sigma``; as ``d phi / dy = -2 phi
    coth(2y)`` and ``df / dsigma = f (u^2 - 1) / sigma``, the derivative is
    ``y phi(y) ((u^4 - 5 u^2 + 2) - 2 y coth(2y) (u^2 - 1)^2) / sigma^2`` (the derivations page),
    ``y phi(y)`` evaluated as `log_tanh_elasticity`: finite as ``y`` reaches the subnormals.
    """
    t = f.dtype.type
    sigma = p.sigma.astype(f.dtype)[:, :, None, None]
    y = t(p.sharpness) * np.where(G > 0, f, t(1))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        u2 = (x / sigma) ** 2
        y_coth = y / -np.expm1(-4 * y) * (1 + np.exp(-4 * y))  # y coth(2y), finite as y -> 0
        bracket = (u2 - 5) * u2 + 2 - 2 * y_coth * (u2 - 1) ** 2
        return log_tanh_elasticity(y) * bracket / sigma / sigma
