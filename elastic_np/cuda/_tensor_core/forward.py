"""The tensor-core flash forward: a warp owns 16 query rows, its products on ``mma.sync`` (float64, or TF32).

Imports ``numba.cuda``; imported on first use by its launch,
`elastic_np.cuda._launch.forward`. FlashAttention-2's partition: a block of ``W`` warps owns ``16 W`` query
rows of one (batch, head); per key tile of ``8 S`` keys (``S`` =
``s_frag.shape[0]``) the block stages K and V in shared memory, and each warp

1. forms its 16 x ``8 S`` scores with `elastic_np.cuda._tensor_core.mma.mma` (one
   16 x 8 x 8 product per 8 keys and 8 of ``D``; float32 in three TF32
   products, ``small_q big_k + big_q small_k + big_q big_k``, or one with
   ``precision="tf32"``; float64 in one);
2. takes each score through the score pipeline where it lies: a thread holds
   rows ``g``, ``g + 8`` and keys ``2t``, ``2t + 1`` of each 8 (`entry`);
3. updates the online softmax of its two rows (`fragment_step`): the max
   over the row's four lanes by shuffles, the partial sums kept per thread
   until the end;
4. adds ``P V`` into ``o_frag``: the score fragment feeds the product as its
   ``A`` operand in place, with the keys of each 8 taken in the order
   ``0, 2, 4, 6, 1, 3, 5, 7`` (``A``'s columns ``t``, ``t + 4`` are ``C``'s
   ``2t``, ``2t + 1``), and V's rows read in that order.

Value heads wider than ``8 o_frag.shape[0]`` take several passes over the keys.
"""


from numba import cuda

from elastic_np.cuda._device.async_copy import commit, copy_tile, wait_all, wait_prior
from elastic_np.cuda._device.basics import inline_device, problem_dims
from elastic_np.cuda._device.basics import unsigned as _at
from elastic_np.cuda._device.indices import F_NEG_INF, F_ZERO, I_MMA_TERMS, O_BETA, O_FOPTS, O_IOPTS
from elastic_np.cuda._device.score import bh_params, block_key_range, entry
from elastic_np.cuda._device.softmax import FULL_MASK, finish_row, fragment_step, group_sum
from elastic_np.cuda._device.tiles import carve, stage_kv
from elastic_np.cuda._runtime.config import TC_PAD
from elastic_np.cuda._tensor_core.fragments import add_products, block_place, copy_unit, dot_products, simple_logits


@inline_device
def _general_logits(s_frag, scratch, place, keys, prm, opts):
    """Scores to logits through the whole score pipeline (`entry`), by way of the warp's ``scratch``.

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
            z = entry(scratch[_at(r * stride + c)], b, h, i_warp + r, j0 + c, prm, opts)[0]
        scratch[_at(r * stride + c)] = z
    cuda.syncthreads()
    for n in range(s_frag.shape[0]):
        for e in range(4):
            s_frag[n, e] = scratch[_at((g + 8 * (e // 2)) * stride + 8 * n + 2 * t + e % 2)]


@inline_device
def _issue_kv(k_bh, v_bh, j, hi, c0, buffers, geometry, unit, slot):
    """Start copying the key tile from key ``j`` (K, and V's columns from ``c0``) into buffer ``slot`` (`stage_kv`)."""
    q_tile, k_tiles, v_tiles, k_size, v_size = buffers
    D, Dv, d_pad, qk_stride, v_stride, block_k, width_v = geometry
    stage_kv(k_bh[j:], v_bh[j:, c0:], hi - j, k_tiles[slot * k_size :], v_tiles[slot * v_size :],
             (D, qk_stride, d_pad), (Dv - c0, v_stride, width_v), block_k, unit)


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
    dot_products(q_tile, k_tile, qk_stride, d_pad, row0, terms, zero, s_frag, False)
    fopts = opts[O_FOPTS]
    if not general:
        simple_logits(s_frag, (i0 + row0 + cuda.threadIdx.x % 32 // 4, N), (j0 + 2 * t, hi), prm, fopts, False)
    else:
        cuda.syncthreads()  # every warp is done with K: its rows become the scratch
        scratch = k_tile[16 * (block_k + 1) * warp :]
        _general_logits(s_frag, scratch, (b, h, i0 + row0, N), (j0, hi), prm, opts)
    alpha_top, alpha_bottom = fragment_step(s_frag, stats, fopts)
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
        row_lse, num, den = finish_row(stats[half], group_sum(stats[2 + half], 4, FULL_MASK), beta_h, fopts)
        if row < N:
            if c0 == 0 and t == 0:
                lse[b, h, row] = row_lse
            for e in range(o_frag.shape[0]):
                for x in range(2):
                    col = c0 + 8 * e + 2 * t + x
                    if col < Dv:
                        out[b, h, row, col] = (o_frag[e, 2 * half + x] * num) / den


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
    (`_general_logits`), for the problems `elastic_np.cuda._launch.plan.needs_general`
    names; without it the kernel takes the structural options, ``scale`` and
    ``tau`` only (`simple_logits`), and keeps its registers.
    ``vector``: whether the rows of ``q``, ``k``, ``v`` start 16-byte aligned
    and hold whole 16-byte units, for vector copies.
    """
    B, H, Hkv, N, M, D, Dv = problem_dims(q, k, v)
    warp = cuda.threadIdx.x // 32
    block_q = 16 * (cuda.blockDim.x // 32)
    b, h, i0, i1 = block_place(N, H, block_q)
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
    q_tile, at = carve(smem, 0, block_q * (d_pad + TC_PAD))
    k_tiles, at = carve(smem, at, 2 * k_size)  # two of each: one in use, the next one arriving
    v_tiles, at = carve(smem, at, 2 * v_size)
    buffers = (q_tile, k_tiles, v_tiles, k_size, v_size)
    unit = copy_unit(vector, zero)
    copy_tile(q[b, h, i0:], i1 - i0, D, q_tile, d_pad + TC_PAD, block_q, d_pad, unit)
    commit()
    prm = bh_params(b, h, N, M, opts)
    options = (prm, opts, general, opts[O_IOPTS][I_MMA_TERMS], zero)
    lo, hi = block_key_range(i0, i1, b, h, N, M, opts)
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
