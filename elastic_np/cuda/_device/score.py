"""Device functions and option indices shared by the numba.cuda kernels.

Imported by the kernel modules only (so only when the CUDA backend is asked
for). The kernels' conventions are described in `elastic_np.cuda._kernels`;
this module holds
what every kernel uses: the indices of the ``opts`` tuple (``O_*``) and of
the packed option arrays in it (``I_*``, ``F_*``, ``C_*``), the key and
query ranges that decide tile skipping, the per-entry score pipeline
(`_bh_params` read once per block, `_entry` per score: keep, bias, score,
NVM, gate), the warp-level reductions of a row group, the kernels' common
prologue (`_dims`, `_tile_block`, the shared-memory tiles: `_carve`,
`_flash_tiles`, `_fill`) and the register micro-tile products.
"""

import math

import numba
from numba import cuda

from elastic_np._contract._ranges import key_range, query_range
from elastic_np.cuda._runtime.config import ACC_COLS, REG_M, REG_N

# opts: the option arrays every kernel takes, as one tuple (built by `elastic_np.cuda._api._launch_options`)
O_MASK = 0
O_KV_LENGTHS = 1
O_BAND = 2
O_IOPTS = 3
O_FOPTS = 4
O_TAU = 5
O_BETA = 6
O_BH_CONSTS = 7
O_BIAS = 8
O_COUNT = 9

# iopts
I_CAUSAL = 0
I_LEFT = 1
I_RIGHT = 2
I_HAS_MASK = 3
I_NVM = 4
I_HAS_GATE = 5
I_HAS_ALIBI = 6
I_HAS_BIAS = 7
I_BIAS_SB = 8  # element strides of the bias, 0 where broadcast
I_BIAS_SH = 9
I_BIAS_SI = 10
I_BIAS_SJ = 11
I_DBIAS_FULL = 12  # the bias is (B, H, N, M): the dq kernel writes dbias itself
I_ALIGN_KV = 13  # align="kv_lengths": the last query sits at kv_lengths[b], not M (`_diag_shift`)
I_DBIAS_B = 14  # the bias's compact shape (its own, padded to 4 dims): the layout of dbias, C order
I_DBIAS_H = 15
I_DBIAS_I = 16
I_DBIAS_J = 17
I_MMA_TERMS = 18  # tensor-core products per float32 product: 3 (3xTF32) or 1 (TF32; float64)
I_COUNT = 19

# fopts
F_SCALE = 0
F_SHARPNESS = 1
F_THRESHOLD = 2
F_ZERO = 3
F_NEG_INF = 4
F_ONE = 5
F_SOFTCAP = 6  # 0: no soft-cap
F_COUNT = 7

# bh_consts, per (b, h); the window works with u = x / sigma, which neither
# over- nor underflows where the bell is open, unlike sigma^2 and sigma^3
C_NORM = 0  # 1 / (sigma sqrt(2 pi))
C_INV_SIGMA = 1  # 1 / sigma
C_ALIBI = 2  # the ALiBi slope
C_U_SCALE = 3  # u per offset: 2 / ((E_b - 1) sigma), or 0 for E_b <= 1 (E_b: see `_diag_shift`)
C_COUNT = 4

# partials of the dq kernel, per (b, h, query tile)
P_DTAU = 0  # sum dz * s
P_DSIGMA = 1  # sum dz * dlogG/dsigma
P_COUNT = 2


def inline_device(fn):
    """``cuda.jit(device=True, forceinline=True)``: inlined at the NVVM IR level.

    For the device functions that take the kernels' register micro-tiles
    (``cuda.local.array`` s): once inlined and unrolled, their indices are
    constants and the arrays become registers. The simulator's ``jit`` has no
    ``forceinline`` (and nothing to inline).
    """
    try:
        return cuda.jit(device=True, forceinline=True)(fn)
    except TypeError:
        return cuda.jit(device=True)(fn)


@inline_device
def _constants(opts):
    """``(fopts, zero, neg_inf)``: the float option array of ``opts`` and its 0 and ``-inf`` (in the kernel's dtype)."""
    fopts = opts[O_FOPTS]
    return fopts, fopts[F_ZERO], fopts[F_NEG_INF]


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
def _key_range(i0, i1, b, h, N, M, opts):
    """Keys ``[lo, hi)`` that queries ``[i0, i1)`` can keep (`elastic_np._contract._ranges.key_range`)."""
    band = opts[O_BAND]
    kv_lengths = opts[O_KV_LENGTHS]
    diag_shift = _diag_shift(b, N, M, opts)
    return key_range(diag_shift, i0, i1, band[b, h, 0], band[b, h, 1], kv_lengths[b])


@cuda.jit(device=True)
def _query_range(j0, j1, b, h, N, M, opts):
    """Queries ``[lo, hi)`` that can keep one of the keys ``[j0, j1)`` (`elastic_np._contract._ranges.query_range`)."""
    band = opts[O_BAND]
    if j0 >= opts[O_KV_LENGTHS][b]:
        return 0, 0
    return query_range(_diag_shift(b, N, M, opts), j0, j1, band[b, h, 0], band[b, h, 1], N)


@cuda.jit(device=True)
def _structural_keep(b, h, i, j, prm, mask):
    """Causal, window, ``kv_lengths`` and ``mask`` conditions of entry ``(i, j)``.

    The options come from ``prm``, `_bh_params`'s scalars, read once per block.
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
def _compensated_add(total, carry, term):
    """Neumaier's compensated sum: add ``term`` to ``total`` keeping the lost low part in ``carry``."""
    new_total = total + term
    if abs(total) >= abs(term):
        carry += (total - new_total) + term
    else:
        carry += (term - new_total) + total
    return new_total, carry


@cuda.jit(device=True)
def _log_add_exp(a, b):
    """``log(exp(a) + exp(b))`` for finite ``a``, ``b``."""
    hi = max(a, b)
    return hi + math.log1p(math.exp(min(a, b) - hi))


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
def _bh_params(b, h, N, M, opts):
    """The options of `_entry` for batch ``b``, head ``h``, read from the option arrays once per block."""
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
def _entry_keep(b, h, i, j, prm, opts):
    """``(kept, bias_value)``: the structural conditions and the bias of entry ``(b, h, i, j)``.

    The first half of the score pipeline, before the dot product is needed:
    an entry the causal, window, ``kv_lengths`` or mask conditions remove,
    or whose bias is ``-inf``, is not kept. ``prm`` is `_bh_params`'s tuple.
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
def _entry_logit(dot, i, j, bias_value, prm, fopts):
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
def _entry(dot, b, h, i, j, prm, opts):
    """The whole score pipeline of entry ``(b, h, i, j)``: `_entry_logit`'s tuple, ``z = -inf`` when removed."""
    fopts = opts[O_FOPTS]
    kept, bias_value = _entry_keep(b, h, i, j, prm, opts)
    if not kept:
        zero = fopts[F_ZERO]
        return fopts[F_NEG_INF], zero, zero, zero, zero
    return _entry_logit(dot, i, j, bias_value, prm, fopts)


@cuda.jit(device=True)
def _tile_entry(tile, stride, micro, queries, keys, r, n, prm, opts):
    """Entry ``(r, n)`` of the thread's micro-tile of a key tile, scored: ``(at, i, j, z, s, cap_slope, f, u)``.

    ``micro = (row0, c, tpr)`` (`_tile_block`), ``queries = (b, h, i_first,
    N)``, ``keys = (j0, jn)``: the entry is row ``row0 + r`` and key ``c +
    tpr n`` of the tile, query ``i = i_first + r`` and key ``j``; ``tile[at]``
    holds its dot product. The rest is `_entry`'s tuple, with ``z = -inf``
    past the tile's ``jn`` keys or the ``N`` queries. The forward's softmax
    and the ``dq`` kernel's recomputation score their entries here alike.
    """
    row0, c, tpr = micro
    b, h, i_first, N = queries
    j0, jn = keys
    jj = c + tpr * n
    at = (row0 + r) * stride + jj
    i = i_first + r
    j = j0 + jj
    if jj < jn and i < N:
        z, s, cap_slope, f, u = _entry(tile[at], b, h, i, j, prm, opts)
        return at, i, j, z, s, cap_slope, f, u
    fopts = opts[O_FOPTS]
    zero = fopts[F_ZERO]
    return at, i, j, fopts[F_NEG_INF], zero, zero, zero, zero


@cuda.jit(device=True)
def _finish_row(row_max, row_sum, beta_h, fopts):
    """``(lse, num, den)`` of a row from its running max and sum: ``out = (acc num) / den``.

    ``lse = log(row_sum exp(row_max) + beta)``; ``out = acc / (row_sum +
    beta exp(-row_max))``, computed directly rather than as ``acc exp(row_max
    - lse)``, which would turn the rounding of ``lse`` into a relative error
    of ``out``, and as a quotient (one rounding, not two through a
    reciprocal). A row that kept nothing has ``out = 0`` and ``lse = log(beta)``.
    """
    zero = fopts[F_ZERO]
    one = fopts[F_ONE]
    if row_sum > zero:
        row_lse = row_max + math.log(row_sum)
        num = one
        den = row_sum
        if beta_h > zero:
            log_beta = math.log(beta_h)
            row_lse = _log_add_exp(row_lse, log_beta)
            gap = log_beta - row_max  # beta exp(-row_max) = exp(gap); no exp of a positive gap
            if gap > zero:
                num = math.exp(-gap)
                den = row_sum * num + one
            else:
                den = row_sum + math.exp(gap)
        return row_lse, num, den
    row_lse = fopts[F_NEG_INF]
    if beta_h > zero:
        row_lse = math.log(beta_h)
    return row_lse, zero, one


@inline_device
def unsigned(index):
    """``index`` as an unsigned integer: Numba indexes with it without the wraparound test of a signed one.

    The test (``index < 0``: add the length) kept every shared-memory address
    apart; unsigned, the addresses of a fragment share one base and constant
    offsets, and stay out of the registers.
    """
    return numba.uint64(index)


@inline_device
def _lane_mask(t, threads):
    """The shuffle mask of thread ``t``'s warp: its lanes that exist in a block of ``threads``."""
    lanes = min(32, threads - (t - t % 32))
    if lanes >= 32:
        return numba.uint32(0xFFFFFFFF)
    return numba.uint32((1 << lanes) - 1)


@inline_device
def _group_max(value, width, lanes):
    """The max of ``value`` over an aligned group of ``width`` lanes (a power of two <= 32), in every lane."""
    offset = 16
    for _ in range(5):  # a fixed trip count, unrolled; the steps past the group are skipped
        if offset < width:
            value = max(value, cuda.shfl_xor_sync(lanes, value, offset))
        offset //= 2
    return value


@inline_device
def _group_sum(value, width, lanes):
    """The sum of ``value`` over an aligned group of ``width`` lanes, bit-identical in every lane.

    A butterfly: at each step two lanes add the same two numbers (in swapped
    order, which IEEE addition does not see), so every lane ends with the
    same bits, run after run.
    """
    offset = 16
    for _ in range(5):
        if offset < width:
            value = value + cuda.shfl_xor_sync(lanes, value, offset)
        offset //= 2
    return value


@inline_device
def _stage(src, r0, rows, c0, cols, dst, stride, t, threads):
    """Copy ``src[r0:r0 + rows, c0:c0 + cols]`` to ``dst`` (row stride ``stride``), coalesced.

    ``src`` is one (batch, head) of an operand: ``q[b, h]``, ``k[b, hk]``.
    """
    for idx in range(t, rows * cols, threads):
        dst[(idx // cols) * stride + idx % cols] = src[r0 + idx // cols, c0 + idx % cols]


# ---------------------------------------------------------------------------
# Kernel prologues: shapes, the block's place, shared-memory tiles
# ---------------------------------------------------------------------------


@inline_device
def _dims(q, k, v):
    """``(B, H, Hkv, N, M, D, Dv)`` from the shapes of ``q``, ``k``, ``v`` (the order of ``AttentionProblem.shape``)."""
    B, H, N, D = q.shape
    return B, H, k.shape[1], N, k.shape[2], D, v.shape[3]


@inline_device
def _tile_block(rows, heads, cols):
    """The place of a micro-tile kernel's block and thread: a block per (batch * head, tile of rows), tiles fastest.

    ``rows`` are what the block owns a tile of (queries for the forward and
    ``dq`` kernels, keys for ``dk``/``dv``), ``heads`` the heads of its grid,
    ``cols`` the length of the tiles it loops over. The block's threads form
    groups of ``tpr = cols / REG_N`` lanes; each group owns ``REG_M`` rows.
    Returns ``(threads, t, tpr, block_rows, row0, c, tile, b, h, r0, r1)``:
    thread ``t`` of ``threads`` is lane ``c`` of the group whose rows start at
    ``row0`` in the block's ``block_rows``, and the block holds rows ``[r0,
    r1)``, tile ``tile``, of batch ``b``, head ``h``.
    """
    threads = cuda.blockDim.x
    t = cuda.threadIdx.x
    tpr = cols // REG_N
    block_rows = threads // tpr * REG_M
    row0 = t // tpr * REG_M
    c = t % tpr
    n_tiles = (rows + block_rows - 1) // block_rows
    tile = cuda.blockIdx.x % n_tiles
    b = cuda.blockIdx.x // n_tiles // heads
    h = cuda.blockIdx.x // n_tiles % heads
    r0 = tile * block_rows
    return threads, t, tpr, block_rows, row0, c, tile, b, h, r0, min(r0 + block_rows, rows)


@inline_device
def _carve(smem, at, size):
    """``(smem[at:at + size], at + size)``: the next tile of the block's dynamic shared memory, and its end."""
    return smem[at : at + size], at + size


@inline_device
def _flash_tiles(smem, rows, D, width, block_k):
    """The tiles the forward and decode kernels start their shared memory with, and their strides.

    ``(q_tile, q_stride, kv_tile, kv_stride, p_tile, p_stride, end)``: ``rows``
    query rows (row stride ``D + 1``), the K/V tile of ``block_k`` keys (K,
    then V's ``width`` columns of a pass, in the same buffer; row stride
    ``max(D + 1, width)``) and the ``rows x block_k`` tile of ``p`` (row
    stride ``block_k + 1``); ``end`` is the offset past them.
    """
    q_stride = D + 1
    kv_stride = max(D + 1, width)
    p_stride = block_k + 1
    q_tile, at = _carve(smem, 0, rows * q_stride)
    kv_tile, at = _carve(smem, at, block_k * kv_stride)
    p_tile, at = _carve(smem, at, rows * p_stride)
    return q_tile, q_stride, kv_tile, kv_stride, p_tile, p_stride, at


@inline_device
def _fill(tile, size, value, t, threads):
    """``tile[:size] = value``, thread ``t`` of the block's ``threads`` taking every ``threads``-th entry."""
    for idx in range(t, size, threads):
        tile[idx] = value


@inline_device
def _store_tile(scores, tile, stride, micro):
    """``tile[row0 + r, c + tpr n] = scores[r, n]`` (row stride ``stride``): a register micro-tile to shared memory.

    ``micro = (row0, c, tpr)`` is the thread's place in the block's micro-tiles (`_tile_block`).
    """
    row0, c, tpr = micro
    for r in range(REG_M):
        for n in range(REG_N):
            tile[(row0 + r) * stride + c + tpr * n] = scores[r, n]


@inline_device
def _load_rows(dst, tile, stride, row0, col):
    """``dst[r] = tile[row0 + r, col]`` for the thread's ``REG_M`` rows (row stride ``stride``)."""
    for r in range(REG_M):
        dst[r] = tile[(row0 + r) * stride + col]


@inline_device
def _outer_add(acc, a, b, cols):
    """``acc[r, e] += a[r] b[e]`` for ``r < REG_M``, ``e < cols``: a rank-one update of a register micro-tile."""
    for r in range(REG_M):
        for e in range(cols):
            acc[r, e] += a[r] * b[e]


@inline_device
def _tile_dot(q_tile, q_stride, k_tile, k_stride, D, micro, zero, scores):
    """``scores[r, n] = q_tile[row0 + r] . k_tile[c + tpr n]``: a ``REG_M x REG_N`` register micro-tile.

    ``micro = (row0, c, tpr)``. Per step of ``d`` a thread reads ``REG_M``
    query and ``REG_N`` key values from shared memory and does ``REG_M REG_N``
    multiply-adds on registers.
    """
    row0, c, tpr = micro
    for r in range(REG_M):
        for n in range(REG_N):
            scores[r, n] = zero
    qv = cuda.local.array(REG_M, q_tile.dtype)
    kv = cuda.local.array(REG_N, q_tile.dtype)
    for d in range(D):
        _load_rows(qv, q_tile, q_stride, row0, d)
        for n in range(REG_N):
            kv[n] = k_tile[(c + tpr * n) * k_stride + d]
        _outer_add(scores, qv, kv, REG_N)


@inline_device
def _tile_pv(p_tile, p_stride, v_tile, v_stride, jn, wn, micro, zero, acc):
    """``acc[r, e] += sum_jj p_tile[row0 + r, jj] v_tile[jj, c + tpr e]``, a ``REG_M x ACC_COLS`` micro-tile.

    ``micro = (row0, c, tpr)``; ``jn`` rows of ``v_tile``, columns past ``wn`` read as 0.
    """
    row0, c, tpr = micro
    pv = cuda.local.array(REG_M, p_tile.dtype)
    vv = cuda.local.array(ACC_COLS, p_tile.dtype)
    for jj in range(jn):
        _load_rows(pv, p_tile, p_stride, row0, jj)
        for e in range(ACC_COLS):
            col = c + tpr * e
            vv[e] = v_tile[jj * v_stride + col] if col < wn else zero
        _outer_add(acc, pv, vv, ACC_COLS)
