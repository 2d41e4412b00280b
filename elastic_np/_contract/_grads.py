"""The gradients of the options: sums back to the shape an option was given in, and the sink's gradient."""

import numpy as np


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
    out = reduce_to_shape(np.asarray(grad, dtype=np.float64), shape)
    return float(out) if shape == () else out


def reduce_to_shape(grad, shape):
    """Sum ``grad`` over the leading axes and the axes where ``shape`` has 1, keeping its dtype."""
    lead = grad.ndim - len(shape)
    # axes of length 1 need no sum (NumPy would copy the whole array for it)
    axes = tuple(i for i in range(lead) if grad.shape[i] != 1) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1
    )
    return grad.sum(axis=axes, keepdims=True).reshape(shape) if axes else grad.reshape(shape)
