"""`elastic_np.merge_attention`: the float64 merge of `elastic_np.reference.merge_attention`
rounded to the partials' dtype (float32 or float64)."""

from elastic_np.reference._merge import _merge, _validate


def merge_attention(outs, lses, *, beta=0.0):
    r"""Combine attention over disjoint key sets into the attention over their union.

    Given partials ``(out_p, lse_p)`` that `attention` returned (with
    ``return_lse=True``) over disjoint sets of keys, each with ``beta = 0``,
    returns what it would return over the union of the keys with ``beta``:

    .. math::

        \mathrm{lse} = \log\Big(\sum_p e^{\mathrm{lse}_p} + \beta_h\Big), \qquad
        \mathrm{out} = \sum_p e^{\mathrm{lse}_p - \mathrm{lse}}\, \mathrm{out}_p .

    This is the block update of the online softmax made an API: for
    split-KV, KV caches kept in pieces and distributed attention. The
    computation is in float64, stable for any spread of the ``lse_p``.

    Parameters
    ----------
    outs : sequence of array_like, or ndarray
        The partial outputs, each of shape ``(B, H, N, Dv)``, or one array of
        shape ``(P, B, H, N, Dv)`` whose leading axis runs over the partials.
    lses : sequence of array_like, or ndarray
        Their log-denominators, each ``(B, H, N)``, or one ``(P, B, H, N)``
        array; computed with ``beta = 0``. ``-inf`` marks a row for which a
        partial kept no key: that partial contributes nothing to the row
        (its ``out`` there gets weight 0).
    beta : float or array_like of shape (H,), optional
        The sink, finite and ``>= 0``, added once to the merged denominator.

    Returns
    -------
    out : ndarray, shape (B, H, N, Dv)
    lse : ndarray, shape (B, H, N)
        In the partials' dtype, float32 or float64. A row that no partial
        kept a key for gives ``out = 0`` and ``lse = log(beta)`` (``-inf``
        for ``beta = 0``), the attention's empty-row rule.

    Raises
    ------
    TypeError
        For ``outs`` or ``lses`` that are neither a list, a tuple nor an
        array; partials that are not float32 or float64 or do not all share
        one dtype; a ``beta`` that is not a real number or array.
    ValueError
        For no partial, different numbers of ``outs`` and ``lses``,
        mismatched shapes, NaN or inf in ``outs``, NaN or ``+inf`` in
        ``lses``, a negative or non-finite ``beta``; the message names the
        argument.

    See Also
    --------
    elastic_np.reference.merge_attention : The same in float64, for any real float dtype.

    Notes
    -----
    The partials must be computed with ``beta = 0``: the sink belongs to the
    denominator of the whole row, and partials that each added it would
    count it once per partial. The arrays passed are never written to.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    >>> parts = [enp.attention(q, k[:, :, keys], v[:, :, keys], return_lse=True, backend="reference")
    ...          for keys in (slice(0, 1), slice(1, 3))]
    >>> outs, lses = zip(*parts)
    >>> out, lse = enp.merge_attention(outs, lses, beta=0.5)
    >>> want, want_lse = enp.attention(q, k, v, beta=0.5, return_lse=True, backend="reference")
    >>> bool(np.allclose(out, want, rtol=1e-13, atol=0) and np.allclose(lse, want_lse, rtol=1e-13))
    True
    """
    outs, lses, beta = _validate(outs, lses, beta, kernel_dtypes=True)
    out, lse = _merge(outs, lses, beta)
    dtype = outs[0].dtype
    return out.astype(dtype, copy=False), lse.astype(dtype, copy=False)
