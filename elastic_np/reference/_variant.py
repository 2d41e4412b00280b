"""A user's ``score_mod`` and ``mask_mod`` in the oracle: the Python functions called entry by entry.

The forward calls the user's functions themselves, on the scores in the
dtype of the computation and Python ints for the indices; the backward
takes the score's gradient through ``score_mod`` by its exact derivative
(`elastic_np._variants.derivative`, evaluated on NumPy arrays), which
gives the captures' gradients too.
"""

import numpy as np

from elastic_np._variants.derivative import differentiate


def has_score(p):
    """Whether problem ``p`` has a user's ``score_mod``."""
    return p.variant is not None and p.variant.score_mod is not None


def has_mask(p):
    """Whether problem ``p`` has a user's ``mask_mod`` (its own or its block mask's)."""
    return p.variant is not None and p.variant.mask_mod is not None


def _indices(shape, batch_offset=0):
    """Broadcastable ``b, h, i, j`` index arrays of a ``(B, H, N, M)`` problem (``b`` from ``batch_offset``)."""
    B, H, N, M = shape
    return (np.arange(batch_offset, batch_offset + B).reshape(B, 1, 1, 1), np.arange(H).reshape(1, H, 1, 1),
            np.arange(N).reshape(1, 1, N, 1), np.arange(M).reshape(1, 1, 1, M))


def modified_scores(p, s):
    """``score_mod`` on every score ``s`` ``(B, H, N, M)`` above ``-inf`` (a ``-inf`` bias's stay removed)."""
    fn, captures, t = p.variant.score_mod, p.variant.captures, s.dtype.type
    # the score as a NumPy scalar of the computation's dtype: a Python float would take a float32 capture's
    # dtype in NumPy's promotion (a float64 oracle computing in float32)
    ufunc = np.frompyfunc(lambda x, b, h, i, j: fn(t(x), b, h, i, j, *captures), 5, 1)
    values = ufunc(s, *_indices(s.shape, p.variant.batch_offset))
    try:
        values = values.astype(s.dtype)
    except (TypeError, ValueError):
        kinds = sorted({type(x).__name__ for x in values.flat})
        raise TypeError(f"`score_mod` must return a real number; it returned {', '.join(kinds)}") from None
    return np.where(s > -np.inf, values, s)


def mask_keep(p, shape):
    """Boolean ``shape = (B, H, N, M)``: ``mask_mod`` on every entry."""
    fn, captures = p.variant.mask_mod, p.variant.captures
    ufunc = np.frompyfunc(lambda b, h, i, j: fn(b, h, i, j, *captures), 4, 1)
    values = np.broadcast_to(ufunc(*_indices(shape, p.variant.batch_offset)), shape)
    if not all(_is_bool(x) for x in values.flat):
        kinds = sorted({type(x).__name__ for x in values.flat if not _is_bool(x)})
        raise TypeError(f"`mask_mod` must return a bool (True keeps the entry); it returned {', '.join(kinds)}")
    return values.astype(bool)


def _is_bool(x):
    """Whether ``x`` is a bool: Python's, NumPy's, or a 0-d bool array (``numpy.where`` of scalars)."""
    return isinstance(x, (bool, np.bool_)) or (isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype == bool)


def score_gradient(p, s_before, ds):
    """``(ds_before, dcaptures)``: the gradient ``ds`` of the modified scores taken through ``score_mod``.

    ``s_before``: the scores ``score_mod`` was given; ``ds``: zero where an
    entry is removed (its derivative is then not evaluated there). The
    captures' gradients come in their dtypes (None for an integer or bool one).
    """
    variant = p.variant
    derivative = differentiate(variant.score_mod, variant.captures)
    where = ds != 0
    at = np.nonzero(where)
    index = _indices(ds.shape, variant.batch_offset)
    picked = [np.broadcast_to(a, ds.shape)[at] for a in index]
    value, d_before, dcaptures = derivative.numpy(
        s_before[at].astype(np.float64), *picked, variant.captures, ds[at].astype(np.float64))
    ds_before = np.zeros_like(ds)
    ds_before[at] = d_before
    dcaptures = tuple(None if d is None else d.astype(c.dtype) for d, c in zip(dcaptures, variant.captures))
    return ds_before, dcaptures


def check_modified(p, s, keep):
    """A `ValueError` where ``score_mod`` gave NaN or ``+inf`` to an entry ``keep`` keeps (NVM's ``s >= 0``, which
    a NaN fails, included; ``-inf`` removes an entry)."""
    if not (np.where(keep, s, s.dtype.type(0)) < np.inf).all():
        raise ValueError("`score_mod` returned NaN or +inf for an entry that is kept: every kept score must be "
                         "finite (return -inf to remove an entry)")
