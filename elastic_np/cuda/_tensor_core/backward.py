"""The tensor-core backward: ``dq`` and ``dk``/``dv`` on ``mma.sync``, for the problems the simple forward takes.

Imports ``numba.cuda``; imported on first use by its launch,
`elastic_np.cuda._launch.backward`. It runs where the forward ran on the
tensor cores without the general score pipeline
(`elastic_np.cuda._launch.plan.tensor_core_backward`, ``needs_general``
False: the structural options, ``scale``, ``tau`` and ``beta``), and forms
the scores as that forward does (`dot_products`, the same split, the same
order of the products and of the k-steps, and `simple_logits`' rounding),
so that ``p = exp(z - lse)`` sees the logits whose ``lse`` the forward
wrote. The delta kernel is the SIMT one (`elastic_np.cuda._simt.backward`).
Two kernels, FlashAttention-2's partition with the forward's fragments
(`elastic_np.cuda._tensor_core.fragments`):

- ``dq``: a block of ``W`` warps owns ``16 W`` query rows of one (batch,
  head), as the forward; per K/V tile (double-buffered, ``cp.async``) each
  warp forms ``S = Q K^T`` and ``dP = dO V^T`` in the accumulator layout, ``ds
  = p (dp - delta) / tau`` where each entry lies, and adds ``ds K`` into its
  ``dq`` fragments, the ``ds`` fragment feeding the product in place (the
  forward's ``P V``, `add_products`). ``dtau``'s sum of ``dz s`` is kept per
  thread (compensated) and added over the block in thread order.
- ``dk``/``dv``: a block of ``W`` warps owns ``16 W`` keys of one (batch, kv
  head); over the query heads of the group and their query tiles (Q, dO,
  ``lse``, ``delta`` double-buffered) each warp forms ``S^T = K Q^T`` and
  ``dP^T = V dO^T``, ``p`` and ``ds`` where they lie, and adds ``p dO`` into
  ``dv`` and ``ds Q`` into ``dk``.

Every output entry has one owner thread that adds its terms in a fixed
order: the same bits every run. Heads up to ``width`` (64 or 128, a
kernel's compile-time fragment width) in one pass.
"""

import math

from numba import cuda

from elastic_np.cuda._device.async_copy import commit, copy_tile, wait_all, wait_prior
from elastic_np.cuda._device.basics import compensated_add, inline_device, problem_dims
from elastic_np.cuda._device.indices import (
    F_NEG_INF, F_ONE, F_SCALE, F_ZERO, I_MMA_TERMS, O_FOPTS, O_IOPTS, O_TAU, P_DSIGMA, P_DTAU,
)
from elastic_np.cuda._device.score import bh_params, block_key_range, block_query_range
from elastic_np.cuda._runtime.config import TC_BACKWARD_ONE_PASS, TC_BACKWARD_TILES, TC_PAD
from elastic_np.cuda._tensor_core.fragments import add_products, block_place, copy_unit, dot_products, simple_logits
from elastic_np.cuda._tensor_core.mma import splits


@inline_device
def _row_grads(s_frag, dp_frag, stats, tau_h, fopts, sums):
    """``dq``: logits in ``s_frag`` to ``ds = p (dp - delta) / tau``, ``p = exp(z - lse)``; ``sums += dz s``.

    ``stats = (lse, delta)`` of the thread's two rows, each a pair (top,
    bottom); ``sums`` the thread's compensated ``(total, carry)`` of ``dz
    s`` (``s = z tau``, the score), for ``dtau``.
    """
    lse, delta = stats
    neg_inf = fopts[F_NEG_INF]
    zero = fopts[F_ZERO]
    total = sums[0]
    carry = sums[1]
    for n in range(s_frag.shape[0]):
        for e in range(4):
            z = s_frag[n, e]
            ds = zero
            if z > neg_inf:
                dz = math.exp(z - lse[e // 2]) * (dp_frag[n, e] - delta[e // 2])
                total, carry = compensated_add(total, carry, dz * (z * tau_h))
                ds = dz / tau_h
            s_frag[n, e] = ds
    sums[0] = total
    sums[1] = carry


@inline_device
def _key_grads(s_frag, dp_frag, stats, tau_h, fopts, with_ds):
    """``dk``/``dv``: logits in ``s_frag`` to ``p``, and with ``with_ds`` ``dP^T`` in ``dp_frag`` to ``ds = p (dp - delta) / tau``.

    ``stats`` holds the query tile's ``lse``, then its ``delta`` (``8
    s_frag.shape[0]`` each); the thread's columns are queries ``8 n + 2 t``
    and ``8 n + 2 t + 1`` of the tile.
    """
    t = cuda.threadIdx.x % 4
    block_q = 8 * s_frag.shape[0]
    neg_inf = fopts[F_NEG_INF]
    zero = fopts[F_ZERO]
    for n in range(s_frag.shape[0]):
        for e in range(4):
            c = 8 * n + 2 * t + e % 2
            z = s_frag[n, e]
            p = zero
            ds = zero
            if z > neg_inf:
                p = math.exp(z - stats[c])
                if with_ds:
                    ds = p * (dp_frag[n, e] - stats[block_q + c]) / tau_h
            s_frag[n, e] = p
            if with_ds:
                dp_frag[n, e] = ds


@inline_device
def _zero(frag, zero):
    for e in range(frag.shape[0]):
        for x in range(4):
            frag[e, x] = zero


@inline_device
def _write_frag(dst, first, rows, cols, frag, scale):
    """``dst[first + g (+ 8), 8 e + 2 t (+ 1)] = scale frag`` for the thread's entries below ``rows``, ``cols``."""
    lane = cuda.threadIdx.x % 32
    g = lane // 4
    t = lane % 4
    for half in range(2):
        row = first + g + 8 * half
        if row < rows:
            for e in range(frag.shape[0]):
                for x in range(2):
                    col = 8 * e + 2 * t + x
                    if col < cols:
                        dst[row, col] = scale * frag[e, 2 * half + x]


@inline_device
def _block_sum(value, scratch, zero):
    """The compensated sum over the block of every thread's ``value``, in thread order (thread 0's result)."""
    scratch[cuda.threadIdx.x] = value
    cuda.syncthreads()
    total = zero
    carry = zero
    if cuda.threadIdx.x == 0:
        for r in range(cuda.blockDim.x):
            total, carry = compensated_add(total, carry, scratch[r])
    return total + carry


@inline_device
def _dq_tile(tiles, dims, place, options, frags):
    """A key tile of the ``dq`` kernel: ``S`` and ``dP``, ``ds`` where it lies, ``dq += ds K``.

    ``tiles = (q_tile, do_tile, k_tile, v_tile, stride)``, ``dims = (D,
    Dv)``, ``place = (row, N, j, hi)`` (`simple_logits`' ``rows`` and
    ``cols``), ``options = (prm, opts, stats, tau_h)`` (`_row_grads`'
    ``stats``).
    """
    q_tile, do_tile, k_tile, v_tile, stride = tiles
    D, Dv = dims
    row, N, j, hi = place
    prm, opts, stats, tau_h = options
    s_frag, dp_frag, dq_frag, sums = frags
    fopts = opts[O_FOPTS]
    zero = fopts[F_ZERO]
    terms = opts[O_IOPTS][I_MMA_TERMS]
    row0 = 16 * (cuda.threadIdx.x // 32)
    dot_products(q_tile, k_tile, stride, (D + 7) // 8 * 8, row0, terms, zero, s_frag, False)
    simple_logits(s_frag, (row, N), (j, hi), prm, fopts, False)
    dot_products(do_tile, v_tile, stride, (Dv + 7) // 8 * 8, row0, terms, zero, dp_frag, False)
    _row_grads(s_frag, dp_frag, stats, tau_h, fopts, sums)
    add_products(s_frag, k_tile, stride, terms, zero, dq_frag)


@inline_device
def _copy_pair(pair, first, dst, geometry, unit):
    """Start copying rows ``first ..`` of two arrays into two tiles: ``x``'s into ``dst``, ``y``'s after it.

    ``pair = (x, y, end)``: a (batch, head)'s rows of ``x`` (``D`` columns)
    and of ``y`` (``Dv``), zeros from row ``end``; ``geometry = (D, Dv,
    width, stride, rows)``: each tile ``rows x width`` at row stride
    ``stride``. The caller commits.
    """
    x, y, end = pair
    D, Dv, width, stride, rows = geometry
    copy_tile(x[first:], end - first, D, dst, stride, rows, width, unit)
    copy_tile(y[first:], end - first, Dv, dst[rows * stride :], stride, rows, width, unit)


@inline_device
def _dq(q, k, v, opts, vector, grads_in, dq, partials, frags):
    """The ``dq`` kernel's body, for the fragment arrays its caller sizes (see the module)."""
    s_frag, dp_frag, dq_frag, sums = frags
    dout, lse, delta = grads_in
    B, H, Hkv, N, M, D, Dv = problem_dims(q, k, v)
    warp = cuda.threadIdx.x // 32
    t = cuda.threadIdx.x % 4
    block_q = 16 * (cuda.blockDim.x // 32)
    b, h, i0, i1 = block_place(N, H, block_q)
    block_k = 8 * s_frag.shape[0]
    width = 8 * dq_frag.shape[0]
    stride = width + TC_PAD
    fopts = opts[O_FOPTS]
    zero = fopts[F_ZERO]
    smem = cuda.shared.array(0, dtype=q.dtype)
    tile = block_k * stride
    q_tile = smem[: block_q * stride]
    do_tile = smem[block_q * stride : 2 * block_q * stride]
    kv_tiles = smem[2 * block_q * stride :]  # K, V of the tile in use and of the next: (K0, V0, K1, V1)
    unit = copy_unit(vector, zero)
    _copy_pair((q[b, h], dout[b, h], i1), i0, smem, (D, Dv, width, stride, block_q), unit)
    commit()
    row = i0 + 16 * warp + cuda.threadIdx.x % 32 // 4
    stats = ((lse[b, h, min(row, N - 1)], lse[b, h, min(row + 8, N - 1)]),
             (delta[b, h, min(row, N - 1)], delta[b, h, min(row + 8, N - 1)]))
    prm = bh_params(b, h, N, M, opts)
    tau_h = opts[O_TAU][h]
    lo, hi = block_key_range(i0, i1, b, h, N, M, opts)
    n_k = (hi - lo + block_k - 1) // block_k if hi > lo else 0
    _zero(dq_frag, zero)
    sums[0] = zero
    sums[1] = zero
    kv = (k[b, h // (H // Hkv)], v[b, h // (H // Hkv)], hi)
    geometry = (D, Dv, width, stride, block_k)
    if n_k > 0:
        _copy_pair(kv, lo, kv_tiles, geometry, unit)
        commit()
    for it in range(n_k):
        j0 = lo + it * block_k
        cur = it % 2
        if it + 1 < n_k:  # the next tile into the other buffers, while this one is used
            _copy_pair(kv, j0 + block_k, kv_tiles[(1 - cur) * 2 * tile :], geometry, unit)
            commit()
            wait_prior()
        else:
            wait_all()
        cuda.syncthreads()  # this tile's copies (and Q's, dO's) are visible to every thread
        tiles = (q_tile, do_tile, kv_tiles[cur * 2 * tile :], kv_tiles[cur * 2 * tile + tile :], stride)
        _dq_tile(tiles, (D, Dv), (row, N, j0 + 2 * t, hi), (prm, opts, stats, tau_h), frags)
        cuda.syncthreads()  # every warp is done with these buffers before the next tile's copies reuse them
    wait_all()  # Q's and dO's copies, where the block had no key to wait for them
    _write_frag(dq[b, h], i0 + 16 * warp, N, D, dq_frag, fopts[F_SCALE])
    cuda.syncthreads()  # every warp is done with Q: it holds the block's sums
    total = _block_sum(sums[0] + sums[1], q_tile, zero)
    if cuda.threadIdx.x == 0:
        partials[b, h, i0 // block_q, P_DTAU] = total
        partials[b, h, i0 // block_q, P_DSIGMA] = zero


@inline_device
def _issue_queries(place, arrays, slot_tiles, geometry, unit):
    """Start copying query tile ``i0 ..`` of head ``h``: Q, dO, then ``lse`` and ``delta``, into one buffer slot."""
    b, h, i0, hi = place
    q, dout, lse, delta = arrays
    q_tile, _, stats = slot_tiles
    block_q = geometry[4]
    _copy_pair((q[b, h], dout[b, h], hi), i0, q_tile, geometry, unit)
    copy_tile(lse[b, h : h + 1, i0:], 1, hi - i0, stats, block_q, 1, block_q, 1)
    copy_tile(delta[b, h : h + 1, i0:], 1, hi - i0, stats[block_q:], block_q, 1, block_q, 1)
    commit()


@inline_device
def _slot(buffers, slot, sizes):
    """``(q_tile, do_tile, stats)`` of buffer slot ``slot`` (0 or 1): each slot's dO tile follows its Q tile."""
    pairs, stats_tiles = buffers
    q_size, stats_size = sizes
    q_tile = pairs[2 * slot * q_size :]
    return q_tile, q_tile[q_size:], stats_tiles[slot * stats_size :]


#: What a pass of the dk/dv kernel forms (`_dkdv_pass`): both, ``dv`` alone, ``dk`` alone.
_BOTH, _VALUES, _KEYS = 0, 1, 2


@inline_device
def _dkdv_pass(arrays, tiles, place, options, frags, mode):
    """One pass of the dk/dv block over the query heads of its group and their query tiles.

    ``mode`` (a constant): `_BOTH` adds ``p dO`` into ``acc_v`` and ``ds Q``
    into ``acc``; `_VALUES` only ``p dO``, into ``acc`` (no ``dP^T``);
    `_KEYS` only ``ds Q``, into ``acc``.
    """
    q, k, v, dout, lse, delta, opts = arrays
    k_tile, v_tile, buffers, sizes, geometry = tiles
    b, hk, j0, j1 = place
    terms, zero, unit = options
    s_frag, dp_frag, acc, acc_v = frags
    B, H, Hkv, N, M, D, Dv = problem_dims(q, k, v)
    group = H // Hkv
    warp = cuda.threadIdx.x // 32
    g = cuda.threadIdx.x % 32 // 4
    t = cuda.threadIdx.x % 4
    block_q = 8 * s_frag.shape[0]
    stride = geometry[3]
    fopts = opts[O_FOPTS]
    for h in range(hk * group, (hk + 1) * group):
        prm = bh_params(b, h, N, M, opts)
        tau_h = opts[O_TAU][h]
        lo, hi = block_query_range(j0, j1, b, h, N, M, opts)
        n_q = (hi - lo + block_q - 1) // block_q if hi > lo else 0
        if n_q > 0:
            _issue_queries((b, h, lo, hi), (q, dout, lse, delta), _slot(buffers, 0, sizes), geometry, unit)
        for it in range(n_q):
            i0 = lo + it * block_q
            cur = it % 2
            if it + 1 < n_q:  # the next query tile into the other buffers, while this one is used
                _issue_queries((b, h, i0 + block_q, hi), (q, dout, lse, delta), _slot(buffers, 1 - cur, sizes),
                               geometry, unit)
                wait_prior()
            else:
                wait_all()
            cuda.syncthreads()  # this tile's copies (and K's, V's) are visible to every thread
            q_tile, do_tile, stats = _slot(buffers, cur, sizes)
            dot_products(k_tile, q_tile, stride, (D + 7) // 8 * 8, 16 * warp, terms, zero, s_frag, True)
            simple_logits(s_frag, (j0 + 16 * warp + g, j1), (i0 + 2 * t, hi), prm, fopts, True)
            if mode == _VALUES:
                _key_grads(s_frag, dp_frag, stats, tau_h, fopts, False)
                add_products(s_frag, do_tile, stride, terms, zero, acc)
            else:
                dot_products(v_tile, do_tile, stride, (Dv + 7) // 8 * 8, 16 * warp, terms, zero, dp_frag, False)
                _key_grads(s_frag, dp_frag, stats, tau_h, fopts, True)
                if mode == _BOTH:
                    add_products(s_frag, do_tile, stride, terms, zero, acc_v)
                add_products(dp_frag, q_tile, stride, terms, zero, acc)
            cuda.syncthreads()  # every warp is done with these buffers before the next tile's copies reuse them
    wait_all()  # K's and V's copies, where the block had no query to wait for them


@inline_device
def _dkdv(q, k, v, opts, vector, grads_in, dk, dv, frags):
    """The ``dk``/``dv`` kernel's body, for the fragment arrays its caller sizes (see the module).

    ``frags = (s_frag, dp_frag, acc, acc_v)``. One pass over the query tiles
    adds into ``acc`` (``dk``) and ``acc_v`` (``dv``) together where the
    fragments hold at most ``TC_BACKWARD_ONE_PASS`` words a thread; else two
    (a compile-time choice): the first forms only ``p`` and ``dv`` in
    ``acc``, the second ``ds`` and ``dk`` in ``acc`` again, at the cost of
    forming ``S^T`` twice.
    """
    s_frag, dp_frag, acc, acc_v = frags
    dout, lse, delta = grads_in
    B, H, Hkv, N, M, D, Dv = problem_dims(q, k, v)
    warp = cuda.threadIdx.x // 32
    block_k = 16 * (cuda.blockDim.x // 32)
    b, hk, j0, j1 = block_place(M, Hkv, block_k)
    block_q = 8 * s_frag.shape[0]
    width = 8 * acc.shape[0]
    stride = width + TC_PAD
    fopts = opts[O_FOPTS]
    zero = fopts[F_ZERO]
    smem = cuda.shared.array(0, dtype=q.dtype)
    q_size = block_q * stride
    k_tile = smem[: block_k * stride]
    v_tile = smem[block_k * stride : 2 * block_k * stride]
    at = 2 * block_k * stride
    buffers = (smem[at : at + 4 * q_size], smem[at + 4 * q_size :])  # (Q0, dO0, Q1, dO1), then lse and delta twice
    unit = copy_unit(vector, zero)
    _copy_pair((k[b, hk], v[b, hk], j1), j0, smem, (D, Dv, width, stride, block_k), unit)
    commit()
    arrays = (q, k, v, dout, lse, delta, opts)
    tiles = (k_tile, v_tile, buffers, (q_size, 2 * block_q), (D, Dv, width, stride, block_q))
    place = (b, hk, j0, j1)
    options = (opts[O_IOPTS][I_MMA_TERMS], zero, unit)
    first = j0 + 16 * warp
    _zero(acc, zero)
    if (width + block_q) * (1 if splits(zero) else 2) > TC_BACKWARD_ONE_PASS:
        _dkdv_pass(arrays, tiles, place, options, frags, _VALUES)
        _write_frag(dv[b, hk], first, j1, Dv, acc, fopts[F_ONE])
        _zero(acc, zero)
        _dkdv_pass(arrays, tiles, place, options, frags, _KEYS)
    else:
        _zero(acc_v, zero)
        _dkdv_pass(arrays, tiles, place, options, frags, _BOTH)
        _write_frag(dv[b, hk], first, j1, Dv, acc_v, fopts[F_ONE])
    _write_frag(dk[b, hk], first, j1, D, acc, fopts[F_SCALE])


def _kernel(kind, tile, width):
    """A ``"dq"`` kernel with key tiles of ``tile`` keys, or a ``"dkdv"`` one with query tiles of ``tile``.

    Heads (``D`` and ``Dv``) up to ``width`` columns; the fragment shapes are
    compile-time constants of each kernel.
    """
    s_shape = (tile // 8, 4)
    w_shape = (width // 8, 4)
    if kind == "dq":
        def kernel(q, k, v, opts, vector, grads_in, dq, partials):
            frags = (cuda.local.array(s_shape, q.dtype), cuda.local.array(s_shape, q.dtype),
                     cuda.local.array(w_shape, q.dtype), cuda.local.array(2, q.dtype))
            _dq(q, k, v, opts, vector, grads_in, dq, partials, frags)
        doc = f"One block per (batch * head, query tile): key tiles of {tile}, heads up to {width}."
    else:
        def kernel(q, k, v, opts, vector, grads_in, dk, dv):
            frags = (cuda.local.array(s_shape, q.dtype), cuda.local.array(s_shape, q.dtype),
                     cuda.local.array(w_shape, q.dtype), cuda.local.array(w_shape, q.dtype))
            _dkdv(q, k, v, opts, vector, grads_in, dk, dv, frags)
        doc = f"One block per (batch * kv head, key tile): query tiles of {tile}, heads up to {width}."
    kernel.__name__ = kernel.__qualname__ = f"_backward_tc_{kind}_t{tile}_w{width}"
    kernel.__doc__ = doc
    return cuda.jit(cache=True)(kernel)


_BUILT = {}


def kernel(kind, tile, width):
    """The kernel of key ``(kind, tile, width)`` (`_kernel`), built on first use."""
    key = (kind, tile, width)
    if key not in _BUILT:
        _BUILT[key] = _kernel(kind, tile, width)
    return _BUILT[key]


#: The tensor-core backward kernels of the config's tiles (`elastic_np.cuda._runtime.config.TC_BACKWARD_TILES`)
#: by ``(kind, tile, width)``: what the PTX and resource reports compile.
KERNELS = {(kind, tile, width): kernel(kind, tile, width) for (kind, _, width), tile in sorted(TC_BACKWARD_TILES.items())}
