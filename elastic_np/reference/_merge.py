r"""Merging attention computed over disjoint key sets: the online softmax's block update as an API.

A partial ``(out_p, lse_p)`` is what `elastic_np.attention` returns over a
set of keys :math:`S_p` with ``beta = 0``. Over the union of disjoint sets,
with the sink ``beta`` added once,

.. math::

    \mathrm{lse} = \log\Big(\sum_p e^{\mathrm{lse}_p} + \beta_h\Big), \qquad
    \mathrm{out} = \sum_p e^{\mathrm{lse}_p - \mathrm{lse}}\, \mathrm{out}_p

(see the derivation in the documentation, beside the online softmax). The
validation and the float64 computation `_merge` live here; this module's
`merge_attention` returns that result, and `elastic_np.merge_attention`
(``elastic_np/_api/dispatch.py``) rounds it to the partials' dtype.
"""

import numpy as np

from elastic_np._contract import _validation

#: The shape of one partial and of the stacked array, by parameter name.
_SHAPES = {"outs": ("(B, H, N, Dv)", "(P, B, H, N, Dv)"), "lses": ("(B, H, N)", "(P, B, H, N)")}


def merge_attention(outs, lses, *, beta=0.0):
    r"""Float64 oracle of `elastic_np.merge_attention`: the attention over the union of key sets.

    .. math::

        \mathrm{lse} = \log\Big(\sum_p e^{\mathrm{lse}_p} + \beta_h\Big), \qquad
        \mathrm{out} = \sum_p e^{\mathrm{lse}_p - \mathrm{lse}}\, \mathrm{out}_p

    for partials ``(out_p, lse_p)`` of `attention` over disjoint key sets,
    each computed with ``beta = 0``. The same computation as
    `elastic_np.merge_attention`, which rounds this result to the partials' dtype.

    Parameters
    ----------
    outs : sequence of array_like, or ndarray
        Each ``(B, H, N, Dv)``, or one ``(P, B, H, N, Dv)`` array.
    lses : sequence of array_like, or ndarray
        Each ``(B, H, N)``, or one ``(P, B, H, N)`` array; ``-inf`` where a
        partial kept nothing.
    beta : float or array_like of shape (H,), optional
        The sink, finite and ``>= 0``, added once.

    Returns
    -------
    out : ndarray of float64, shape (B, H, N, Dv)
    lse : ndarray of float64, shape (B, H, N)
        ``out = 0`` and ``lse = log(beta)`` for a row no partial kept a key for.

    Raises
    ------
    TypeError, ValueError
        As for `elastic_np.merge_attention`, except that any real floating
        dtype is accepted, mixed among the partials (all are converted to float64).

    Examples
    --------
    >>> import numpy as np
    >>> from elastic_np import reference as ref
    >>> out, lse = ref.merge_attention([np.ones((1, 1, 1, 2)), np.zeros((1, 1, 1, 2))],
    ...                                [np.zeros((1, 1, 1)), np.zeros((1, 1, 1))], beta=1.0)
    >>> out.round(6), lse.round(6)
    (array([[[[0.333333, 0.333333]]]]), array([[[1.098612]]]))
    """
    outs, lses, beta = check_partials(outs, lses, beta, kernel_dtypes=False)
    return merge_partials(outs, lses, beta)


def merge_partials(outs, lses, beta):
    """Float64 ``(out, lse)`` over the union, from validated partials and float64 ``(H,)`` ``beta``."""
    B, H, N, Dv = outs[0].shape
    lses = [lse.astype(np.float64, copy=False) for lse in lses]
    # logaddexp is the block update in log form; its overflow, for lse values
    # ~1e308 apart, gives the right limit (the smaller term drops out).
    with np.errstate(divide="ignore", over="ignore"):
        lse = lses[0]
        for lse_p in lses[1:]:
            lse = np.logaddexp(lse, lse_p)
        lse = np.logaddexp(lse, np.log(beta)[:, None])
        shift = np.where(np.isneginf(lse), 0.0, lse)  # a row kept nowhere, beta = 0: weights 0, not NaN
        out = np.zeros((B, H, N, Dv))
        for out_p, lse_p in zip(outs, lses):
            weight = np.exp(lse_p - shift)  # in [0, 1], since lse >= lse_p
            out += weight[..., None] * out_p.astype(np.float64, copy=False)
    return out, lse


def check_partials(outs, lses, beta, *, kernel_dtypes):
    """Lists of the partials' arrays (the caller's, unconverted) and ``beta`` as float64 ``(H,)``."""
    outs = _partials(outs, "outs", ndim=4)
    lses = _partials(lses, "lses", ndim=3)
    if kernel_dtypes:
        _check_one_kernel_dtype(outs, lses)
    if len(lses) != len(outs):
        raise ValueError(f"`lses` holds {len(lses)} partials but `outs` holds {len(outs)}")
    shape = outs[0].shape
    for p, out in enumerate(outs):
        if out.shape != shape:
            raise ValueError(
                f"`outs` partials must share one shape (B, H, N, Dv): partial 0 has {shape}, "
                f"partial {p} has {out.shape}"
            )
    for p, lse in enumerate(lses):
        if lse.shape != shape[:3]:
            raise ValueError(
                f"`lses` partial {p} has shape {lse.shape}; `outs` of shape {shape} "
                f"need (B, H, N) = {shape[:3]}"
            )
    for p, (out, lse) in enumerate(zip(outs, lses)):
        _check_values("outs", p, "NaN or inf", ~np.isfinite(out))
        _check_values("lses", p, "NaN or +inf", np.isnan(lse) | (lse == np.inf),
                      "; -inf, for a row the partial kept nothing for, is allowed")
    beta, _ = _validation.per_head(beta, shape[1], "beta", positive=False)
    return outs, lses, beta


def _partials(arrays, name, ndim):
    """The partials of ``outs`` or ``lses`` as a list of real floating arrays of ``ndim`` dimensions."""
    one, stacked = _SHAPES[name]
    if isinstance(arrays, np.ndarray):
        if arrays.ndim != ndim + 1:
            raise ValueError(
                f"`{name}` as one array must have shape {stacked}, got {arrays.shape}; "
                f"pass a single partial as a list of one"
            )
        parts = list(arrays)
    elif isinstance(arrays, (list, tuple)):
        parts = [np.asarray(a) for a in arrays]
    else:
        raise TypeError(
            f"`{name}` must be a list or tuple of arrays {one} or an array {stacked}, "
            f"got {type(arrays).__name__}"
        )
    if not parts:
        raise ValueError(f"`{name}` must hold at least one partial")
    for p, a in enumerate(parts):
        if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.floating):
            raise TypeError(
                f"`{name}` must hold real floating-point arrays, got dtype {a.dtype} (partial {p})"
            )
        if a.ndim != ndim:
            raise ValueError(f"`{name}` partial {p} must have shape {one}, got {a.shape}")
    return parts


def _check_one_kernel_dtype(outs, lses):
    dtype = outs[0].dtype
    for name, parts in (("outs", outs), ("lses", lses)):
        for p, a in enumerate(parts):
            if a.dtype not in _validation.KERNEL_DTYPES:
                raise TypeError(
                    f"`{name}` partial {p} has dtype {a.dtype}; merge_attention takes float32 "
                    "or float64 (elastic_np.reference.merge_attention takes any real float)"
                )
            if a.dtype != dtype:
                raise TypeError(
                    f"`{name}` partial {p} has dtype {a.dtype}, but `outs` partial 0 has {dtype}: "
                    "the partials must share one dtype"
                )


def _check_values(name, p, what, bad, note=""):
    if bad.any():
        raise ValueError(
            f"`{name}` contains {what} (partial {p}, index {np.argwhere(bad)[0].tolist()}){note}"
        )
