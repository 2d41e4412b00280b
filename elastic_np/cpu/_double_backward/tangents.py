"""The direction of the double backward as its kernels read it, and the tangent of a tile's scores.

`Tangents` holds the direction ``xdot`` (the cotangent ``u`` of the
backward's outputs, see the derivations page, "Second derivatives"): the
tangent queries scaled and transposed like the queries, ``kdot`` and
``vdot`` as operands, per head ``taudot / tau`` and ``betadot``, the gate's
derivatives times ``sigmadot`` tabulated by offset like the plan's
``log_gate``, and ``biasdot``'s distinct entries. `tile_probabilities`
forms a tile's ``p`` from its scores ``s / tau`` and `score_tangent` its
``sdot / tau``, the first steps of both passes of
`elastic_np.cpu._double_backward.double_backward`.
"""

import collections

from elastic_np.cpu._prefill.key_tiles import gated_probabilities, probabilities, softcap_slope
from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._tiles import calls
from elastic_np.cpu._tiles.calls import matmul_nn
from elastic_np.cpu._tiles.logits import modify_tile
from elastic_np.cpu._tiles.scalar import scalar_like
from elastic_np.cpu._tiles.tanh import tanh_any

Tangents = collections.namedtuple(
    "Tangents",
    [
        "q_rows",  # kernel dtype (B, H, N, D): qdot * scale / tau_h
        "q_t",  # kernel dtype (B, H, n_qt, D, block_q): the same, transposed by query tile
        "q_tan_t",  # like q_t: q * scale / tau_h (the logits' own Q^T tiles, unless NVM scales after the product)
        "k",  # operand of kdot (`elastic_np.cpu._tiles.operands`)
        "v",  # operand of vdot
        "tau_ratio",  # float64 (H,): taudot_h / tau_h
        "beta",  # float64 (H,): betadot_h
        "dlog_gate",  # float64 (B, H, N + M - 1): sigmadot d log G / d sigma, by offset like `log_gate`
        "d2log_gate",  # float64, same shape: sigmadot d^2 log G / d sigma^2 (0 where the gate is closed)
        "has_bias",  # bool
        "bias",  # kernel dtype, 1-D read-only: biasdot's distinct entries (a 1-element dummy when off)
        "bias_strides",  # int64 (4,): element strides of (b, h, i, j) into `bias`
    ],
)


@inner(fastmath=False)
def tile_probabilities(st, pt, lse_t, opt, tile, bk):
    """``p = exp(z - lse)`` into ``pt`` from the scores ``s / tau`` in ``st``, which keeps them.

    ``st`` is a logits tile formed without the gate (the passes' options
    with ``has_gate`` False): as in the backward, ``log G`` joins here
    (`elastic_np.cpu._prefill.key_tiles.gated_probabilities`, ``z`` the forward's
    bits) and NVM removes ``s < 0`` here, so that the passes read ``s /
    tau`` itself, not ``z - log G``, which holds it only to the rounding of
    ``z`` at ``|log G|``. ``tile`` as in `score_tangent`.
    """
    b, h, i0, bq, j0 = tile
    if opt.has_gate:
        base = j0 - opt.diag_shift[b] - i0 + opt.n_keys - 1  # the gate's index of (j0, i0)
        gated_probabilities(st, pt, lse_t, bk, bq, opt.nvm, opt.log_gate[b, h], base)
    else:
        probabilities(st, pt, lse_t, bk, bq, opt.nvm)


@inner(fastmath=False)
def score_tangent(rdt, k_j, kdot_j, tan, opt, tile, bk, cap_slope, cap_dot):
    """``rdt[c, r] = sdot / tau_h`` for key ``j0 + c`` and query ``i0 + r`` (``tile`` as in `logits_tile`).

    ``sdot = c rdot + biasdot``, ``rdot = scale (qdot . k + q . kdot)``,
    ``c`` the soft-cap's slope ``cap_slope`` that `logits_tile` left (1
    without a soft-cap). ``k_j``, ``kdot_j``: the tile's rows of ``k`` and
    ``kdot`` (`elastic_np.cpu._tiles.operands.head_rows`). With a soft-cap and a
    ``cap_dot`` of the tile's shape (the key pass), ``cap_dot`` receives
    ``cdot``, the slope's own tangent (`_cap_tangent`).
    """
    b, h, i0, bq, j0 = tile
    D, block_q = tan.q_t.shape[3], tan.q_t.shape[4]
    it = i0 // block_q
    k_rows, k_col = k_j
    kd_rows, kd_col = kdot_j
    matmul_nn(k_rows, k_col, tan.q_t[b, h, it], 0, rdt, bk, bq, D, False)
    matmul_nn(kd_rows, kd_col, tan.q_tan_t[b, h, it], 0, rdt, bk, bq, D, True)
    if opt.has_softcap:
        if cap_dot.shape[0] > 0:
            # the raw scores again, for tanh(r / cap): the logits hold them capped and modified
            matmul_nn(k_rows, k_col, tan.q_tan_t[b, h, it], 0, cap_dot, bk, bq, D, False)
            _cap_tangent(cap_dot, rdt, cap_slope, opt, h, bk, bq)
        softcap_slope(rdt, cap_slope, bk, bq)
    if tan.has_bias:
        # biasdot / tau_h added by the modifier stage, as the logits add the bias
        modify_tile(rdt, rdt[:0], rdt[0, :0], tan.bias, tan.bias_strides, opt.tau, opt.alibi, opt.diag_shift,
                    tile, bk, calls.HAS_BIAS, opt.softcap)


@inner(fastmath=False)
def _cap_tangent(cap_dot, rdt, cap_slope, opt, h, bk, bq):
    """``cap_dot = cdot = -(2 / cap) tanh(r / cap) c rdot`` from ``cap_dot = r / tau`` and ``rdt = rdot / tau``."""
    tau_over_cap = scalar_like(opt.tau[h] / opt.softcap, cap_dot)
    factor = scalar_like(-2.0 * opt.tau[h] / opt.softcap, cap_dot)
    for c in range(bk):
        row, rdot_row, slope_row = cap_dot[c, :bq], rdt[c, :bq], cap_slope[c, :bq]
        for r in range(row.shape[0]):
            row[r] = factor * tanh_any(row[r] * tau_over_cap) * slope_row[r] * rdot_row[r]
