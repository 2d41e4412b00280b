"""The gradients' records and checks: the double backward's result and direction, the sink's gradient."""

from typing import NamedTuple, Optional

import numpy as np

from elastic_np._contract import _validation


def sink_gradient(delta, lse, per_head=True):
    """``dbeta``: ``-sum_{b,i} delta_i exp(-lse_i)`` per head (over every row without ``per_head``).

    ``delta`` and ``lse`` are ``(B, H, N)``; returns ``(H,)`` float64, or a
    0-d array without ``per_head`` (a ``beta`` shared by the heads). With a
    cotangent of ``lse``, ``delta`` is ``dout . out - dlse``.

    A row with ``delta = 0`` adds nothing, nor does a row with ``lse = -inf``
    (an empty row with ``beta = 0``, whatever its ``dlse``: there ``d lse /
    d beta = 1 / beta`` is not finite, and the contract's rule gives such a
    row no gradient). The sum is taken relative to its largest factor (see
    `sink_terms`): a head whose rows overflow ``exp(-lse)`` gets the sign of
    the sum and ``inf``, not ``inf - inf = NaN``, and a sum that fits float64
    is not lost to an overflowing term. float64 throughout: ``exp(-lse)`` of a
    float32 ``lse`` below -88.7 would overflow float32.
    """
    return sink_from_terms(*sink_terms(delta, lse, (0, 2) if per_head else (0, 1, 2)))


def sink_terms(delta, lse, axes):
    """``(top, scaled)`` with ``sum delta_i exp(-lse_i) = scaled * exp(top)`` over ``axes``.

    ``top = max(-lse_i)`` over the rows with ``delta_i != 0`` and a finite
    ``lse_i`` (0 where there are none): partial sums over disjoint rows
    combine exactly with `merge_sink_terms`.
    """
    delta = np.asarray(delta, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    live = (delta != 0) & (lse != -np.inf)
    exponent = np.where(live, -lse, -np.inf)
    top = exponent.max(axis=axes, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)
    scaled = np.where(live, delta * np.exp(exponent - top), 0.0).sum(axis=axes)
    return top.reshape(scaled.shape), scaled


def merge_sink_terms(a, b):
    """The `sink_terms` of two disjoint sets of rows, combined."""
    (top_a, scaled_a), (top_b, scaled_b) = a, b
    top = np.where(scaled_a == 0, top_b, np.where(scaled_b == 0, top_a, np.maximum(top_a, top_b)))
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (np.where(scaled_a == 0, 0.0, scaled_a * np.exp(top_a - top))
                  + np.where(scaled_b == 0, 0.0, scaled_b * np.exp(top_b - top)))
    return top, scaled


def sink_from_terms(top, scaled):
    """``dbeta = -scaled * exp(top)``, of the sign of ``scaled`` and ``inf`` only where it overflows.

    A sum that cancels exactly (``scaled = 0``) is 0, whatever ``exp(top)``.
    """
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        grad = np.asarray(np.where(scaled == 0, 0.0, -scaled * np.exp(top)))
        wide = ~np.isfinite(grad)  # exp(top) alone overflows: the product may not
        if wide.any():
            grad[wide] = -np.sign(scaled[wide]) * np.exp(top[wide] + np.log(np.abs(scaled[wide])))
    return grad


def sum_to_shape(grad, shape):
    """Sum a broadcast gradient back to ``shape``; a Python float for ``shape == ()``."""
    grad = np.asarray(grad, dtype=np.float64)
    # the common cases of a backward without the axes' bookkeeping, a few microseconds a call: a C-contiguous
    # gradient summed to a shared scalar (NumPy sums its reduced axes as one run over the memory: the sum over
    # its memory has the same bits; one entry is kept as it is, -0.0 included), and a gradient already of the
    # parameter's shape
    if shape == ():
        if grad.ndim and grad.flags.c_contiguous:
            flat = grad.reshape(-1)
            return float(flat[0] if flat.size == 1 else np.add.reduce(flat))
    elif grad.shape == shape:
        return grad
    out = reduce_to_shape(grad, shape)
    return float(out) if shape == () else out


def reduce_to_shape(grad, shape):
    """Sum ``grad`` over the leading axes and the axes where ``shape`` has 1, keeping its dtype."""
    lead = grad.ndim - len(shape)
    # axes of length 1 need no sum (NumPy would copy the whole array for it)
    axes = tuple(i for i in range(lead) if grad.shape[i] != 1) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1
    )
    return grad.sum(axis=axes, keepdims=True).reshape(shape) if axes else grad.reshape(shape)


class DoubleBackwardGrads(NamedTuple):
    """The result of `attention_double_backward`.

    Attributes
    ----------
    ddout : ndarray
        Gradient for ``dout``, in its shape: the tangent of ``out``.
    ddlse : ndarray, shape (B, H, N)
        Gradient for ``dlse``: the tangent of ``lse`` (0 on rows with
        ``lse = -inf``).
    dq, dk, dv : ndarray
        Second-order gradients of ``q``, ``k``, ``v``, in their shapes.
    dtau, dbeta : float or ndarray
        Those of ``tau`` and ``beta``, in the shapes they were given in.
    dsigma : float or ndarray or None
        That of the dynamic window's ``sigma``, or None without one.
    dbias : ndarray or None
        That of the ``bias`` in its shape, or None without a bias.
    """

    ddout: np.ndarray
    ddlse: np.ndarray
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dtau: object
    dbeta: object
    dsigma: Optional[object] = None
    dbias: Optional[np.ndarray] = None


class Direction(NamedTuple):
    """The direction ``xdot``: ``q, k, v`` as ``(B, H·, ·, ·)``, ``tau``, ``beta`` ``(H,)``,
    ``sigma`` ``(B, H)`` and ``bias`` ``(B, H, N, M)`` (or None), float64."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    tau: np.ndarray
    beta: np.ndarray
    sigma: Optional[np.ndarray]
    bias: Optional[np.ndarray]


def double_backward_as_given(p, outdot, lsedot, grads):
    """`DoubleBackwardGrads` from a backend's ``(ddout, ddlse, grads)``, in the layout and shapes given."""
    grads = p.grads_as_given(grads)
    return DoubleBackwardGrads(p.as_given(outdot), lsedot, grads.dq, grads.dk, grads.dv, grads.dtau,
                               grads.dbeta, grads.dsigma, grads.dbias)


def direction(p, arrays, parameters, check_finite):
    """The cotangents ``(ddq, ddk, ddv)`` and ``(ddtau, ddbeta, ddsigma, ddbias)`` checked, as a `Direction`."""
    B, H, Hkv, N, M, D, Dv = p.shape
    given = []
    for name, like, a in zip(("ddq", "ddk", "ddv"), (p.q, p.k, p.v), arrays):
        shape = p.as_given(like).shape
        given.append(p.as_bhnd(cotangent(a, name, shape, check_finite)))
    padding = np.arange(M)[None, None, :, None] >= p.kv_lengths[:, None, None, None]
    given[1:] = [np.where(padding, 0.0, a) for a in given[1:]]  # the padding is never read
    likes = (("tau", p.tau_shape, (H,)), ("beta", p.beta_shape, (H,)),
             ("sigma", p.sigma_shape, (B, H)), ("bias", p.bias_shape, (B, H, N, M)))
    for value, (like, shape, full) in zip(parameters, likes):
        if shape is None:
            if value is not None:
                raise ValueError(f"`dd{like}` is given but there is no `{like}`: "
                                 f"{'pass a dynamic_window' if like == 'sigma' else 'pass a bias'}")
            given.append(None)
            continue
        given.append(np.broadcast_to(cotangent(value, f"dd{like}", shape, check_finite), full))
    return Direction(*given)


def cotangent(a, name, shape, check_finite):
    """``a`` as a float64 array of ``shape`` (zeros for None), checked; errors name ``name``."""
    if a is None:
        return np.zeros(shape)
    a = _validation.real_float_array(a, name, check_finite=check_finite)
    if a.shape != tuple(shape):
        raise ValueError(f"`{name}` must have shape {tuple(shape)}, got {a.shape}")
    return a
