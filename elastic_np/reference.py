"""Float64 oracles: the definitions every backend of elastic_np is held to.

Everything here is plain NumPy, computes in float64 and returns float64,
whatever the input precision. The functions favour being obviously right over
being fast; the attention oracle materialises the full ``(B, H, N, M)`` score
matrix and is meant for the sizes a test uses.

Non-finite inputs follow SciPy's ``check_finite=True`` habit: by default a NaN
or ``+inf`` logit raises a `ValueError`, while ``-inf`` is accepted as a masked
entry (it gets weight 0). With ``check_finite=False`` nothing is checked and a
NaN propagates to the rows it touches.
"""

import dataclasses

import numpy as np

from elastic_np import _validation
from elastic_np._merge import merge_attention_float64 as merge_attention
from elastic_np._options import OPTION_NAMES, AttentionGrads, prepare, sink_from_terms, sink_terms

__all__ = [
    "softmax",
    "log_softmax",
    "nvm",
    "elastic_softmax",
    "online_softmax",
    "softmax_vjp",
    "elastic_softmax_vjp",
    "attention",
    "attention_backward",
    "merge_attention",
]


# ---------------------------------------------------------------------------
# Vector functions
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------


def scores(p):
    """The final score ``s`` of every entry and the soft-cap's slope.

    ``s = softcap tanh(scale q.k / softcap) - slope |j - i - (M - N)| + bias``
    in that order (each term only when its option is given), ``(B, H, N, M)``;
    ``-inf`` where the bias is ``-inf``. The slope ``ds / ds_raw = 1 - tanh^2``
    is returned with it (None without a soft-cap).
    """
    B, H, Hkv, N, M, D, Dv = p.shape
    k = np.repeat(p.k, p.group_size, axis=1)  # query head h reads kv head h // group_size
    # an overflow is either harmless (-inf: weight 0) or found by `_attention_logits`
    with np.errstate(over="ignore"):
        s = p.scale * np.einsum("bhnd,bhmd->bhnm", p.q, k)
        cap_slope = None
        if p.softcap is not None:
            x = s / p.softcap
            s = p.softcap * np.tanh(x)
            cap_slope = _tanh_slope(x)
        if p.alibi is not None:
            s = s - p.alibi[:, :, None, None] * np.abs(_offsets(p))
        if p.bias is not None:
            s = s + p.bias
    return s, cap_slope


def _attention_logits(p):
    """Scores ``s``, logits ``z`` (``-inf`` where removed), keep mask, gate and cap terms.

    ``s`` is the final score (see `scores`), the one NVM tests and ``tau``
    divides; it is set to 0 where the bias removes an entry. Returns
    ``(s, z, keep, gate, cap_slope)`` with ``gate = (G, f, x)`` or None.
    """
    s, cap_slope = scores(p)
    keep = structural_keep(p)
    if p.bias is not None:
        keep = keep & (p.bias > -np.inf)  # a -inf bias removes the entry, like a mask
        s = np.where(keep, s, 0.0)  # and stays out of the dtau sum
    if p.nvm:
        keep = keep & (s >= 0)
    with np.errstate(over="ignore"):
        z = s / p.tau[:, None, None]
    if not (np.where(keep, z, 0.0) < np.inf).all():  # +inf or NaN where kept
        raise ValueError(
            "the logits `scale * q . k / tau` (with the score modifiers) overflow float64: "
            "reduce `scale` or the inputs, or raise `tau`"
        )
    gate = None
    if p.sigma is not None:
        G, f, x = window_gate(p)
        keep = keep & (G > 0)
        with np.errstate(divide="ignore"):
            z = z + np.log(G)
        gate = (G, f, x)
    z = np.where(keep, z, -np.inf)
    return s, z, keep, gate, cap_slope


def _offsets(p):
    """``(B, 1, N, M)`` offsets ``j - i - (E_b - N)`` of key ``j`` from query ``i``.

    ``E_b = p.kv_ends[b]`` is where the last query sits: ``M`` (bottom-right
    aligned to the array) or ``kv_lengths[b]`` (to the sequence).
    """
    B, H, Hkv, N, M, D, Dv = p.shape
    shift = (p.kv_ends - N)[:, None, None, None]
    return np.arange(M)[None, None, None, :] - np.arange(N)[None, None, :, None] - shift


def structural_keep(p):
    """Boolean ``(B, H, N, M)``: causal, ``window_size``, ``kv_lengths`` and ``mask`` together."""
    B, H, Hkv, N, M, D, Dv = p.shape
    off = _offsets(p)
    keep = np.ones(off.shape, dtype=bool)
    if p.causal:
        keep &= off <= 0
    left, right = p.window
    if left >= 0:
        keep &= off >= -left
    if right >= 0:
        keep &= off <= right
    keep &= np.arange(M) < p.kv_lengths[:, None, None, None]
    keep = np.broadcast_to(keep, (B, H, N, M))
    if p.mask is not None:
        keep = keep & p.mask
    return keep


def window_position(p):
    """The dynamic window's position ``x = 2 off / (E_b - 1)``, ``(B, 1, N, M)``.

    ``off`` is the offset of `_offsets` and ``E_b = kv_ends[b]`` (``x = 0``
    where ``E_b <= 1``).
    """
    ends = p.kv_ends[:, None, None, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ends > 1, 2.0 * _offsets(p) / (ends - 1), 0.0)


def _tanh_slope(x):
    """``1 - tanh(x)**2`` in the dtype of ``x``, as ``4 e / (1 + e)**2`` with ``e = exp(-2|x|)``.

    ``1 - t * t`` cancels to nothing once ``t`` rounds to 1 (``|x|`` above
    about 19 in float64, 9 in float32); this form is accurate for every ``x``.
    """
    e = np.exp(-2 * np.abs(x))
    return 4 * e / (1 + e) ** 2


def _log_tanh_slope(y):
    """``d log tanh(y) / dy = (1 - tanh(y)**2) / tanh(y)`` for ``y > 0``, in the dtype of ``y``.

    Evaluated as ``4 e / (1 - e**2)`` with ``e = exp(-2y)`` and ``1 - e**2``
    from ``expm1``: neither the cancellation of ``1 - tanh**2`` nor the
    overflow of ``2 / sinh(2y)``.
    """
    return 4 * np.exp(-2 * y) / -np.expm1(-4 * y)


def window_gate(p):
    """The dynamic window: gate ``G``, bell ``f`` (before thresholding) and position ``x``.

    ``G`` and ``f`` are ``(B, H, N, M)``; ``x`` is `window_position`'s.
    """
    x = window_position(p)
    sigma = p.sigma[:, :, None, None]
    with np.errstate(over="ignore"):
        u = x / sigma  # divided first: sigma**2 underflows for sigma < 1.5e-154
        f = np.exp(-0.5 * (u * u)) / (sigma * np.sqrt(2 * np.pi))
    G = np.tanh(p.sharpness * np.where(f > p.threshold, f, 0.0))
    return G, f, x


def attention(q, k, v, **options):
    r"""Float64 attention oracle: ``(out, lse)`` for every option of the contract.

    For batch ``b``, head ``h``, query ``i`` and key ``j``:

    .. math::

        s_{ij} = \mathrm{scale}\; q_i \cdot k_j, \quad
        z_{ij} = s_{ij}/\tau_h + \log G_{ij}, \quad
        \mathrm{lse}_i = \log\Big(\sum_{j\,\mathrm{kept}} e^{z_{ij}} + \beta_h\Big), \quad
        \mathrm{out}_i = \sum_{j\,\mathrm{kept}} e^{z_{ij} - \mathrm{lse}_i} v_j

    With the score modifiers, ``s`` is the final score of `scores`: the
    soft-cap ``softcap * tanh(s / softcap)``, then ``- slope |i + M - N - j|``
    (ALiBi) and ``+ bias``. With ``align="kv_lengths"`` every ``M`` in the
    offsets (causal, window, ALiBi, the dynamic window) reads ``kv_lengths[b]``. An entry is kept when the causal, window,
    ``kv_lengths`` and ``mask`` conditions hold, the bias is not ``-inf``,
    ``s_ij >= 0`` under ``nvm=True``, and the dynamic window's gate is open. A row with nothing kept gives ``out = 0`` and
    ``lse = log(beta)`` (``-inf`` for ``beta = 0``).

    Parameters
    ----------
    q : array_like, shape (B, H, N, D)
    k : array_like, shape (B, Hkv, M, D)
    v : array_like, shape (B, Hkv, M, Dv)
        ``H`` must be a multiple of ``Hkv``; query head ``h`` reads key/value
        head ``h // (H // Hkv)``.
    **options
        ``scale=None`` (``1/sqrt(D)``), ``causal=False`` (bottom-right
        aligned: ``j <= i + M - N``), ``window_size=(-1, -1)``,
        ``kv_lengths=None``, ``align="array"`` (or ``"kv_lengths"``), ``mask=None`` (boolean, broadcastable to
        ``(B, H, N, M)``, True keeps), ``nvm=False``, ``tau=1.0``,
        ``beta=0.0`` (scalars or shape ``(H,)``), ``dynamic_window=None``
        (a `~elastic_np.DynamicWindow`), ``softcap=None`` (float ``> 0``),
        ``alibi_slopes=None`` (``(H,)`` or ``(B, H)``), ``bias=None`` (float,
        broadcastable to ``(B, H, N, M)``; ``-inf`` removes an entry),
        ``check_finite=True``. Any other keyword is a `TypeError`.

    Returns
    -------
    out : ndarray of float64, shape (B, H, N, Dv)
    lse : ndarray of float64, shape (B, H, N)

    Raises
    ------
    TypeError
        For non-float ``q``, ``k``, ``v``, a non-boolean ``mask``, integer-free
        ``kv_lengths``, a ``dynamic_window`` that is not a `DynamicWindow`,
        a ``causal``, ``nvm`` or ``check_finite`` that is not a bool, or an
        unknown keyword.
    ValueError
        For inconsistent shapes, non-finite inputs or an out-of-range option
        (options and the factors ``scale / tau``, ``softcap / tau``,
        ``slope / tau`` must be normal float64 numbers, see
        :ref:`contract-rejected`), or logits ``s / tau`` that overflow
        float64; the message names the parameter.

    Examples
    --------
    >>> import numpy as np
    >>> from elastic_np import reference as ref
    >>> q = k = v = np.ones((1, 1, 2, 4))
    >>> out, lse = ref.attention(q, k, v, causal=True)
    >>> out[0, 0]
    array([[1., 1., 1., 1.],
           [1., 1., 1., 1.]])
    >>> lse.round(6)
    array([[[2.      , 2.693147]]])
    """
    p = prepare(q, k, v, **_attention_options(options, "attention"))
    return _forward(p)


def _attention_options(options, function):
    """``options`` when each is an attention option or ``check_finite``; else a `TypeError`.

    `prepare` also takes private keywords (``dtypes``, ``defer_bias_check``,
    ``defer_kv_check``) that must not reach it from here.
    """
    for name in options:
        if name not in OPTION_NAMES and name != "check_finite":
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    return options


def _without_padding(p):
    """``p`` with the keys and values past each ``kv_lengths[b]`` set to 0: padding is never read."""
    M = p.k.shape[2]
    if (p.kv_lengths == M).all():
        return p
    kept = np.arange(M)[None, None, :, None] < p.kv_lengths[:, None, None, None]
    return dataclasses.replace(p, k=np.where(kept, p.k, 0.0), v=np.where(kept, p.v, 0.0))


def _forward(p):
    p = _without_padding(p)
    s, z, keep, gate, cap_slope = _attention_logits(p)
    lse = _log_denominator(z, p.beta)
    with np.errstate(invalid="ignore"):
        probs = np.where(keep, np.exp(z - lse[..., None]), 0.0)
    v = np.repeat(p.v, p.group_size, axis=1)
    return probs @ v, lse


def _log_denominator(z, beta):
    """``log(sum_j exp(z_ij) + beta_h)`` per row, stable; ``log(beta)`` for an empty row."""
    m = np.max(z, axis=-1, keepdims=True, initial=-np.inf)  # M = 0: every row is empty
    m = np.where(np.isneginf(m), 0.0, m)
    row_sum = np.exp(z - m).sum(axis=-1)
    with np.errstate(divide="ignore"):
        return np.logaddexp(m[..., 0] + np.log(row_sum), np.log(beta)[:, None])


def attention_backward(dout, q, k, v, out, lse, **options):
    r"""Hand-derived backward of `attention`: gradients for ``q, k, v, tau, beta, sigma, bias``.

    With :math:`p_{ij} = e^{z_{ij} - \mathrm{lse}_i}` on kept entries:

    .. math::

        dP_{ij} = dout_i \cdot v_j, \quad \delta_i = dout_i \cdot out_i, \quad
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
    **options
        The same options as the forward.

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
        As for `attention`, and for ``dout``, ``out``, ``lse`` of the wrong
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
    p = prepare(q, k, v, **_attention_options(options, "attention_backward"))
    dout, out, lse = check_backward_arrays(p, dout, out, lse, dtype=np.float64)
    return _backward(p, dout, out, lse)


def check_backward_arrays(p, dout, out, lse, dtype=None):
    """Validate ``dout``, ``out``, ``lse`` against the problem's shapes.

    ``dtype=None`` requires the problem's dtype (the kernels); a dtype
    converts to it (the reference).
    """
    arrays = []
    for (name, shape), a in zip(p.backward_shapes, (dout, out, lse)):
        a = np.asarray(a)
        _validation.check_real_float_dtype(a, name)
        if a.shape != shape:
            raise ValueError(f"`{name}` must have shape {shape}, got {a.shape}")
        if dtype is None and a.dtype != p.dtype:
            raise TypeError(f"`{name}` has dtype {a.dtype}, expected {p.dtype} like `q`")
        bad = np.isnan(a) | (a == np.inf) if name == "lse" else ~np.isfinite(a)
        if bad.any():
            raise ValueError(f"`{name}` contains NaN or inf")
        arrays.append(a.astype(dtype, copy=False) if dtype is not None else a)
    return arrays


def _backward(p, dout, out, lse):
    B, H, Hkv, N, M, D, Dv = p.shape
    p = _without_padding(p)
    s, z, keep, gate, cap_slope = _attention_logits(p)
    with np.errstate(invalid="ignore"):
        probs = np.where(keep, np.exp(z - lse[..., None]), 0.0)
    k = np.repeat(p.k, p.group_size, axis=1)
    v = np.repeat(p.v, p.group_size, axis=1)

    dP = dout @ np.swapaxes(v, -1, -2)
    delta = np.sum(dout * out, axis=-1)
    dz = probs * (dP - delta[..., None])  # zero where not kept, since probs is
    ds = dz / p.tau[:, None, None]  # d loss / d s, the final score: also dbias
    ds_raw = ds if cap_slope is None else ds * cap_slope

    dq = p.scale * ds_raw @ k
    dk_h = p.scale * np.swapaxes(ds_raw, -1, -2) @ p.q
    dv_h = np.swapaxes(probs, -1, -2) @ dout
    dk = dk_h.reshape(B, Hkv, p.group_size, M, D).sum(axis=2)
    dv = dv_h.reshape(B, Hkv, p.group_size, M, Dv).sum(axis=2)

    # only entries with weight: a score of -inf (a slope |off| beyond float64)
    # has p = dz = 0 and no term; divided twice, as tau**2 may underflow
    with np.errstate(invalid="ignore"):
        dz_s = np.where(probs > 0, dz * s, 0.0)
    dtau = -(np.sum(dz_s, axis=(0, 2, 3)) / p.tau) / p.tau
    dbeta = p.sink_gradient(delta, lse)

    dsigma = None
    if gate is not None:
        G, f, x = gate
        sigma = p.sigma[:, :, None, None]
        # d log G / dsigma = (d log G / dy) sharpness df/dsigma at y = sharpness f
        # (where G = 0, y = sharpness: any finite value, removed by keep)
        y = p.sharpness * np.where(G > 0, f, 1.0)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            u = x / sigma  # (x^2 / sigma^3 - 1 / sigma) without sigma**3, which underflows
            dlogG = p.sharpness * _log_tanh_slope(y) * f * ((u * u - 1) / sigma)
        dsigma = np.sum(dz * np.where(keep, dlogG, 0.0), axis=(2, 3))
    return p.reduce_grads(dq, dk, dv, dtau, dbeta, dsigma, dbias=ds)
