"""The public types of the options and the gradients: `DynamicWindow` and `AttentionGrads`."""

import dataclasses
from typing import Optional

import numpy as np

from elastic_np._contract import _validation

#: The smallest ``sigma``: the smallest normal float64 (see `DynamicWindow`).
SIGMA_MIN = float(np.finfo(np.float64).tiny)

#: ``window_size`` entries are int64 in the kernels.
WINDOW_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicWindow:
    """A learnable bell-curve window over key positions.

    For query ``i`` and key ``j`` (``N`` queries, ``M`` keys) the window is

    .. math::

        x_{ij} = \\frac{2 (j - i - (M - N))}{M - 1}, \\quad
        f_{ij} = \\frac{e^{-x_{ij}^2 / (2\\sigma^2)}}{\\sigma\\sqrt{2\\pi}}, \\quad
        G_{ij} = \\tanh(\\mathrm{sharpness}\\cdot f_{ij}\\,[f_{ij} > \\mathrm{threshold}])

    (``x = 0`` when ``M = 1``; with ``align="kv_lengths"``, ``M`` reads
    ``kv_lengths[b]``, the sequence's own length). Keys with ``G = 0`` are removed and the others
    get ``log G`` added to their logit.

    Parameters
    ----------
    sigma : float or array_like
        Width of the bell, broadcastable to ``(B, H)``, at least the smallest
        normal float64, ``2.2250738585072014e-308`` (below it the bell's
        peak ``1 / (sigma sqrt(2 pi))`` overflows); the float32 kernels take
        ``sigma >= 1.1754944e-38``, the smallest normal float32. Learnable: the
        backward returns ``dsigma`` in this shape.
    sharpness : float, optional
        Gate steepness, ``> 0``. Fixed.
    threshold : float, optional
        Bell values at or below it close the gate, ``>= 0``. Fixed.

    Raises
    ------
    TypeError
        For a non-real ``sigma``, ``sharpness`` or ``threshold``.
    ValueError
        For ``sigma`` below the smallest normal float64 (``sigma <= 0``
        included), ``sharpness <= 0``, ``threshold < 0`` or non-finite values.

    Examples
    --------
    >>> import elastic_np as enp
    >>> enp.DynamicWindow(0.5, sharpness=4.0, threshold=0.1)
    DynamicWindow(sigma=array(0.5), sharpness=4.0, threshold=0.1)
    """

    sigma: np.ndarray
    sharpness: float = 1.0
    threshold: float = 0.0

    def __post_init__(self):
        sigma = np.array(self.sigma, dtype=np.float64) if _is_real(self.sigma) else None
        if sigma is None:
            raise TypeError(f"`sigma` must be a real number or array, got {self.sigma!r}")
        if not (np.isfinite(sigma).all() and (sigma > 0).all()):
            raise ValueError(f"`sigma` must be finite and > 0, got {self.sigma!r}")
        if (sigma < SIGMA_MIN).any():
            raise ValueError(
                f"`sigma` must be at least {SIGMA_MIN!r}, the smallest normal float64 "
                f"(the bell's peak 1 / (sigma sqrt(2 pi)) overflows below it), got {self.sigma!r}"
            )
        sigma.setflags(write=False)
        object.__setattr__(self, "sigma", sigma)
        object.__setattr__(
            self, "sharpness", _validation.positive_scalar(self.sharpness, "sharpness")
        )
        object.__setattr__(
            self, "threshold", _validation.nonnegative_scalar(self.threshold, "threshold")
        )

    def __repr__(self):
        return (
            f"DynamicWindow(sigma={self.sigma!r}, sharpness={self.sharpness!r}, "
            f"threshold={self.threshold!r})"
        )


def _is_real(value):
    return _validation.is_real_dtype(np.asarray(value).dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionGrads:
    """Gradients returned by ``attention_backward``.

    Attributes
    ----------
    dq, dk, dv : ndarray
        Gradients of ``q``, ``k``, ``v``, in their shapes (``dk`` and ``dv``
        summed over the query heads of a group under grouped-query attention).
    dtau, dbeta : float or ndarray
        Gradients of ``tau`` and ``beta`` in the shape they were given in
        (a Python float for a scalar, shape ``(H,)`` for per-head values).
    dsigma : float or ndarray or None
        Gradient of the dynamic window's ``sigma`` in its shape, or None
        without a dynamic window.
    dbias : ndarray or None
        Gradient of the additive ``bias`` in the shape it was given in (the
        sum over the axes it was broadcast along), in the dtype of ``dq``; None
        without a bias.
    dcaptures : tuple or None
        With a user's ``score_mod``: per capture, the gradient of a floating
        one in its shape and dtype (None for an integer or bool one); None
        without a ``score_mod``.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> q = k = v = np.ones((1, 2, 3, 4))
    >>> out, lse = enp.reference.attention(q, k, v, tau=np.array([1.0, 2.0]))
    >>> grads = enp.reference.attention_backward(out, q, k, v, out, lse, tau=np.array([1.0, 2.0]))
    >>> grads.dtau.shape, grads.dsigma is None
    ((2,), True)
    """

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dtau: object
    dbeta: object
    dsigma: Optional[object] = None
    dbias: Optional[np.ndarray] = None
    dcaptures: Optional[tuple] = None

    def __repr__(self):
        """One line per field: its shape and dtype (arrays), value (scalars), or None; never every entry."""
        lines = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None or isinstance(value, float):
                lines.append(f"  {field.name}={value!r},")
            elif isinstance(value, tuple):
                parts = ", ".join("None" if a is None else f"<shape={a.shape} dtype={a.dtype}>" for a in value)
                lines.append(f"  {field.name}=({parts}),")
            else:
                lines.append(f"  {field.name}=<{type(value).__name__} shape={tuple(value.shape)} dtype={value.dtype}>,")
        return "AttentionGrads(\n" + "\n".join(lines) + "\n)"
