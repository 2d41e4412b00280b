"""The tensor-core flash forward: a warp owns 16 query rows, its products on ``mma.sync``.

Imports ``numba.cuda``; imported on first use by `elastic_np.cuda._forward_launch`.
FlashAttention-2's partition: a block of ``W`` warps owns ``16 W`` query
rows of one (batch, head); per key tile of ``8 S`` keys (``S`` =
``s_frag.shape[0]``) the block stages K and V in shared memory, and each warp

1. forms its 16 x ``8 S`` scores with `elastic_np.cuda._mma.mma` (one
   16 x 8 x 8 product per 8 keys and 8 of ``D``; float32 in three TF32
   products, ``small_q big_k + big_q small_k + big_q big_k``, or one with
   ``precision="tf32"``; float64 in one);
2. takes each score through the score pipeline where it lies: a thread holds
   rows ``g``, ``g + 8`` and keys ``2t``, ``2t + 1`` of each 8 (`_entry`);
3. updates the online softmax of its two rows: the max over the row's four
   lanes by shuffles, the partial sums kept per thread until the end;
4. adds ``P V`` into ``o_frag``: the score fragment feeds the product as its
   ``A`` operand in place, with the keys of each 8 taken in the order
   ``0, 2, 4, 6, 1, 3, 5, 7`` (``A``'s columns ``t``, ``t + 4`` are ``C``'s
   ``2t``, ``2t + 1``), and V's rows read in that order.

Value heads wider than ``8 o_frag.shape[0]`` take several passes over the keys.
"""

import math

import numba
from numba import cuda

from elastic_np.cuda._device.score import (
    F_NEG_INF, F_ONE, F_ZERO, I_MMA_TERMS, O_BETA, O_FOPTS, O_IOPTS, _bh_params, _carve, _dims, _entry,
    _finish_row, _group_max, _group_sum, _key_range, inline_device,
)
from elastic_np.cuda._device.score import unsigned as _at
from elastic_np.cuda._runtime.config import TC_PAD
from elastic_np.cuda._device.async_copy import commit, copy_tile, wait_all, wait_prior
from elastic_np.cuda._tensor_core.mma import mma, split, splits

#: Every lane of a warp: a row's 4 lanes reduce by shuffles (`_group_max`, `_group_sum` of width 4).
FULL_MASK = numba.uint32(0xFFFFFFFF)


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
def _scores(q_tile, k_tile, stride, width, row0, terms, zero, s_frag, swapped):
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
def _simple_logits(s_frag, rows, cols, prm, fopts, transposed):
    """Scores to logits in registers, where the only options are the structural ones, ``scale`` and ``tau``.

    ``rows = (r, r_end)``: the thread's rows are ``r`` and ``r + 8``, kept
    below ``r_end``; ``cols = (c, c_end)``: its columns of ``s_frag[n]`` are
    ``c + 8 n`` and ``c + 8 n + 1``, kept below ``c_end``. Rows are queries
    and columns keys, or with ``transposed`` (the backward's ``K Q^T``) the
    other way round; keys past ``kv_lengths`` are not kept either. ``z =
    dot (scale / tau)`` (`_entry`'s ``(scale dot) / tau`` within a
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
def _general_logits(s_frag, scratch, place, keys, prm, opts):
    """Scores to logits through the whole score pipeline (`_entry`), by way of the warp's ``scratch``.

    ``scratch`` is the warp's ``16 x (8 S + 1)`` tile of shared memory: the
    fragment goes there, the warp's lanes take its entries in row order (the
    bias and mask read along their rows) and the logits come back. The caller
    brackets it with barriers. ``place = (b, h, i, N)``: the warp's rows are
    queries ``i ..`` below ``N``; ``keys = (j0, hi)``: its columns keys
    ``j0 ..`` below ``hi``.
    """
    b, h, i_warp, N = place
    j0, hi = keys
    lane = cuda.threadIdx.x % 32
    g = lane // 4
    t = lane % 4
    cols = 8 * s_frag.shape[0]
    stride = cols + 1
    for n in range(s_frag.shape[0]):
        for e in range(4):
            scratch[_at((g + 8 * (e // 2)) * stride + 8 * n + 2 * t + e % 2)] = s_frag[n, e]
    cuda.syncthreads()
    neg_inf = opts[O_FOPTS][F_NEG_INF]
    for idx in range(lane, 16 * cols, 32):
        r = idx // cols
        c = idx - r * cols
        z = neg_inf
        if j0 + c < hi and i_warp + r < N:
            z = _entry(scratch[_at(r * stride + c)], b, h, i_warp + r, j0 + c, prm, opts)[0]
        scratch[_at(r * stride + c)] = z
    cuda.syncthreads()
    for n in range(s_frag.shape[0]):
        for e in range(4):
            s_frag[n, e] = scratch[_at((g + 8 * (e // 2)) * stride + 8 * n + 2 * t + e % 2)]


@inline_device
def _softmax_step(s_frag, stats, fopts):
    """Logits to ``p = exp(z - max)`` in ``s_frag``; returns the two rows' rescale factors.

    ``stats`` holds the thread's rows' running max (0, 1) and its partial sums (2, 3).
    """
    neg_inf = fopts[F_NEG_INF]
    zero = fopts[F_ZERO]
    one = fopts[F_ONE]
    top = neg_inf
    bottom = neg_inf
    for n in range(s_frag.shape[0]):
        top = max(top, max(s_frag[n, 0], s_frag[n, 1]))
        bottom = max(bottom, max(s_frag[n, 2], s_frag[n, 3]))
    new_top = max(stats[0], _group_max(top, 4, FULL_MASK))
    new_bottom = max(stats[1], _group_max(bottom, 4, FULL_MASK))
    alpha_top = one
    alpha_bottom = one
    if new_top > neg_inf:
        alpha_top = math.exp(stats[0] - new_top)
    if new_bottom > neg_inf:
        alpha_bottom = math.exp(stats[1] - new_bottom)
    sum_top = stats[2] * alpha_top
    sum_bottom = stats[3] * alpha_bottom
    for n in range(s_frag.shape[0]):
        for e in range(4):
            p = zero
            if s_frag[n, e] > neg_inf:
                p = math.exp(s_frag[n, e] - (new_top if e < 2 else new_bottom))
            s_frag[n, e] = p
            if e < 2:
                sum_top += p
            else:
                sum_bottom += p
    stats[0] = new_top
    stats[1] = new_bottom
    stats[2] = sum_top
    stats[3] = sum_bottom
    return alpha_top, alpha_bottom


@inline_device
def copy_unit(vector, zero):
    """Elements a copy moves at a time: 16 bytes' worth where ``vector`` (rows of whole, aligned units), else 1."""
    if vector:
        return 4 if splits(zero) else 2
    return 1


@inline_device
def _issue_kv(k_bh, v_bh, j, hi, c0, buffers, geometry, unit, slot):
    """Start copying the key tile from key ``j`` (K, and V's columns from ``c0``) into buffer ``slot``."""
    q_tile, k_tiles, v_tiles, k_size, v_size = buffers
    D, Dv, d_pad, qk_stride, v_stride, block_k, width_v = geometry
    copy_tile(k_bh[j:], hi - j, D, k_tiles[slot * k_size :], qk_stride, block_k, d_pad, unit)
    copy_tile(v_bh[j:, c0:], hi - j, Dv - c0, v_tiles[slot * v_size :], v_stride, block_k, width_v, unit)
    commit()


@inline_device
def _key_tile(it, n_k, kv, keys, buffers, geometry, place, frags, options):
    """One key tile of a pass: the next tile's copies started, this one's scores, softmax and ``P V``."""
    k_bh, v_bh, unit = kv
    lo, hi, c0 = keys
    q_tile, k_tiles, v_tiles, k_size, v_size = buffers
    D, Dv, d_pad, qk_stride, v_stride, block_k, width_v = geometry
    b, h, i0, N, warp = place
    s_frag, o_frag, stats = frags
    prm, opts, general, terms, zero = options
    j0 = lo + it * block_k
    cur = it % 2
    if it + 1 < n_k:  # the next tile into the other buffers, while this one is used
        _issue_kv(k_bh, v_bh, j0 + block_k, hi, c0, buffers, geometry, unit, 1 - cur)
        wait_prior()
    else:
        wait_all()
    cuda.syncthreads()  # this tile's copies (and Q's) are visible to every thread
    k_tile = k_tiles[cur * k_size :]
    v_tile = v_tiles[cur * v_size :]
    row0 = 16 * warp
    t = cuda.threadIdx.x % 4
    _scores(q_tile, k_tile, qk_stride, d_pad, row0, terms, zero, s_frag, False)
    fopts = opts[O_FOPTS]
    if not general:
        _simple_logits(s_frag, (i0 + row0 + cuda.threadIdx.x % 32 // 4, N), (j0 + 2 * t, hi), prm, fopts, False)
    else:
        cuda.syncthreads()  # every warp is done with K: its rows become the scratch
        scratch = k_tile[16 * (block_k + 1) * warp :]
        _general_logits(s_frag, scratch, (b, h, i0 + row0, N), (j0, hi), prm, opts)
    alpha_top, alpha_bottom = _softmax_step(s_frag, stats, fopts)
    for e in range(o_frag.shape[0]):
        o_frag[e, 0] *= alpha_top
        o_frag[e, 1] *= alpha_top
        o_frag[e, 2] *= alpha_bottom
        o_frag[e, 3] *= alpha_bottom
    add_products(s_frag, v_tile, v_stride, terms, zero, o_frag)
    cuda.syncthreads()  # every warp is done with these buffers before the next tile's copies reuse them


@inline_device
def _write_rows(out, lse, place, c0, Dv, o_frag, stats, fopts, beta_h):
    """``out`` of the thread's two rows (value columns from ``c0``) and, in the first pass, their ``lse``."""
    b, h, i, N = place
    t = cuda.threadIdx.x % 4
    for half in range(2):
        row = i + 8 * half
        row_lse, num, den = _finish_row(stats[half], _group_sum(stats[2 + half], 4, FULL_MASK), beta_h, fopts)
        if row < N:
            if c0 == 0 and t == 0:
                lse[b, h, row] = row_lse
            for e in range(o_frag.shape[0]):
                for x in range(2):
                    col = c0 + 8 * e + 2 * t + x
                    if col < Dv:
                        out[b, h, row, col] = (o_frag[e, 2 * half + x] * num) / den


@inline_device
def _place(N, H, block_q):
    """``(b, h, i0, i1)``: the block's (batch, head) and query rows, the longest causal rows first."""
    n_tiles = (N + block_q - 1) // block_q
    tile = n_tiles - 1 - cuda.blockIdx.x % n_tiles
    i0 = tile * block_q
    return cuda.blockIdx.x // n_tiles // H, cuda.blockIdx.x // n_tiles % H, i0, min(i0 + block_q, N)


@inline_device
def _reset(o_frag, stats, zero, neg_inf):
    """A pass's fresh accumulators and row statistics."""
    stats[0] = neg_inf
    stats[1] = neg_inf
    stats[2] = zero
    stats[3] = zero
    for e in range(o_frag.shape[0]):
        for x in range(4):
            o_frag[e, x] = zero


@inline_device
def _forward(q, k, v, opts, vector, out, lse, s_frag, o_frag, stats, general):
    """The kernel's body, for the fragment arrays its caller sizes (see the module).

    ``general`` (a compile-time constant) compiles in the whole score pipeline
    (`_general_logits`), for the problems `elastic_np.cuda._forward_launch.needs_general`
    names; without it the kernel takes the structural options, ``scale`` and
    ``tau`` only (`_simple_logits`), and keeps its registers.
    ``vector``: whether the rows of ``q``, ``k``, ``v`` start 16-byte aligned
    and hold whole 16-byte units, for vector copies.
    """
    B, H, Hkv, N, M, D, Dv = _dims(q, k, v)
    warp = cuda.threadIdx.x // 32
    block_q = 16 * (cuda.blockDim.x // 32)
    b, h, i0, i1 = _place(N, H, block_q)
    hk = h // (H // Hkv)
    block_k = 8 * s_frag.shape[0]
    width_v = 8 * o_frag.shape[0]
    d_pad = (D + 7) // 8 * 8
    geometry = (D, Dv, d_pad, d_pad + TC_PAD, width_v + TC_PAD, block_k, width_v)
    fopts = opts[O_FOPTS]
    zero = fopts[F_ZERO]
    smem = cuda.shared.array(0, dtype=q.dtype)
    k_size = max(block_k * (d_pad + TC_PAD), block_q * (block_k + 1))  # K, then the general pipeline's scratch
    v_size = block_k * (width_v + TC_PAD)
    q_tile, at = _carve(smem, 0, block_q * (d_pad + TC_PAD))
    k_tiles, at = _carve(smem, at, 2 * k_size)  # two of each: one in use, the next one arriving
    v_tiles, at = _carve(smem, at, 2 * v_size)
    buffers = (q_tile, k_tiles, v_tiles, k_size, v_size)
    unit = copy_unit(vector, zero)
    copy_tile(q[b, h, i0:], i1 - i0, D, q_tile, d_pad + TC_PAD, block_q, d_pad, unit)
    commit()
    prm = _bh_params(b, h, N, M, opts)
    options = (prm, opts, general, opts[O_IOPTS][I_MMA_TERMS], zero)
    lo, hi = _key_range(i0, i1, b, h, N, M, opts)
    n_k = (hi - lo + block_k - 1) // block_k if hi > lo else 0
    kv = (k[b, hk], v[b, hk], unit)
    for c0 in range(0, max(Dv, 1), width_v):
        _reset(o_frag, stats, zero, fopts[F_NEG_INF])
        if n_k > 0:
            _issue_kv(kv[0], kv[1], lo, hi, c0, buffers, geometry, unit, 0)
        for it in range(n_k):
            _key_tile(it, n_k, kv, (lo, hi, c0), buffers, geometry, (b, h, i0, N, warp), (s_frag, o_frag, stats),
                      options)
        place = (b, h, i0 + 16 * warp + cuda.threadIdx.x % 32 // 4, N)
        _write_rows(out, lse, place, c0, Dv, o_frag, stats, fopts, opts[O_BETA][h])
    wait_all()  # Q's copies, where the block had no key to wait for them


def _kernel(keys, width_v, general):
    """A kernel whose key tiles hold ``keys`` keys, whose passes take ``width_v`` value columns.

    ``general``: whether it takes every option (`_forward`).
    """
    s_shape = (keys // 8, 4)  # the fragment shapes: compile-time constants of each kernel
    o_shape = (width_v // 8, 4)

    def kernel(q, k, v, opts, vector, out, lse):
        s_frag = cuda.local.array(s_shape, q.dtype)
        o_frag = cuda.local.array(o_shape, q.dtype)
        stats = cuda.local.array(4, q.dtype)
        _forward(q, k, v, opts, vector, out, lse, s_frag, o_frag, stats, general)

    kind = "general" if general else "simple"
    kernel.__name__ = kernel.__qualname__ = f"_forward_tc_k{keys}_v{width_v}_{kind}"
    kernel.__doc__ = (
        f"One block per (batch * head, query tile): key tiles of {keys}, value columns in passes of "
        f"{width_v}, {'every option' if general else 'the structural options, scale and tau'}."
    )
    return cuda.jit(cache=True)(kernel)


#: The tensor-core forward kernels by ``(keys per tile, value columns per pass, every option)``.
KERNELS = {
    (keys, width, general): _kernel(keys, width, general)
    for keys in (32, 64)
    for width in (64, 128)
    for general in (False, True)
}
