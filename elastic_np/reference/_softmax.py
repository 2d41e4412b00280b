"""The softmax family in float64: softmax, log-softmax, NVM, Elastic-Softmax, the online softmax and their VJPs."""

import numpy as np

from elastic_np._contract import _validation
from elastic_np._contract._grads import sink_from_terms, sink_terms


def _logits(x, axis, check_finite, name="x"):
    check_finite = _validation.boolean(check_finite, "check_finite")
    x = _validation.real_float_array(x, name, check_finite=check_finite, allow_neg_inf=True)
    return x, _validation.reduction_axis(x, axis, name)


def _safe_max(x, axis):
    """Row maximum with ``-inf`` rows replaced by 0, so ``x - m`` never makes NaN."""
    m = np.max(x, axis=axis, keepdims=True)
    return np.where(np.isneginf(m), 0.0, m)


def softmax(x, axis=-1, *, check_finite=True):
    r"""Numerically stable softmax along ``axis``.

    .. math:: \mathrm{softmax}(x)_i = \frac{e^{x_i - m}}{\sum_j e^{x_j - m}}, \quad m = \max_j x_j

    Parameters
    ----------
    x : array_like
        Real logits of any shape; ``-inf`` marks a masked entry.
    axis : int, optional
        The axis to normalise along.
    check_finite : bool, optional
        Raise a `ValueError` for NaN or ``+inf`` in ``x`` (default).

    Returns
    -------
    ndarray of float64
        Same shape as ``x``. A row that is all ``-inf`` (nothing kept) gives
        zeros rather than NaN, matching the empty-row rule of the attention.

    Raises
    ------
    TypeError
        For integer, boolean or complex ``x``.
    ValueError
        For an empty reduction axis or non-finite values (see ``check_finite``).

    See Also
    --------
    log_softmax, elastic_softmax, online_softmax

    Examples
    --------
    >>> from elastic_np import reference as ref
    >>> ref.softmax([1.0, 2.0, 3.0]).round(6)
    array([0.090031, 0.244728, 0.665241])
    """
    x, axis = _logits(x, axis, check_finite)
    e = np.exp(x - _safe_max(x, axis))
    total = e.sum(axis=axis, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total != 0)


def log_softmax(x, axis=-1, *, check_finite=True):
    r"""Log of the softmax along ``axis``: ``x - logsumexp(x)``.

    .. math:: \log\mathrm{softmax}(x)_i = x_i - m - \log\sum_j e^{x_j - m}

    Parameters
    ----------
    x : array_like
        Real logits; ``-inf`` marks a masked entry.
    axis : int, optional
        The axis to normalise along.
    check_finite : bool, optional
        Raise a `ValueError` for NaN or ``+inf`` in ``x`` (default).

    Returns
    -------
    ndarray of float64
        Same shape as ``x``; ``-inf`` at masked entries, and ``-inf`` for a
        whole row that is all ``-inf`` (the log of the zero row `softmax` gives).

    Raises
    ------
    TypeError
        For integer, boolean or complex ``x``.
    ValueError
        For an empty reduction axis or non-finite values (see ``check_finite``).

    Examples
    --------
    >>> from elastic_np import reference as ref
    >>> ref.log_softmax([0.0, 0.0]).round(6)
    array([-0.693147, -0.693147])
    """
    x, axis = _logits(x, axis, check_finite)
    shifted = x - _safe_max(x, axis)
    # log(sum_j exp(shifted_j)) = log1p(sum of the terms other than one maximum's 1):
    # exact to rounding even when the maximum dominates and the result is near 0.
    e = np.exp(shifted)
    first_max = np.expand_dims(np.argmax(shifted, axis=axis), axis)
    np.put_along_axis(e, first_max, 0.0, axis=axis)
    empty = np.isneginf(np.max(x, axis=axis, keepdims=True))
    log_sum = np.where(empty, np.inf, np.log1p(e.sum(axis=axis, keepdims=True)))
    return shifted - log_sum


def nvm(x):
    r"""Negative Value Masking: ``x`` where ``x >= 0``, ``-inf`` where ``x < 0``.

    A ReLU in the log domain: ``exp(nvm(x)) = exp(x) * [x >= 0]``. Zero is kept.
    NaN stays NaN.

    Parameters
    ----------
    x : array_like
        Real scores.

    Returns
    -------
    ndarray of float64

    Raises
    ------
    TypeError
        For integer, boolean or complex ``x``.

    Examples
    --------
    >>> from elastic_np import reference as ref
    >>> ref.nvm([-1.0, 0.0, 2.5])
    array([-inf,  0. ,  2.5])
    """
    x = _validation.real_float_array(x, "x", check_finite=False)
    return np.where(x < 0, -np.inf, x)


def _elastic_stats(x, tau, beta, axis, use_nvm, check_finite):
    """Shared forward of `elastic_softmax` and its VJP.

    Returns ``(x_tilde, y, log_denominator)`` with ``log_denominator`` kept
    along ``axis`` (keepdims).
    """
    tau = _validation.positive_scalar(tau, "tau")
    beta = _validation.nonnegative_scalar(beta, "beta")
    use_nvm = _validation.boolean(use_nvm, "nvm")
    x, axis = _logits(x, axis, check_finite)
    x_tilde = nvm(x) if use_nvm else x
    x_max = _safe_max(x_tilde, axis)
    with np.errstate(over="ignore"):
        # shifted before the division: x / tau may overflow for a small tau
        # where (x - max x) / tau <= 0 cannot (it may go to -inf: weight 0)
        e = np.exp((x_tilde - x_max) / tau)
        m = x_max / tau  # inf when it overflows: then log D is inf and beta's term 0
    row_sum = e.sum(axis=axis, keepdims=True)
    # beta * exp(-m) as exp(log(beta) - m): it may overflow to inf (then y = 0,
    # the right limit) but never makes inf * 0; log(0) = -inf gives 0 for beta = 0.
    with np.errstate(divide="ignore", over="ignore"):
        denominator = row_sum + np.exp(np.log(beta) - m)
        log_denominator = np.logaddexp(m + np.log(row_sum), np.log(beta))
    y = np.divide(e, denominator, out=np.zeros_like(e), where=denominator != 0)
    return x_tilde, y, log_denominator, axis


def elastic_softmax(x, tau=1.0, beta=0.0, axis=-1, nvm=True, *, check_finite=True):
    r"""Elastic-Softmax: softmax of NVM-masked, temperature-scaled logits with a sink.

    .. math::

        y_i = \frac{e^{\tilde x_i/\tau}}{\sum_j e^{\tilde x_j/\tau} + \beta},
        \qquad \tilde x = \mathrm{nvm}(x) \text{ if nvm else } x

    computed in the stable form
    :math:`y_i = e^{\tilde x_i/\tau - m} / (\sum_j e^{\tilde x_j/\tau - m} + \beta e^{-m})`
    with :math:`m = \max_j \tilde x_j/\tau`.

    Parameters
    ----------
    x : array_like
        Real logits; ``-inf`` marks a masked entry.
    tau : float, optional
        Temperature, finite and ``> 0``. Any such ``tau`` is computed: the
        logits are shifted by their maximum before the division, so a
        ``tau`` for which ``x / tau`` overflows gives the limit, the argmax.
    beta : float, optional
        Offset in the denominator (an attention sink), finite and ``>= 0``.
    axis : int, optional
        The axis to normalise along.
    nvm : bool, optional
        Apply Negative Value Masking to ``x`` first (default); a bool.
    check_finite : bool, optional
        Raise a `ValueError` for NaN or ``+inf`` in ``x`` (default).

    Returns
    -------
    ndarray of float64
        Same shape as ``x``; each row sums to at most 1 (exactly 1 when
        ``beta = 0`` and something is kept). A row with nothing kept is all
        zeros, for any ``beta``.

    Raises
    ------
    ValueError
        For ``tau <= 0``, ``beta < 0``, non-finite ``tau``/``beta``, an empty
        reduction axis or non-finite ``x``.
    TypeError
        For integer, boolean or complex ``x``.

    Notes
    -----
    ``elastic_softmax(x, tau=1, beta=eps)`` is the eps-softmax
    :math:`e^{\mathrm{nvm}(x)}/(\sum e^{\mathrm{nvm}(x)} + \epsilon)`;
    ``elastic_softmax(x, nvm=False, beta=1)`` is the off-by-one softmax; and
    ``beta = exp(sink)`` is a learnable attention sink.

    Examples
    --------
    >>> from elastic_np import reference as ref
    >>> ref.elastic_softmax([-1.0, 0.0, 1.0], beta=1.0).round(6)
    array([0.      , 0.211942, 0.576117])
    """
    return _elastic_stats(x, tau, beta, axis, nvm, check_finite)[1]


def online_softmax(x, block_size=None, axis=-1, *, check_finite=True):
    r"""Softmax by the streaming (online) algorithm, element or block at a time.

    One pass over ``x`` keeps a running maximum ``m`` and a running sum
    ``l = sum_j exp(x_j - m)``; when a new block raises the maximum to
    ``m'``, the sum is rescaled exactly:

    .. math:: l \leftarrow l\, e^{m - m'} + \sum_{j \in \text{block}} e^{x_j - m'}

    A second, independent pass writes ``exp(x - m) / l``.

    Parameters
    ----------
    x : array_like
        Real logits; ``-inf`` marks a masked entry.
    block_size : int or None, optional
        ``None`` streams one element at a time; a positive integer streams
        blocks of that many elements (the last one may be shorter).
    axis : int, optional
        The axis to normalise along.
    check_finite : bool, optional
        Raise a `ValueError` for NaN or ``+inf`` in ``x`` (default).

    Returns
    -------
    ndarray of float64
        Equal to ``softmax(x, axis)`` up to rounding.

    Raises
    ------
    TypeError
        For a non-integer ``block_size`` or integer, boolean or complex ``x``.
    ValueError
        For ``block_size < 1``, an empty reduction axis or non-finite values.

    Examples
    --------
    >>> from elastic_np import reference as ref
    >>> ref.online_softmax([1.0, 2.0, 3.0], block_size=2).round(6)
    array([0.090031, 0.244728, 0.665241])
    """
    x, axis = _logits(x, axis, check_finite)
    if block_size is None:
        block_size = 1
    elif isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"`block_size` must be a positive integer or None, got {block_size!r}")
    elif block_size < 1:
        raise ValueError(f"`block_size` must be a positive integer or None, got {block_size!r}")
    xs = np.moveaxis(x, axis, -1)
    length = xs.shape[-1]
    m = np.full(xs.shape[:-1], -np.inf)
    l = np.zeros(xs.shape[:-1])
    for start in range(0, length, block_size):
        block = xs[..., start : start + block_size]
        m_new = np.maximum(m, block.max(axis=-1))
        m_ref = np.where(np.isneginf(m_new), 0.0, m_new)  # all -inf so far: nothing to rescale
        l = l * np.exp(m - m_ref) + np.exp(block - m_ref[..., None]).sum(axis=-1)
        m = m_new
    m_ref = np.where(np.isneginf(m), 0.0, m)[..., None]
    e = np.exp(xs - m_ref)
    y = np.divide(e, l[..., None], out=np.zeros_like(e), where=l[..., None] != 0)
    return np.moveaxis(y, -1, axis)


def softmax_vjp(y, dy, axis=-1):
    r"""Vector-Jacobian product of `softmax`: the gradient of ``sum(dy * y)``.

    .. math:: dx = y \odot (dy - \textstyle\sum_j dy_j y_j)

    Parameters
    ----------
    y : array_like
        The softmax output.
    dy : array_like
        The cotangent, same shape as ``y``.
    axis : int, optional
        The axis `softmax` normalised along.

    Returns
    -------
    ndarray of float64
        ``dx``, same shape as ``y``.

    Raises
    ------
    TypeError
        For integer, boolean or complex ``y`` or ``dy``.
    ValueError
        For shapes that differ, an empty reduction axis or non-finite values.

    Examples
    --------
    >>> from elastic_np import reference as ref
    >>> y = ref.softmax([0.0, 0.0])
    >>> ref.softmax_vjp(y, [1.0, 0.0])
    array([ 0.25, -0.25])
    """
    y = _validation.real_float_array(y, "y")
    dy = _validation.real_float_array(dy, "dy")
    if y.shape != dy.shape:
        raise ValueError(f"`dy` shape {dy.shape} != `y` shape {y.shape}")
    axis = _validation.reduction_axis(y, axis, "y")
    return y * (dy - np.sum(dy * y, axis=axis, keepdims=True))


def elastic_softmax_vjp(x, dy, tau=1.0, beta=0.0, axis=-1, nvm=True, *, check_finite=True):
    r"""Vector-Jacobian product of `elastic_softmax` with respect to ``x``, ``tau``, ``beta``.

    With ``y`` the output, :math:`\delta = \sum_j dy_j y_j` per row and
    :math:`dz = y \odot (dy - \delta)` on kept entries (0 elsewhere):

    .. math::

        dx = dz / \tau, \qquad
        d\tau = -\frac{1}{\tau^2} \sum_{\text{kept}} dz \, \tilde x, \qquad
        d\beta = -\sum_{\text{rows}} \delta / D

    where :math:`D = \sum_j e^{\tilde x_j/\tau} + \beta` is the row's denominator.

    Parameters
    ----------
    x : array_like
        The logits given to `elastic_softmax`.
    dy : array_like
        The cotangent, same shape as ``x``.
    tau, beta, axis, nvm, check_finite
        As for `elastic_softmax`.

    Returns
    -------
    dx : ndarray of float64
        Same shape as ``x``; 0 at entries removed by NVM or ``-inf``.
    dtau : float
        Summed over every row, since ``tau`` is shared.
    dbeta : float
        Summed over every row; a row with nothing kept and ``beta = 0``
        contributes 0.

    Raises
    ------
    TypeError, ValueError
        As for `elastic_softmax`; a `ValueError` also when ``dy``'s shape differs.

    Examples
    --------
    >>> from elastic_np import reference as ref
    >>> dx, dtau, dbeta = ref.elastic_softmax_vjp([1.0, 2.0], [1.0, 0.0], beta=0.5)
    >>> round(dbeta, 6)
    -0.024159
    """
    x_tilde, y, log_denominator, axis = _elastic_stats(x, tau, beta, axis, nvm, check_finite)
    dy = _validation.real_float_array(dy, "dy")
    if dy.shape != y.shape:
        raise ValueError(f"`dy` shape {dy.shape} != `x` shape {y.shape}")
    tau = float(tau)
    kept = ~np.isneginf(x_tilde)
    delta = np.sum(dy * y, axis=axis, keepdims=True)
    dz = np.where(kept, y * (dy - delta), 0.0)
    dx = dz / tau
    # divided twice: tau**2 underflows for tau < 1.5e-154
    dtau = -(np.sum(dz * np.where(kept, x_tilde, 0.0)) / tau) / tau
    # -sum delta / D = -sum delta exp(-log D), relative to its largest factor (see
    # `sink_gradient`): rows of both signs whose exp(-log D) overflows give inf, not NaN
    dbeta = sink_from_terms(*sink_terms(delta, log_denominator, None))
    return dx, float(dtau), float(dbeta)
