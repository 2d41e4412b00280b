"""The per-entry score pipeline every kernel shares, and the key and query ranges that decide the tiles visited.

`bh_params` reads a (batch, head)'s options once per block; `entry` takes
an entry through the pipeline in the contract's order: the structural
conditions (causal, window, ``kv_lengths``, mask) and the bias
(`entry_keep`), then the scaled dot product, soft-cap, ALiBi, bias, NVM on
the final score and the dynamic window's gate (`entry_logit`). The options
are runtime values (``softcap`` in ``fopts``, 0 for none; the ALiBi slope
with the window's per-(b, h) constants; the bias read entry by entry like
the mask, through its element strides), so each kernel compiles once per
dtype. `block_key_range` and `block_query_range` give the keys a block of
queries can keep and the queries a block of keys can
(`elastic_np._contract._ranges`). Imports ``numba.cuda``: imported by the
kernel modules only.
"""

import math

from numba import cuda

from elastic_np._contract._ranges import key_range, query_range
from elastic_np.cuda._device.indices import (
    C_ALIBI, C_NORM, C_U_SCALE, F_NEG_INF, F_ONE, F_SCALE, F_SHARPNESS, F_SOFTCAP, F_THRESHOLD, F_ZERO, I_ALIGN_KV,
    I_BIAS_SB, I_BIAS_SH, I_BIAS_SI, I_BIAS_SJ, I_CAUSAL, I_HAS_ALIBI, I_HAS_BIAS, I_HAS_GATE, I_HAS_MASK, I_LEFT,
    I_NVM, I_RIGHT, O_BAND, O_BIAS, O_FOPTS, O_IOPTS, O_KV_LENGTHS, O_MASK,
)


@cuda.jit(device=True)
def _real(value, like):
    """``value`` converted to the dtype of the array ``like``."""
    cell = cuda.local.array(1, dtype=like.dtype)
    cell[0] = value
    return cell[0]


@cuda.jit(device=True)
def _diag_shift(b, N, M, opts):
    """``E_b - N``: query ``i`` of batch ``b`` sits at position ``i + E_b - N``.

    ``E_b`` is ``M`` (``align="array"``) or ``kv_lengths[b]`` (``align="kv_lengths"``);
    entry ``(i, j)`` is at offset ``j - i - (E_b - N)``.
    """
    if opts[O_IOPTS][I_ALIGN_KV] != 0:
        return opts[O_KV_LENGTHS][b] - N
    return M - N


@cuda.jit(device=True)
def block_key_range(i0, i1, b, h, N, M, opts):
    """Keys ``[lo, hi)`` that queries ``[i0, i1)`` can keep (`elastic_np._contract._ranges.key_range`)."""
    band = opts[O_BAND]
    kv_lengths = opts[O_KV_LENGTHS]
    diag_shift = _diag_shift(b, N, M, opts)
    return key_range(diag_shift, i0, i1, band[b, h, 0], band[b, h, 1], kv_lengths[b])


@cuda.jit(device=True)
def block_query_range(j0, j1, b, h, N, M, opts):
    """Queries ``[lo, hi)`` that can keep one of the keys ``[j0, j1)`` (`elastic_np._contract._ranges.query_range`)."""
    band = opts[O_BAND]
    if j0 >= opts[O_KV_LENGTHS][b]:
        return 0, 0
    return query_range(_diag_shift(b, N, M, opts), j0, j1, band[b, h, 0], band[b, h, 1], N)


@cuda.jit(device=True)
def _structural_keep(b, h, i, j, prm, mask):
    """Causal, window, ``kv_lengths`` and ``mask`` conditions of entry ``(i, j)``.

    The options come from ``prm``, `bh_params`'s scalars, read once per block.
    """
    (diag_shift, kv_length, causal, left, right, has_mask, nvm, has_gate, has_bias, bias_bh, bias_si, bias_sj,
     scale, softcap, alibi_slope, tau_h, u_scale, g_norm, threshold, sharpness) = prm
    d = j - i - diag_shift
    if causal and d > 0:
        return False
    if left >= 0 and d < -left:
        return False
    if right >= 0 and d > right:
        return False
    if j >= kv_length:
        return False
    if has_mask:
        mb = b if mask.shape[0] > 1 else 0
        mh = h if mask.shape[1] > 1 else 0
        mi = i if mask.shape[2] > 1 else 0
        mj = j if mask.shape[3] > 1 else 0
        if mask[mb, mh, mi, mj] == 0:
            return False
    return True


@cuda.jit(device=True)
def _gate(i, j, diag_shift, u_scale, norm, threshold, sharpness, fopts):
    """The dynamic window at ``(i, j)``: gate ``G`` (0 when closed), bell ``f``, ``u = x / sigma``."""
    u = u_scale * _real(j - i - diag_shift, fopts)
    f = norm * math.exp(-(u * u) / (fopts[F_ONE] + fopts[F_ONE]))
    G = fopts[F_ZERO]
    if f > threshold:
        G = math.tanh(sharpness * f)
    return G, f, u


@cuda.jit(device=True)
def _score(dot, d, scale, softcap, alibi_slope, bias_value, fopts):
    """The final score of an entry at offset ``d`` (see `_diag_shift`) and ``ds / ds_raw``.

    ``s = softcap tanh(scale dot / softcap) - alibi_slope |d| + bias_value``
    (the soft-cap only when ``softcap > 0``; ``alibi_slope`` and
    ``bias_value`` are 0 when not given). The slope of the soft-cap,
    ``1 - tanh^2``, is 1 without one; it is evaluated as ``4 e / (1 + e)^2``
    with ``e = exp(-2 |x|)``, ``x = s / softcap``, as ``1 - t * t`` cancels to
    nothing once ``t`` rounds to 1.
    """
    s = scale * dot
    cap_slope = fopts[F_ONE]
    if softcap > fopts[F_ZERO]:
        x = s / softcap
        s = softcap * math.tanh(x)
        e = math.exp(-(abs(x) + abs(x)))
        one_e = fopts[F_ONE] + e
        cap_slope = ((e + e) + (e + e)) / (one_e * one_e)
    return s - alibi_slope * _real(abs(d), fopts) + bias_value, cap_slope


@cuda.jit(device=True)
def bh_params(b, h, N, M, opts):
    """The options of `entry` for batch ``b``, head ``h``, read from the option arrays once per block."""
    mask, kv_lengths, band, iopts, fopts, tau, beta, bh_consts, bias = opts
    zero = fopts[F_ZERO]
    alibi_slope = zero
    if iopts[I_HAS_ALIBI] != 0:
        alibi_slope = bh_consts[b, h, C_ALIBI]
    g_norm = zero
    u_scale = zero
    if iopts[I_HAS_GATE] != 0:
        g_norm = bh_consts[b, h, C_NORM]
        u_scale = bh_consts[b, h, C_U_SCALE]
    return (
        _diag_shift(b, N, M, opts), kv_lengths[b], iopts[I_CAUSAL] != 0, iopts[I_LEFT],
        iopts[I_RIGHT], iopts[I_HAS_MASK] != 0, iopts[I_NVM] != 0, iopts[I_HAS_GATE] != 0,
        iopts[I_HAS_BIAS] != 0, b * iopts[I_BIAS_SB] + h * iopts[I_BIAS_SH], iopts[I_BIAS_SI],
        iopts[I_BIAS_SJ], fopts[F_SCALE], fopts[F_SOFTCAP], alibi_slope, tau[h], u_scale, g_norm,
        fopts[F_THRESHOLD], fopts[F_SHARPNESS],
    )


@cuda.jit(device=True)
def entry_keep(b, h, i, j, prm, opts):
    """``(kept, bias_value)``: the structural conditions and the bias of entry ``(b, h, i, j)``.

    The first half of the score pipeline, before the dot product is needed:
    an entry the causal, window, ``kv_lengths`` or mask conditions remove,
    or whose bias is ``-inf``, is not kept. ``prm`` is `bh_params`'s tuple.
    """
    (diag_shift, kv_length, causal, left, right, has_mask, nvm, has_gate, has_bias, bias_bh, bias_si, bias_sj,
     scale, softcap, alibi_slope, tau_h, u_scale, g_norm, threshold, sharpness) = prm
    mask = opts[O_MASK]
    bias = opts[O_BIAS]
    fopts = opts[O_FOPTS]
    bias_value = fopts[F_ZERO]
    if not _structural_keep(b, h, i, j, prm, mask):
        return False, bias_value
    if has_bias:
        bias_value = bias[bias_bh + i * bias_si + j * bias_sj]
        if bias_value == fopts[F_NEG_INF]:  # removed, like a false mask entry
            return False, bias_value
    return True, bias_value


@cuda.jit(device=True)
def entry_logit(dot, i, j, bias_value, prm, fopts):
    """``(z, s, cap_slope, f, u)`` of a kept entry from ``dot = q_i . k_j``: the second half of the pipeline.

    ``s`` is the final score (`_score`: scale, soft-cap, ALiBi, bias) and
    ``cap_slope`` the soft-cap's ``ds / ds_raw``; ``z = s / tau`` plus
    ``log G`` under the dynamic window, whose bell ``f`` and ``u = x / sigma``
    are returned too (0 without one); ``z = -inf`` when NVM or a closed gate
    removes the entry.
    """
    (diag_shift, kv_length, causal, left, right, has_mask, nvm, has_gate, has_bias, bias_bh, bias_si, bias_sj,
     scale, softcap, alibi_slope, tau_h, u_scale, g_norm, threshold, sharpness) = prm
    zero = fopts[F_ZERO]
    neg_inf = fopts[F_NEG_INF]
    s, cap_slope = _score(dot, j - i - diag_shift, scale, softcap, alibi_slope, bias_value, fopts)
    if nvm and s < zero:
        return neg_inf, s, cap_slope, zero, zero
    z = s / tau_h
    f = zero
    u = zero
    if has_gate:
        G, f, u = _gate(i, j, diag_shift, u_scale, g_norm, threshold, sharpness, fopts)
        if not G > zero:
            return neg_inf, s, cap_slope, f, u
        z += math.log(G)
    return z, s, cap_slope, f, u


@cuda.jit(device=True)
def entry(dot, b, h, i, j, prm, opts):
    """The whole score pipeline of entry ``(b, h, i, j)``: `entry_logit`'s tuple, ``z = -inf`` when removed."""
    fopts = opts[O_FOPTS]
    kept, bias_value = entry_keep(b, h, i, j, prm, opts)
    if not kept:
        zero = fopts[F_ZERO]
        return fopts[F_NEG_INF], zero, zero, zero, zero
    return entry_logit(dot, i, j, bias_value, prm, fopts)
