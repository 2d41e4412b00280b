"""The numba.cuda kernels of `elastic_np.cuda` (imported only by that module).

Importing this module imports ``numba.cuda``; `elastic_np.cuda` does so only
when the CUDA backend is asked for. The host functions that launch these
kernels, and the reasoning behind the design, are in `elastic_np.cuda`.

Conventions shared by every kernel:

- ``q, k, v`` are C-contiguous ``(B, H, N, D)``, ``(B, Hkv, M, D)``,
  ``(B, Hkv, M, Dv)`` arrays of one real dtype; every floating argument is in
  that dtype, so a float32 kernel computes in float32 throughout.
- Options travel as runtime values: ``iopts`` (int64, indexed by the ``I_*``
  constants), ``fopts`` (the dtype, indexed by ``F_*``), ``tau``/``beta``
  ``(H,)``, ``bh_consts`` ``(B, H, C_COUNT)`` (the per-(b, h) constants: the
  window's and the ALiBi slope; ``(1, 1, C_COUNT)`` when neither is given),
  ``band`` int64 ``(B, H)`` (half-width in keys of the window's open band, -1
  unbounded), ``kv_lengths`` int64 ``(B,)`` and ``mask`` uint8 with each of its
  four dims either full or 1 (broadcast).
- The additive ``bias`` is a flat array (the dtype) of the caller's distinct
  entries; entry ``(b, h, i, j)`` is ``bias[b sb + h sh + i si + j sj]`` with
  the element strides ``iopts[I_BIAS_SB:I_BIAS_SJ + 1]``, 0 on the axes it is
  broadcast along. Without a bias it is a one-element dummy, never read.
- The score of an entry is built in the contract's order (`_score`): scaled
  dot product, soft-cap (``fopts[F_SOFTCAP] > 0``), ALiBi, bias; a ``-inf``
  bias removes the entry like a false mask entry, and NVM tests the final score.
- Shared memory is one dynamic array, carved into tiles by offsets. A tile that
  a thread reads along its own row has a row stride of ``dim + 1`` so that the
  threads of a warp fall in different banks.
"""

import math

from numba import cuda

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
I_ALIGN_KV = 13  # align="kv_lengths": the last query sits at kv_lengths[b], not M (`_shift`)
I_COUNT = 14

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
C_U_SCALE = 3  # u per offset: 2 / ((E_b - 1) sigma), or 0 for E_b <= 1 (E_b: see `_shift`)
C_COUNT = 4

# partials of the dq kernel, per (b, h, query tile)
P_DTAU = 0  # sum dz * s
P_DSIGMA = 1  # sum dz * dlogG/dsigma
P_COUNT = 2


@cuda.jit(device=True)
def _real(value, like):
    """``value`` converted to the dtype of the array ``like``."""
    cell = cuda.local.array(1, dtype=like.dtype)
    cell[0] = value
    return cell[0]


@cuda.jit(device=True)
def _shift(b, N, M, iopts, kv_lengths):
    """``E_b - N``: query ``i`` of batch ``b`` sits at position ``i + E_b - N``.

    ``E_b`` is ``M`` (``align="array"``) or ``kv_lengths[b]`` (``align="kv_lengths"``);
    entry ``(i, j)`` is at offset ``j - i - (E_b - N)``.
    """
    if iopts[I_ALIGN_KV] != 0:
        return kv_lengths[b] - N
    return M - N


@cuda.jit(device=True)
def _key_range(i0, i1, b, h, N, M, iopts, kv_lengths, band):
    """Keys ``[lo, hi)`` that queries ``[i0, i1)`` can keep: the tiles outside are skipped."""
    off = _shift(b, N, M, iopts, kv_lengths)
    lo = 0
    hi = kv_lengths[b]
    if iopts[I_CAUSAL] != 0:
        hi = min(hi, i1 + off)
    if iopts[I_RIGHT] >= 0:
        hi = min(hi, i1 + off + iopts[I_RIGHT])
    if iopts[I_LEFT] >= 0:
        lo = max(lo, i0 + off - iopts[I_LEFT])
    r = band[b, h]
    if r >= 0:
        lo = max(lo, i0 + off - r)
        hi = min(hi, i1 + off + r)
    return lo, hi


@cuda.jit(device=True)
def _query_range(j0, j1, b, h, N, M, iopts, kv_lengths, band):
    """Queries ``[lo, hi)`` that can keep one of the keys ``[j0, j1)``."""
    off = _shift(b, N, M, iopts, kv_lengths)
    lo = 0
    hi = N
    if j0 >= kv_lengths[b]:
        hi = 0
    if iopts[I_CAUSAL] != 0:
        lo = max(lo, j0 - off)
    if iopts[I_RIGHT] >= 0:
        lo = max(lo, j0 - off - iopts[I_RIGHT])
    if iopts[I_LEFT] >= 0:
        hi = min(hi, j1 - off + iopts[I_LEFT])
    r = band[b, h]
    if r >= 0:
        lo = max(lo, j0 - off - r)
        hi = min(hi, j1 - off + r)
    return lo, hi


@cuda.jit(device=True)
def _structural_keep(b, h, i, j, off, kv_length, causal, left, right, has_mask, mask):
    """Causal, window, ``kv_lengths`` and ``mask`` conditions of entry ``(i, j)``.

    ``off`` is `_shift`'s; the options come in as scalars the kernel read once.
    """
    d = j - i - off
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
def _gate(i, j, off, u_scale, norm, threshold, sharpness, fopts):
    """The dynamic window at ``(i, j)``: gate ``G`` (0 when closed), bell ``f``, ``u = x / sigma``."""
    u = u_scale * _real(j - i - off, fopts)
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
    """The final score of an entry at offset ``d`` (see `_shift`) and ``ds / ds_raw``.

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


@cuda.jit(cache=True)
def _forward_kernel(q, k, v, mask, kv_lengths, band, iopts, fopts, tau, beta, bh_consts, bias, block_n, out, lse):
    """One block per (batch * head, query tile); thread ``t`` owns query row ``i0 + t``.

    The grid is one-dimensional, query tiles fastest, so that the blocks that
    share a head's K/V run side by side. The block walks the K/V tiles of its
    key range (staged in shared memory) and each thread keeps an online
    softmax: running max ``row_max``, running sum ``row_sum`` and the
    unnormalised output row ``acc`` (in shared memory).
    """
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    M = k.shape[2]
    Dv = v.shape[3]
    block_m = cuda.blockDim.x
    t = cuda.threadIdx.x
    n_tiles = (N + block_m - 1) // block_m
    tile = cuda.blockIdx.x % n_tiles
    b = cuda.blockIdx.x // n_tiles // H
    h = cuda.blockIdx.x // n_tiles % H
    hk = h // (H // Hkv)
    i0 = tile * block_m
    i1 = min(i0 + block_m, N)
    i = i0 + t
    row = i < N

    q_stride = D + 1
    acc_stride = Dv + 1
    smem = cuda.shared.array(0, dtype=q.dtype)
    q_tile = smem[: block_m * q_stride]
    acc = smem[block_m * q_stride : block_m * (q_stride + acc_stride)]
    k_base = block_m * (q_stride + acc_stride)
    k_tile = smem[k_base : k_base + block_n * D]
    v_tile = smem[k_base + block_n * D : k_base + block_n * (D + Dv)]

    zero = fopts[F_ZERO]
    for idx in range(t, (i1 - i0) * D, block_m):
        q_tile[(idx // D) * q_stride + idx % D] = q[b, h, i0 + idx // D, idx % D]
    for d in range(Dv):
        acc[t * acc_stride + d] = zero

    scale = fopts[F_SCALE]
    tau_h = tau[h]
    nvm = iopts[I_NVM] != 0
    has_gate = iopts[I_HAS_GATE] != 0
    causal = iopts[I_CAUSAL] != 0
    left = iopts[I_LEFT]
    right = iopts[I_RIGHT]
    has_mask = iopts[I_HAS_MASK] != 0
    kv_length = kv_lengths[b]
    shift = _shift(b, N, M, iopts, kv_lengths)
    threshold = fopts[F_THRESHOLD]
    sharpness = fopts[F_SHARPNESS]
    softcap = fopts[F_SOFTCAP]
    neg_inf = fopts[F_NEG_INF]
    has_bias = iopts[I_HAS_BIAS] != 0
    bias_row = b * iopts[I_BIAS_SB] + h * iopts[I_BIAS_SH] + i * iopts[I_BIAS_SI]
    bias_sj = iopts[I_BIAS_SJ]
    alibi_slope = zero
    if iopts[I_HAS_ALIBI] != 0:
        alibi_slope = bh_consts[b, h, C_ALIBI]
    g_norm = zero
    u_scale = zero
    if has_gate:
        g_norm = bh_consts[b, h, C_NORM]
        u_scale = bh_consts[b, h, C_U_SCALE]
    row_max = fopts[F_NEG_INF]
    row_sum = zero
    lo, hi = _key_range(i0, i1, b, h, N, M, iopts, kv_lengths, band)
    for j0 in range(lo, hi, block_n):
        jn = min(block_n, hi - j0)
        cuda.syncthreads()  # the previous tile is consumed (and q_tile written)
        for idx in range(t, jn * D, block_m):
            k_tile[idx] = k[b, hk, j0 + idx // D, idx % D]
        for idx in range(t, jn * Dv, block_m):
            v_tile[idx] = v[b, hk, j0 + idx // Dv, idx % Dv]
        cuda.syncthreads()
        if not row:
            continue
        for jj in range(jn):
            j = j0 + jj
            if not _structural_keep(b, h, i, j, shift, kv_length, causal, left, right, has_mask, mask):
                continue
            bias_value = zero
            if has_bias:
                bias_value = bias[bias_row + j * bias_sj]
                if bias_value == neg_inf:  # removed, like a false mask entry
                    continue
            dot = zero
            for d in range(D):
                dot += q_tile[t * q_stride + d] * k_tile[jj * D + d]
            s, cap_slope = _score(dot, j - i - shift, scale, softcap, alibi_slope, bias_value, fopts)
            if nvm and s < zero:
                continue
            z = s / tau_h
            if has_gate:
                G, f, u = _gate(i, j, shift, u_scale, g_norm, threshold, sharpness, fopts)
                if not G > zero:
                    continue
                z += math.log(G)
            if z > row_max:
                rescale = math.exp(row_max - z)
                row_sum *= rescale
                for d in range(Dv):
                    acc[t * acc_stride + d] *= rescale
                row_max = z
            p = math.exp(z - row_max)
            row_sum += p
            for d in range(Dv):
                acc[t * acc_stride + d] += p * v_tile[jj * Dv + d]

    if not row:
        return
    beta_h = beta[h]
    if row_sum > zero:
        # lse = log(row_sum * exp(row_max) + beta); out = acc / (row_sum + beta exp(-row_max)),
        # normalised directly rather than by exp(row_max - lse), which would turn
        # the rounding of lse into a relative error of out
        row_lse = row_max + math.log(row_sum)
        norm = fopts[F_ONE] / row_sum
        if beta_h > zero:
            log_beta = math.log(beta_h)
            row_lse = _log_add_exp(row_lse, log_beta)
            gap = log_beta - row_max  # beta exp(-row_max) = exp(gap); no exp of a positive gap
            if gap > zero:
                shrink = math.exp(-gap)
                norm = shrink / (row_sum * shrink + fopts[F_ONE])
            else:
                norm = fopts[F_ONE] / (row_sum + math.exp(gap))
    else:  # nothing kept: out = 0, lse = log(beta)
        row_lse = fopts[F_NEG_INF]
        if beta_h > zero:
            row_lse = math.log(beta_h)
        norm = zero
    lse[b, h, i] = row_lse
    for d in range(Dv):
        out[b, h, i, d] = acc[t * acc_stride + d] * norm


@cuda.jit(cache=True)
def _backward_dq_kernel(
    q, k, v, mask, kv_lengths, band, iopts, fopts, tau, bh_consts, bias, block_n, dout, out, lse, dq, delta, partials, dbias
):
    """One block per (batch * head, query tile), laid out as in `_forward_kernel`.

    Thread ``t`` owns query row ``i0 + t``. Recomputes ``p = exp(z - lse)``
    tile by tile and accumulates ``dq``. Also writes ``delta = dout . out``
    per row (read by the dk/dv and dbias kernels) and the block's partial
    sums for ``dtau``, ``dbeta``, ``dsigma`` (summed by one thread in row
    order, so the result does not depend on scheduling). When the bias is
    full (``iopts[I_DBIAS_FULL]``), ``dbias`` is ``(B, H, N, M)``: the block
    zeroes its rows, then each thread writes ``ds`` where its row keeps an
    entry (one writer per entry, no reduction); otherwise ``dbias`` is a dummy.
    """
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    M = k.shape[2]
    Dv = v.shape[3]
    block_m = cuda.blockDim.x
    t = cuda.threadIdx.x
    n_tiles = (N + block_m - 1) // block_m
    tile = cuda.blockIdx.x % n_tiles
    b = cuda.blockIdx.x // n_tiles // H
    h = cuda.blockIdx.x // n_tiles % H
    hk = h // (H // Hkv)
    i0 = tile * block_m
    i1 = min(i0 + block_m, N)
    i = i0 + t
    row = i < N

    q_stride = D + 1
    do_stride = Dv + 1
    smem = cuda.shared.array(0, dtype=q.dtype)
    q_tile = smem[: block_m * q_stride]
    do_tile = smem[block_m * q_stride : block_m * (q_stride + do_stride)]
    dq_base = block_m * (q_stride + do_stride)
    dq_acc = smem[dq_base : dq_base + block_m * q_stride]
    k_base = dq_base + block_m * q_stride
    k_tile = smem[k_base : k_base + block_n * D]
    v_tile = smem[k_base + block_n * D : k_base + block_n * (D + Dv)]
    sums = smem[k_base + block_n * (D + Dv) : k_base + block_n * (D + Dv) + P_COUNT * block_m]

    zero = fopts[F_ZERO]
    for idx in range(t, (i1 - i0) * D, block_m):
        q_tile[(idx // D) * q_stride + idx % D] = q[b, h, i0 + idx // D, idx % D]
    for idx in range(t, (i1 - i0) * Dv, block_m):
        do_tile[(idx // Dv) * do_stride + idx % Dv] = dout[b, h, i0 + idx // Dv, idx % Dv]
    for d in range(D):
        dq_acc[t * q_stride + d] = zero

    scale = fopts[F_SCALE]
    tau_h = tau[h]
    nvm = iopts[I_NVM] != 0
    has_gate = iopts[I_HAS_GATE] != 0
    causal = iopts[I_CAUSAL] != 0
    left = iopts[I_LEFT]
    right = iopts[I_RIGHT]
    has_mask = iopts[I_HAS_MASK] != 0
    kv_length = kv_lengths[b]
    shift = _shift(b, N, M, iopts, kv_lengths)
    threshold = fopts[F_THRESHOLD]
    sharpness = fopts[F_SHARPNESS]
    softcap = fopts[F_SOFTCAP]
    neg_inf = fopts[F_NEG_INF]
    has_bias = iopts[I_HAS_BIAS] != 0
    bias_row = b * iopts[I_BIAS_SB] + h * iopts[I_BIAS_SH] + i * iopts[I_BIAS_SI]
    bias_sj = iopts[I_BIAS_SJ]
    alibi_slope = zero
    if iopts[I_HAS_ALIBI] != 0:
        alibi_slope = bh_consts[b, h, C_ALIBI]
    g_norm = zero
    g_inv_sigma = zero
    u_scale = zero
    if has_gate:
        g_norm = bh_consts[b, h, C_NORM]
        u_scale = bh_consts[b, h, C_U_SCALE]
        g_inv_sigma = bh_consts[b, h, C_INV_SIGMA]
    row_delta = zero
    row_lse = zero
    if row:
        for d in range(Dv):
            row_delta += dout[b, h, i, d] * out[b, h, i, d]
        delta[b, h, i] = row_delta
        row_lse = lse[b, h, i]
    dbias_full = iopts[I_DBIAS_FULL] != 0
    if dbias_full:
        # the block owns rows [i0, i1) of dbias: zero them together (coalesced); the
        # syncthreads opening the tile loop orders this before the threads write ds
        for idx in range(t, (i1 - i0) * M, block_m):
            dbias[b, h, i0 + idx // M, idx % M] = zero
    # compensated sums: a float32 kernel's dtau and dsigma stay as accurate as a pairwise sum
    sum_dz_s = zero
    carry_dz_s = zero
    sum_dz_dlogg = zero
    carry_dz_dlogg = zero

    lo, hi = _key_range(i0, i1, b, h, N, M, iopts, kv_lengths, band)
    for j0 in range(lo, hi, block_n):
        jn = min(block_n, hi - j0)
        cuda.syncthreads()
        for idx in range(t, jn * D, block_m):
            k_tile[idx] = k[b, hk, j0 + idx // D, idx % D]
        for idx in range(t, jn * Dv, block_m):
            v_tile[idx] = v[b, hk, j0 + idx // Dv, idx % Dv]
        cuda.syncthreads()
        if not row:
            continue
        for jj in range(jn):
            j = j0 + jj
            if not _structural_keep(b, h, i, j, shift, kv_length, causal, left, right, has_mask, mask):
                continue
            bias_value = zero
            if has_bias:
                bias_value = bias[bias_row + j * bias_sj]
                if bias_value == neg_inf:  # removed, like a false mask entry
                    continue
            dot = zero
            for d in range(D):
                dot += q_tile[t * q_stride + d] * k_tile[jj * D + d]
            s, cap_slope = _score(dot, j - i - shift, scale, softcap, alibi_slope, bias_value, fopts)
            if nvm and s < zero:
                continue
            z = s / tau_h
            G = zero
            f = zero
            u = zero
            if has_gate:
                G, f, u = _gate(i, j, shift, u_scale, g_norm, threshold, sharpness, fopts)
                if not G > zero:
                    continue
                z += math.log(G)
            p = math.exp(z - row_lse)
            dp = zero
            for d in range(Dv):
                dp += do_tile[t * do_stride + d] * v_tile[jj * Dv + d]
            dz = p * (dp - row_delta)
            ds = dz / tau_h  # d loss / d s, the final score: dbias[b, h, i, j]
            if dbias_full:
                dbias[b, h, i, j] = ds
            ds_raw = ds * cap_slope
            for d in range(D):
                dq_acc[t * q_stride + d] += ds_raw * k_tile[jj * D + d]
            sum_dz_s, carry_dz_s = _compensated_add(sum_dz_s, carry_dz_s, dz * s)
            if has_gate:
                sigma_term = (u * u - fopts[F_ONE]) * g_inv_sigma  # x^2 / sigma^3 - 1 / sigma
                # d log G / dy = (1 - G^2) / G = 2 / sinh(2y) = 4 e / (1 - e^2), e = exp(-2y),
                # y = sharpness f > 0: no cancellation as G -> 1, no overflow as y grows
                y = sharpness * f
                e = math.exp(-(y + y))
                dlog_dy = ((e + e) + (e + e)) / -math.expm1(-((y + y) + (y + y)))
                dlogg = sharpness * dlog_dy * f * sigma_term
                sum_dz_dlogg, carry_dz_dlogg = _compensated_add(sum_dz_dlogg, carry_dz_dlogg, dz * dlogg)

    if row:
        for d in range(D):
            dq[b, h, i, d] = scale * dq_acc[t * q_stride + d]
    sums[P_DTAU * block_m + t] = sum_dz_s + carry_dz_s
    sums[P_DSIGMA * block_m + t] = sum_dz_dlogg + carry_dz_dlogg
    cuda.syncthreads()
    for c in range(t, P_COUNT, block_m):
        total = zero
        carry = zero
        for r in range(block_m):
            total, carry = _compensated_add(total, carry, sums[c * block_m + r])
        partials[b, h, tile, c] = total + carry


@cuda.jit(cache=True)
def _backward_dkdv_kernel(
    q, k, v, mask, kv_lengths, band, iopts, fopts, tau, bh_consts, bias, block_m, dout, lse, delta, dk, dv
):
    """One block per (batch * kv head, key tile), key tiles fastest; thread ``t`` owns key ``j0 + t``.

    Loops over the query heads of the group and the query tiles that can see
    the key tile, accumulating ``dk`` and ``dv`` in shared memory: each key is
    written by exactly one thread, so no atomics and a fixed summation order.
    """
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    M = k.shape[2]
    Dv = v.shape[3]
    group = H // Hkv
    block_n = cuda.blockDim.x
    t = cuda.threadIdx.x
    n_tiles = (M + block_n - 1) // block_n
    b = cuda.blockIdx.x // n_tiles // Hkv
    hk = cuda.blockIdx.x // n_tiles % Hkv
    j0 = cuda.blockIdx.x % n_tiles * block_n
    j1 = min(j0 + block_n, M)
    j = j0 + t
    col = j < M

    k_stride = D + 1
    v_stride = Dv + 1
    smem = cuda.shared.array(0, dtype=q.dtype)
    k_tile = smem[: block_n * k_stride]
    v_tile = smem[block_n * k_stride : block_n * (k_stride + v_stride)]
    dk_base = block_n * (k_stride + v_stride)
    dk_acc = smem[dk_base : dk_base + block_n * k_stride]
    dv_base = dk_base + block_n * k_stride
    dv_acc = smem[dv_base : dv_base + block_n * v_stride]
    q_base = dv_base + block_n * v_stride
    q_tile = smem[q_base : q_base + block_m * D]
    do_base = q_base + block_m * D
    do_tile = smem[do_base : do_base + block_m * Dv]
    lse_tile = smem[do_base + block_m * Dv : do_base + block_m * (Dv + 1)]
    delta_tile = smem[do_base + block_m * (Dv + 1) : do_base + block_m * (Dv + 2)]

    zero = fopts[F_ZERO]
    for idx in range(t, (j1 - j0) * D, block_n):
        k_tile[(idx // D) * k_stride + idx % D] = k[b, hk, j0 + idx // D, idx % D]
    for idx in range(t, (j1 - j0) * Dv, block_n):
        v_tile[(idx // Dv) * v_stride + idx % Dv] = v[b, hk, j0 + idx // Dv, idx % Dv]
    for d in range(D):
        dk_acc[t * k_stride + d] = zero
    for d in range(Dv):
        dv_acc[t * v_stride + d] = zero

    scale = fopts[F_SCALE]
    nvm = iopts[I_NVM] != 0
    has_gate = iopts[I_HAS_GATE] != 0
    causal = iopts[I_CAUSAL] != 0
    left = iopts[I_LEFT]
    right = iopts[I_RIGHT]
    has_mask = iopts[I_HAS_MASK] != 0
    kv_length = kv_lengths[b]
    shift = _shift(b, N, M, iopts, kv_lengths)
    threshold = fopts[F_THRESHOLD]
    sharpness = fopts[F_SHARPNESS]
    softcap = fopts[F_SOFTCAP]
    neg_inf = fopts[F_NEG_INF]
    has_bias = iopts[I_HAS_BIAS] != 0
    bias_si = iopts[I_BIAS_SI]
    bias_col = j * iopts[I_BIAS_SJ]
    has_alibi = iopts[I_HAS_ALIBI] != 0
    for h in range(hk * group, (hk + 1) * group):
        tau_h = tau[h]
        g_norm = zero
        u_scale = zero
        if has_gate:
            g_norm = bh_consts[b, h, C_NORM]
            u_scale = bh_consts[b, h, C_U_SCALE]
        alibi_slope = zero
        if has_alibi:
            alibi_slope = bh_consts[b, h, C_ALIBI]
        bias_bh = b * iopts[I_BIAS_SB] + h * iopts[I_BIAS_SH] + bias_col
        lo, hi = _query_range(j0, j1, b, h, N, M, iopts, kv_lengths, band)
        for i0 in range(lo, hi, block_m):
            im = min(block_m, hi - i0)
            cuda.syncthreads()
            for idx in range(t, im * D, block_n):
                q_tile[idx] = q[b, h, i0 + idx // D, idx % D]
            for idx in range(t, im * Dv, block_n):
                do_tile[idx] = dout[b, h, i0 + idx // Dv, idx % Dv]
            for idx in range(t, im, block_n):
                lse_tile[idx] = lse[b, h, i0 + idx]
                delta_tile[idx] = delta[b, h, i0 + idx]
            cuda.syncthreads()
            if not col:
                continue
            for ii in range(im):
                i = i0 + ii
                if not _structural_keep(b, h, i, j, shift, kv_length, causal, left, right, has_mask, mask):
                    continue
                bias_value = zero
                if has_bias:
                    bias_value = bias[bias_bh + i * bias_si]
                    if bias_value == neg_inf:
                        continue
                dot = zero
                for d in range(D):
                    dot += q_tile[ii * D + d] * k_tile[t * k_stride + d]
                s, cap_slope = _score(dot, j - i - shift, scale, softcap, alibi_slope, bias_value, fopts)
                if nvm and s < zero:
                    continue
                z = s / tau_h
                if has_gate:
                    G, f, u = _gate(i, j, shift, u_scale, g_norm, threshold, sharpness, fopts)
                    if not G > zero:
                        continue
                    z += math.log(G)
                p = math.exp(z - lse_tile[ii])
                dp = zero
                for d in range(Dv):
                    dp += do_tile[ii * Dv + d] * v_tile[t * v_stride + d]
                ds_raw = p * (dp - delta_tile[ii]) / tau_h * cap_slope
                for d in range(Dv):
                    dv_acc[t * v_stride + d] += p * do_tile[ii * Dv + d]
                for d in range(D):
                    dk_acc[t * k_stride + d] += ds_raw * q_tile[ii * D + d]

    if not col:
        return
    for d in range(D):
        dk[b, hk, j, d] = scale * dk_acc[t * k_stride + d]
    for d in range(Dv):
        dv[b, hk, j, d] = dv_acc[t * v_stride + d]


@cuda.jit(cache=True)
def _backward_dbias_kernel(q, k, v, mask, kv_lengths, iopts, fopts, tau, bh_consts, bias, dout, lse, delta, dbias):
    """``dbias`` of a broadcast bias: one block per entry of the bias's own compact shape.

    ``dbias`` is flat, laid out like ``bias`` (C order over the compact shape,
    whose dims are the full ones where the bias's stride is nonzero and 1
    where it is broadcast). The block's entry stands for the ``R`` entries
    ``(b, h, i, j)`` along the broadcast axes; thread ``t`` takes the ``r``-th
    of them for ``r = t, t + blockDim, ...``, recomputes ``ds`` (the score,
    ``p = exp(z - lse)`` and ``dP = dout . v``, with ``delta`` from the dq
    kernel) and sums it, compensated; thread 0 then adds the threads' sums in
    thread order. The work per entry is fixed, so the result does not depend
    on scheduling, and no ``(B, H, N, M)`` temporary exists.
    """
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    M = k.shape[2]
    Dv = v.shape[3]
    group = H // Hkv
    threads = cuda.blockDim.x
    t = cuda.threadIdx.x
    e = cuda.blockIdx.x

    sb = iopts[I_BIAS_SB]
    sh = iopts[I_BIAS_SH]
    si = iopts[I_BIAS_SI]
    sj = iopts[I_BIAS_SJ]
    # compact dims (1 where broadcast) and the spans of the broadcast axes
    cb_n = B if sb != 0 else 1
    ch_n = H if sh != 0 else 1
    ci_n = N if si != 0 else 1
    cj_n = M if sj != 0 else 1
    rb_n = B // cb_n
    rh_n = H // ch_n
    ri_n = N // ci_n
    rj_n = M // cj_n
    cj = e % cj_n
    ci = e // cj_n % ci_n
    ch = e // (cj_n * ci_n) % ch_n
    cb = e // (cj_n * ci_n * ch_n)
    bias_value = bias[cb * sb + ch * sh + ci * si + cj * sj]

    zero = fopts[F_ZERO]
    scale = fopts[F_SCALE]
    softcap = fopts[F_SOFTCAP]
    nvm = iopts[I_NVM] != 0
    has_gate = iopts[I_HAS_GATE] != 0
    has_alibi = iopts[I_HAS_ALIBI] != 0
    causal = iopts[I_CAUSAL] != 0
    left = iopts[I_LEFT]
    right = iopts[I_RIGHT]
    has_mask = iopts[I_HAS_MASK] != 0
    threshold = fopts[F_THRESHOLD]
    sharpness = fopts[F_SHARPNESS]
    total = zero
    carry = zero
    if bias_value != fopts[F_NEG_INF]:  # a -inf entry removes all it stands for: dbias 0
        for r in range(t, rb_n * rh_n * ri_n * rj_n, threads):
            b = cb + r // (rj_n * ri_n * rh_n)
            h = ch + r // (rj_n * ri_n) % rh_n
            i = ci + r // rj_n % ri_n
            j = cj + r % rj_n
            shift = _shift(b, N, M, iopts, kv_lengths)
            if not _structural_keep(b, h, i, j, shift, kv_lengths[b], causal, left, right, has_mask, mask):
                continue
            hk = h // group
            dot = zero
            for d in range(D):
                dot += q[b, h, i, d] * k[b, hk, j, d]
            alibi_slope = zero
            if has_alibi:
                alibi_slope = bh_consts[b, h, C_ALIBI]
            s, cap_slope = _score(dot, j - i - shift, scale, softcap, alibi_slope, bias_value, fopts)
            if nvm and s < zero:
                continue
            tau_h = tau[h]
            z = s / tau_h
            if has_gate:
                G, f, u = _gate(
                    i, j, shift, bh_consts[b, h, C_U_SCALE], bh_consts[b, h, C_NORM], threshold, sharpness, fopts,
                )
                if not G > zero:
                    continue
                z += math.log(G)
            p = math.exp(z - lse[b, h, i])
            dp = zero
            for d in range(Dv):
                dp += dout[b, h, i, d] * v[b, hk, j, d]
            ds = p * (dp - delta[b, h, i]) / tau_h
            total, carry = _compensated_add(total, carry, ds)

    sums = cuda.shared.array(0, dtype=q.dtype)
    sums[t] = total + carry
    cuda.syncthreads()
    if t == 0:
        total = zero
        carry = zero
        for r in range(threads):
            total, carry = _compensated_add(total, carry, sums[r])
        dbias[e] = total + carry


KERNELS = {
    "_forward_kernel": _forward_kernel,
    "_backward_dq_kernel": _backward_dq_kernel,
    "_backward_dkdv_kernel": _backward_dkdv_kernel,
    "_backward_dbias_kernel": _backward_dbias_kernel,
}
