"""What the tensor-core forward and backward share: the warp's fragment products, the simple logits, the block's place.

Fragments (per warp; ``lane = 4 g + t``) as in `elastic_np.cuda._tensor_core.mma`;
a thread of the accumulator layout holds rows ``g``, ``g + 8`` and columns
``2t``, ``2t + 1`` of each 8. float32 products take three TF32 products
(``small_a big_b + big_a small_b + big_a big_b``) or one with
``precision="tf32"``; float64 one (DMMA).
"""

from numba import cuda

from elastic_np.cuda._device.basics import inline_device
from elastic_np.cuda._device.basics import unsigned as _at
from elastic_np.cuda._device.indices import F_NEG_INF
from elastic_np.cuda._tensor_core.mma import mma, split, splits


@inline_device
def _accumulate(frag, n, a, b, terms, zero, swapped):
    """``frag[n] += A B`` for one 16 x 8 x 8 step, ``a`` and ``b`` the fragments and their TF32 rests.

    float32: the step's product from zero, the TF32 parts' cross products
    first (with ``terms == 3``: ``small_a big_b``, then ``big_a small_b``; the
    other way round when ``swapped``, so that ``K Q^T`` sums its entries as
    ``Q K^T`` does), then ``big_a big_b``, added to ``frag[n]`` in IEEE
    arithmetic: the tensor cores' accumulation truncates, and starting each
    step from zero keeps that to the 8 products of a step. float64: the
    product accumulates in place (DMMA rounds as IEEE does).
    """
    a0, a1, a2, a3, a0s, a1s, a2s, a3s = a
    b0, b1, b0s, b1s = b
    if splits(a0):
        c0, c1, c2, c3 = zero, zero, zero, zero
        if terms == 3 and swapped:
            c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0s, b1s, c0, c1, c2, c3)
            c0, c1, c2, c3 = mma(a0s, a1s, a2s, a3s, b0, b1, c0, c1, c2, c3)
        elif terms == 3:
            c0, c1, c2, c3 = mma(a0s, a1s, a2s, a3s, b0, b1, c0, c1, c2, c3)
            c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0s, b1s, c0, c1, c2, c3)
        c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        frag[n, 0] += c0
        frag[n, 1] += c1
        frag[n, 2] += c2
        frag[n, 3] += c3
    else:
        c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0, b1, frag[n, 0], frag[n, 1], frag[n, 2], frag[n, 3])
        frag[n, 0], frag[n, 1], frag[n, 2], frag[n, 3] = c0, c1, c2, c3


@inline_device
def dot_products(q_tile, k_tile, stride, width, row0, terms, zero, s_frag, swapped):
    """``s_frag = Q K^T`` of the warp's 16 rows (from ``row0``) over the key tile, on the tensor cores.

    ``swapped``: ``q_tile`` holds the keys and ``k_tile`` the queries (the
    backward's ``K Q^T``), whose entries then sum as the forward's do (`_accumulate`).
    """
    lane = cuda.threadIdx.x % 32
    g = lane // 4
    t = lane % 4
    for n in range(s_frag.shape[0]):
        for e in range(4):
            s_frag[n, e] = zero
    for d0 in range(0, width, 8):
        top = (row0 + g) * stride + d0 + t
        bottom = top + 8 * stride
        a0, a0s = split(q_tile[_at(top)])
        a1, a1s = split(q_tile[_at(bottom)])
        a2, a2s = split(q_tile[_at(top + 4)])
        a3, a3s = split(q_tile[_at(bottom + 4)])
        for n in range(s_frag.shape[0]):
            at = (8 * n + g) * stride + d0 + t
            b0, b0s = split(k_tile[_at(at)])
            b1, b1s = split(k_tile[_at(at + 4)])
            _accumulate(s_frag, n, (a0, a1, a2, a3, a0s, a1s, a2s, a3s), (b0, b1, b0s, b1s), terms, zero, swapped)


@inline_device
def _add_pv(s_frag, v_tile, stride, terms, zero, o_frag, n0, e0):
    """``o_frag += P V`` for keys ``8 n0 ..`` and value columns ``8 e0 ..`` (at most 4 x 8 products).

    ``P`` is in ``s_frag`` (C layout, the keys of each 8 reordered, see the
    module). The caller covers the fragments in such parts, at constant
    ``n0``, ``e0``, so that each part's loops unroll in full.
    """
    lane = cuda.threadIdx.x % 32
    g = lane // 4
    t = lane % 4
    for n in range(n0, min(n0 + 4, s_frag.shape[0])):
        a0, a0s = split(s_frag[n, 0])
        a1, a1s = split(s_frag[n, 2])
        a2, a2s = split(s_frag[n, 1])
        a3, a3s = split(s_frag[n, 3])
        row = (8 * n + 2 * t) * stride + g
        for e in range(e0, min(e0 + 8, o_frag.shape[0])):
            b0, b0s = split(v_tile[_at(row + 8 * e)])
            b1, b1s = split(v_tile[_at(row + stride + 8 * e)])
            _accumulate(o_frag, e, (a0, a1, a2, a3, a0s, a1s, a2s, a3s), (b0, b1, b0s, b1s), terms, zero, False)


@inline_device
def add_products(s_frag, v_tile, stride, terms, zero, o_frag):
    """``o_frag += P V`` over the whole fragments (`_add_pv` in parts at constant offsets)."""
    _add_pv(s_frag, v_tile, stride, terms, zero, o_frag, 0, 0)
    if s_frag.shape[0] > 4:
        _add_pv(s_frag, v_tile, stride, terms, zero, o_frag, 4, 0)
    if o_frag.shape[0] > 8:
        _add_pv(s_frag, v_tile, stride, terms, zero, o_frag, 0, 8)
        if s_frag.shape[0] > 4:
            _add_pv(s_frag, v_tile, stride, terms, zero, o_frag, 4, 8)


@inline_device
def simple_logits(s_frag, rows, cols, prm, fopts, transposed):
    """Scores to logits in registers, where the only options are the structural ones, ``scale`` and ``tau``.

    ``rows = (r, r_end)``: the thread's rows are ``r`` and ``r + 8``, kept
    below ``r_end``; ``cols = (c, c_end)``: its columns of ``s_frag[n]`` are
    ``c + 8 n`` and ``c + 8 n + 1``, kept below ``c_end``. Rows are queries
    and columns keys, or with ``transposed`` (the backward's ``K Q^T``) the
    other way round; keys past ``kv_lengths`` are not kept either. ``z =
    dot (scale / tau)`` (`entry`'s ``(scale dot) / tau`` within a
    rounding), ``-inf`` where causal, the window or ``kv_lengths`` remove the
    entry.
    """
    r, r_end = rows
    c, c_end = cols
    (diag_shift, kv_length, causal, left, right, has_mask, nvm, has_gate, has_bias, bias_bh, bias_si, bias_sj,
     scale, softcap, alibi_slope, tau_h, u_scale, g_norm, threshold, sharpness) = prm
    neg_inf = fopts[F_NEG_INF]
    if transposed:
        r_end = min(r_end, kv_length)
    else:
        c_end = min(c_end, kv_length)
    factor = scale / tau_h
    no_left = left < 0
    no_right = right < 0
    for n in range(s_frag.shape[0]):
        for e in range(4):  # without branches, so that the loops unroll
            row = r + 8 * (e // 2)
            col = c + 8 * n + e % 2
            d = (row - col if transposed else col - row) - diag_shift  # the key's offset from the query's diagonal
            kept = (col < c_end) & (row < r_end) & ~(causal & (d > 0)) & (no_left | (d >= -left)) & (
                no_right | (d <= right))
            s_frag[n, e] = s_frag[n, e] * factor if kept else neg_inf


@inline_device
def copy_unit(vector, zero):
    """Elements a copy moves at a time: 16 bytes' worth where ``vector`` (rows of whole, aligned units), else 1."""
    if vector:
        return 4 if splits(zero) else 2
    return 1


@inline_device
def block_place(N, H, block_q):
    """``(b, h, i0, i1)``: the block's (batch, head) and query rows, the longest causal rows first."""
    n_tiles = (N + block_q - 1) // block_q
    tile = n_tiles - 1 - cuda.blockIdx.x % n_tiles
    i0 = tile * block_q
    return cuda.blockIdx.x // n_tiles // H, cuda.blockIdx.x // n_tiles % H, i0, min(i0 + block_q, N)
