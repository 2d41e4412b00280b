"""The attention forward: scores, masks, the dynamic window and ``(out, lse)``.

The functions taking a prepared problem ``p`` compute in the dtype of
``p.q`` (the options are cast to it): float64 for the oracle, and the dtype
under test for the conformance kit's naive evaluation, whose error sets the
float32 tolerances. One formula serves both.
"""

import dataclasses

import numpy as np

from elastic_np._contract import _spec
from elastic_np._contract._problem import prepare
from elastic_np._variants.variant import make_variant
from elastic_np.reference import _variant as variant


def scores(p):
    """The final score ``s`` of every entry and the soft-cap's slope.

    ``s = softcap tanh(scale q.k / softcap) - slope |j - i - (M - N)| + bias``
    in that order (each term only when its option is given), ``(B, H, N, M)``;
    ``-inf`` where the bias is ``-inf``. The slope ``ds / ds_raw = 1 - tanh^2``
    is returned with it (None without a soft-cap).
    """
    t = p.q.dtype.type
    k = np.repeat(p.k, p.group_size, axis=1)  # query head h reads kv head h // group_size
    with np.errstate(over="ignore"):
        return modify_scores(p, t(p.scale) * np.einsum("bhnd,bhmd->bhnm", p.q, k))


def modify_scores(p, s):
    """The score modifiers on the scaled products ``s``: ``(final score, cap slope)``, see `scores`."""
    t = s.dtype.type
    # an overflow is either harmless (-inf: weight 0) or found by `_attention_logits`
    with np.errstate(over="ignore"):
        cap_slope = None
        if p.softcap is not None:
            cap = t(p.softcap)
            x = s / cap
            s = cap * np.tanh(x)
            cap_slope = _tanh_slope(x)
        if p.alibi is not None:
            distance = np.abs(_offsets(p)).astype(s.dtype)
            s = s - p.alibi.astype(s.dtype)[:, :, None, None] * distance
        if p.bias is not None:
            s = s + p.bias.astype(s.dtype)
    return s, cap_slope


def _attention_logits(p):
    """Scores ``s``, logits ``z`` (``-inf`` where removed), keep mask, gate and cap terms.

    ``s`` is the final score (see `scores`), the one NVM tests and ``tau``
    divides; it is set to 0 where the bias removes an entry. Returns
    ``(s, z, keep, gate, cap_slope)`` with ``gate = (G, f, x)`` or None.
    """
    s, cap_slope = scores(p)
    t = s.dtype.type
    if variant.has_score(p):
        s = variant.modified_scores(p, s)
    s, keep = kept_scores(p, s)
    if variant.has_score(p):
        variant.check_modified(p, s, keep)
    with np.errstate(over="ignore"):
        z = s / p.tau.astype(s.dtype)[:, None, None]
    if not (np.where(keep, z, t(0)) < np.inf).all():  # +inf or NaN where kept
        raise ValueError(
            f"the logits `scale * q . k / tau` (with the score modifiers) overflow {s.dtype}: "
            "reduce `scale` or the inputs, or raise `tau`"
        )
    gate = None
    if p.sigma is not None:
        G, f, x = window_gate(p)
        keep = keep & (G > 0)
        with np.errstate(divide="ignore"):
            z = z + np.log(G)
        gate = (G, f, x)
    z = np.where(keep, z, t(-np.inf))
    return s, z, keep, gate, cap_slope


def kept_scores(p, s):
    """``(s, keep)``: the final scores ``s`` with 0 where the bias removes an entry, and the keep mask.

    The mask of `structural_keep`, less the entries a ``-inf`` bias removes
    and, under NVM, those with ``s < 0``; without the gate.
    """
    keep = structural_keep(p)
    if p.bias is not None:
        keep = keep & (p.bias > -np.inf)  # a -inf bias removes the entry, like a mask
    if variant.has_score(p):
        keep = keep & (s != -np.inf)  # as does a user's score_mod returning -inf (a NaN kept is an error)
    if p.bias is not None or variant.has_score(p):
        s = np.where(keep, s, s.dtype.type(0))  # and stays out of the dtau sum
    if p.nvm:
        keep = keep & (s >= 0)
    return s, keep


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
    if variant.has_mask(p):
        keep = keep & variant.mask_keep(p, (B, H, N, M))
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


def log_tanh_elasticity(y):
    """``d log tanh(y) / d log y = y (1 - tanh(y)**2) / tanh(y) = 2y / sinh(2y)`` for ``y > 0``, in ``y``'s dtype.

    It falls from 1 (``y -> 0``) to 0; ``d log G / d sigma`` is this times
    ``d log f / d sigma = (u^2 - 1) / sigma`` (`dlog_gate`), which ``f``
    itself no longer enters. Evaluated as ``(w / (1 - e^2)) e`` with ``w =
    4y``, ``e = exp(-2y)`` and ``1 - e^2`` from ``expm1``: no cancellation
    of ``1 - tanh**2`` as ``y`` grows, and no ``1 / y`` to overflow as ``y``
    reaches the subnormals (``w / -expm1(-w)`` is exactly 1 there). Where
    ``e`` underflows (the true value is below the dtype's smallest
    subnormals) it is 0.
    """
    w = 4 * y
    e = np.exp(-2 * y)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(e > 0, w / -np.expm1(-w) * e, y.dtype.type(0))


def window_gate(p):
    """The dynamic window: gate ``G``, bell ``f`` (before thresholding) and position ``x``.

    ``G`` and ``f`` are ``(B, H, N, M)``; ``x`` is `window_position`'s. All
    three are in the dtype of ``p.q``.
    """
    dtype = p.q.dtype
    t = dtype.type
    x = window_position(p).astype(dtype, copy=False)
    sigma = p.sigma.astype(dtype)[:, :, None, None]
    with np.errstate(over="ignore"):
        u = x / sigma  # divided first: sigma**2 underflows for sigma < 1.5e-154
        f = np.exp(-0.5 * (u * u)) / (sigma * t(np.sqrt(2 * np.pi)))
    G = np.tanh(t(p.sharpness) * np.where(f > t(p.threshold), f, t(0)))
    return G, f, x


@_spec.takes_options()
def attention(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, captures=(), check_finite=True, **options):
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
    %(options)s
    check_finite : bool, optional
        Reject NaN and inf in the inputs (``-inf`` in ``bias`` removes an
        entry); False checks no value.

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
    p = with_variant(prepare(q, k, v, check_finite=check_finite, **_spec.complete(options, "attention")),
                     score_mod, mask_mod, block_mask, captures)
    out, lse = _forward(p)
    return p.as_given(out), lse


def with_variant(p, score_mod, mask_mod, block_mask, captures):
    """Problem ``p`` with a user's functions (`elastic_np._variants.variant.make_variant`), if any."""
    made = make_variant(score_mod, mask_mod, block_mask, captures)
    return p if made is None else p.with_variant(made)


def without_padding(p):
    """``p`` with the keys and values past each ``kv_lengths[b]`` set to 0: padding is never read."""
    M = p.k.shape[2]
    if (p.kv_lengths == M).all():
        return p
    kept = np.arange(M)[None, None, :, None] < p.kv_lengths[:, None, None, None]
    return dataclasses.replace(p, k=np.where(kept, p.k, 0.0), v=np.where(kept, p.v, 0.0))


def _forward(p):
    p = without_padding(p)
    s, z, keep, gate, cap_slope = _attention_logits(p)
    lse = _log_denominator(z, p.beta)
    with np.errstate(invalid="ignore"):
        probs = np.where(keep, np.exp(z - lse[..., None]), z.dtype.type(0))
    v = np.repeat(p.v, p.group_size, axis=1)
    return probs @ v, lse


def _log_denominator(z, beta):
    """``log(sum_j exp(z_ij) + beta_h)`` per row, stable; ``log(beta)`` for an empty row."""
    m = np.max(z, axis=-1, keepdims=True, initial=-np.inf)  # M = 0: every row is empty
    m = np.where(np.isneginf(m), 0.0, m)
    row_sum = np.exp(z - m).sum(axis=-1)
    with np.errstate(divide="ignore"):
        return np.logaddexp(m[..., 0] + np.log(row_sum), np.log(beta.astype(z.dtype))[:, None])
