"""The logits of a tile, as the contract forms them: ``Q K^T``, the score modifiers, NVM, the gate, the mask.

`logits_tile` is the one pipeline the forward and the backward share; the
rest are its steps (`_modify_tile`, `_softcap_tile`, `_remove_in_tile`,
`scale_logits`), the reads of the bias (`_add_transposed`,
`prefetch_bias`) and the tile maxima (`column_max`). The kernels reach the
modifier stage through `modify_tile`: a C entry point compiled on first use
(`calls.modify_tile`, `ensure_modifiers`), so a call without a soft-cap,
ALiBi or bias never compiles it, or the stage linked in where that private
path is off (`elastic_np.cpu._runtime.numba_private`).
"""

import collections

import numpy as np
from numba import carray

from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._runtime.numba_private import enabled, inner
from elastic_np.cpu._tiles import calls
from elastic_np.cpu._tiles.calls import matmul_nn, matmul_nn_max
from elastic_np.cpu._tiles.scalar import _removes_nothing, scalar_like
from elastic_np.cpu._tiles.tanh import sech2_any, tanh_any
from elastic_np.cpu._tiles.transpose import prefetch, transpose_add, transpose_width
from elastic_np.cpu._tiles.variant import changes_logits, mask_stage, score_stage


@inner(fastmath=FASTMATH)
def logits_tile(st, k_j, q_t, opt, tile, nvm, cap_slope, tile_max, nonneg, variant):
    """The logits of a tile: ``st[c, r]`` for key ``j0 + c`` and query ``i0 + r``.

    ``tile = (b, h, i0, bq, j0)``: batch entry, head, first query, queries,
    first key; its ``bk`` keys are ``k_j = (whole, col)``, the rows of
    ``whole`` from column ``col`` (`elastic_np.cpu._tiles.operands.head_rows`). The product ``K_j
    Q^T`` (``q_t`` the queries scaled by ``scale / tau_h``, transposed,
    ``(D, bq)`` or wider) gives ``s_raw / tau_h``; the
    score modifiers follow in the contract's order (see `_modify_tile`).
    Removed
    entries then become ``-inf``: outside the offset band, ``s < 0`` under
    NVM on the final ``s`` (when ``nvm``, which the forward leaves to its own
    first pass when it can), a closed gate, a false mask entry (a ``-inf``
    bias is ``-inf`` already); the others get ``log G`` added.

    ``cap_slope`` receives ``1 - tanh^2`` under a soft-cap when it has the
    tile's shape (the backward), not when it is empty.
    ``tile_max`` (length ``bq`` or more; empty when not wanted) is raised to
    the column maxima of the logits (of those ``>= 0`` with ``nonneg``) when
    they come with the product: whenever nothing is removed and no modifier
    is added after the product. Both are told by the arrays, not by flags:
    a literal flag would compile this function once per value.

    ``variant``: a user's functions (`elastic_np._variants.variant.KernelVariant`),
    or None: a separate argument, so that a new function recompiles only the
    functions that read it (`shape_logits`).

    Returns ``(kept, maxed)``: ``kept`` is False when the mask leaves
    nothing in the tile (so the caller may skip it); ``maxed`` is True when
    ``tile_max[:bq]`` holds the maxima.
    """
    b, h, i0, bq, j0 = tile
    k_rows, k_col = k_j
    bk, D = k_rows.shape[0], q_t.shape[0]
    # The product first, then the modifiers, in the contract's order: a
    # product accumulated onto a large stored ALiBi or bias term would round
    # every partial sum at the term's magnitude (float32 ALiBi with N > M:
    # ten times the naive error in ``out``).
    fuse_max = (
        tile_max.shape[0] > 0 and _removes_nothing(opt, tile, bk, nvm) and not (opt.has_alibi or opt.has_bias)
        and _maxima_scale(opt, h, st) and not changes_logits(variant)
    )
    if fuse_max:
        matmul_nn_max(k_rows, k_col, q_t, 0, st, bk, bq, D, tile_max, nonneg, False)
    else:
        matmul_nn(k_rows, k_col, q_t, 0, st, bk, bq, D, False)
    if opt.nvm:
        scale_logits(st, bk, bq, opt, h, tile_max[:bq] if fuse_max else tile_max[:0])
    return shape_logits(st, bk, opt, tile, nvm, cap_slope, tile_max, fuse_max, variant)


@inner(fastmath=FASTMATH)
def shape_logits(st, bk, opt, tile, nvm, cap_slope, tile_max, maxed, variant):
    """The steps of `logits_tile` after the product ``st[:bk, :bq]`` of ``s_raw / tau_h``: the modifiers, then the removals.

    ``maxed``: ``tile_max[:bq]`` holds the product's column maxima (which a
    soft-cap caps too). A user's ``score_mod`` follows the built-in modifiers
    and its ``mask_mod`` the removals (`elastic_np.cpu._tiles.variant`; a
    tile under either is never ``maxed``). Returns `logits_tile`'s ``(kept, maxed)``.
    """
    b, h, i0, bq, j0 = tile
    want_cap_slope = cap_slope.shape[0] > 0
    removes_nothing = _removes_nothing(opt, tile, bk, nvm)
    additive = opt.has_alibi or opt.has_bias
    flags = (
        (calls.WANT_CAP_SLOPE if want_cap_slope else 0) + (calls.HAS_SOFTCAP if opt.has_softcap else 0)
        + (calls.HAS_ALIBI if opt.has_alibi else 0) + (calls.HAS_BIAS if opt.has_bias else 0)
    )
    if opt.has_softcap or additive:
        # with maxed, the soft-cap alone: the maxima are capped too (`_cap_maxima`)
        modify_tile(st, cap_slope, tile_max, opt.bias, opt.bias_strides, opt.tau, opt.alibi, opt.diag_shift,
                    tile, bk, flags + (calls.CAPPED_MAX if maxed else 0), opt.softcap)
    score_stage(st, bk, bq, variant, tile, opt.tau[h])
    if removes_nothing and not changes_logits(variant):
        return True, maxed
    kept = True if removes_nothing else _remove_in_tile(st, bk, opt, tile, nvm)
    return mask_stage(st, bk, bq, variant, tile, kept), False


# What the modifier stage reads of the options (`calls.modify_tile` passes these alone).
Modifiers = collections.namedtuple(
    "Modifiers", "diag_shift tau softcap has_softcap has_alibi alibi has_bias bias bias_strides"
)


def _modify_entry(st, s0, s1, cs, c0, c1, tm, t0, bias, nb, bst, ns, tau, nt, alibi, a0, a1, ds, nd,
                  b, h, i0, bq, j0, bk, flags, softcap):
    """The body of the modifier stage's C entry point (`calls.modify_tile`'s arguments, flattened)."""
    opt = Modifiers(
        carray(ds, (nd,)), carray(tau, (nt,)), softcap, flags & calls.HAS_SOFTCAP != 0,
        flags & calls.HAS_ALIBI != 0, carray(alibi, (a0, a1)), flags & calls.HAS_BIAS != 0,
        carray(bias, (nb,)), carray(bst, (ns,)),
    )
    tile = carray(st, (s0, s1))
    _modify_tile(tile, opt, (b, h, i0, bq, j0), bk, carray(cs, (c0, c1)), flags & calls.WANT_CAP_SLOPE != 0)
    if flags & calls.CAPPED_MAX:
        _cap_maxima(carray(tm, (t0,)), bq, opt, h, tile)


def ensure_modifiers(dtype):
    """Compile (or load from the cache) the modifier stage for ``dtype``; point the kernels' calls at it.

    The kernel plan calls it for every problem with a soft-cap, ALiBi or a
    bias, before a kernel runs: a call without them never compiles it.
    Nothing to do when the path ``lazy_stages`` is off (`modify_tile` is linked in).
    """
    if enabled("lazy_stages"):
        calls.ensure_lazy("modify_tile", dtype, _modify_entry)


def _linked_modify_tile(st, cap_slope, tile_max, bias, bias_strides, tau, alibi, diag_shift, tile, bk, flags,
                        softcap):
    """`calls.modify_tile`'s stage called directly, its floats as doubles as through the entry point."""
    opt = Modifiers(
        diag_shift, tau, np.float64(softcap), flags & calls.HAS_SOFTCAP != 0, flags & calls.HAS_ALIBI != 0,
        alibi, flags & calls.HAS_BIAS != 0, bias, bias_strides,
    )
    _modify_tile(st, opt, tile, bk, cap_slope, flags & calls.WANT_CAP_SLOPE != 0)
    if flags & calls.CAPPED_MAX:
        _cap_maxima(tile_max, tile[3], opt, tile[1], st)


#: What the kernels call for the modifier stage: an entry point compiled on first use, or the stage linked in.
modify_tile = calls.modify_tile if enabled("lazy_stages") else inner(fastmath=False)(_linked_modify_tile)


@inner(fastmath=FASTMATH)
def _cap_maxima(tile_max, bq, opt, h, st):
    """The maxima of a tile soft-capped after them: tanh is odd and increasing, so they are the raw ones capped.

    The same expression as `_modify_tile`'s, and so are the entries ``>= 0``.
    """
    tau_over_cap, cap_over_tau = modifier_factors(opt.tau[h], opt.softcap, 0.0, st)[1:3]
    for r in range(bq):
        x = tile_max[r]
        if x > -np.inf:
            tile_max[r] = cap_over_tau * tanh_any(x * tau_over_cap)


@inner(fastmath=False)
def query_factor(opt, h):
    """What the queries of head ``h`` are multiplied by before ``Q K^T``: ``scale / tau_h``.

    Under NVM, 1: the product is scaled afterwards (`scale_logits`), so that
    a score ``q . k`` that is exactly 0 stays 0 and is kept (``s >= 0``);
    rounding ``q * scale / tau_h`` first could make it ``-eps``.
    """
    return 1.0 if opt.nvm else opt.scale / opt.tau[h]


@inner(fastmath=False)
def _maxima_scale(opt, h, like):
    """Whether the product's tile maxima scale to the logits' (`scale_logits`): no NVM, or a positive factor.

    NVM keeps ``s = scale q . k >= 0``: with ``scale < 0`` the entries
    whose product is ``<= 0``, with ``scale = 0`` every entry. The maxima of
    the products ``>= 0`` are those of the kept logits only when the factor
    is positive; otherwise the kernels take the maxima of the scaled logits.
    """
    return not opt.nvm or logits_factor(opt, h, like) > 0


@inner(fastmath=False)
def scale_logits(st, bk, bq, opt, h, tile_max):
    """``st[:bk, :bq] *= scale / tau_h`` and the ``tile_max`` given (when `query_factor` is 1).

    ``tile_max``: the maxima of the products ``>= 0``, taken with the
    product, given only when the factor is positive (`_maxima_scale`),
    which keeps every sign, and the maxima (rounding is monotone). A
    negative product may scale to ``-0``, which NVM keeps (``s >= 0``): a
    column without a product ``>= 0`` gets the maximum 0, which every kept
    logit reaches (they are ``>= 0``), not ``-inf``.
    """
    factor = logits_factor(opt, h, st)
    for c in range(bk):
        scale_row(st[c, :bq], factor)
    scale_row(tile_max, factor)
    for r in range(tile_max.shape[0]):
        tile_max[r] = max(tile_max[r], 0.0)


@inner(fastmath=False)
def logits_factor(opt, h, like):
    """``scale / tau_h`` in the dtype of ``like``: what `scale_row` multiplies NVM's unscaled products by."""
    return scalar_like(opt.scale / opt.tau[h], like)


@inner(fastmath=False)
def scale_row(z, factor):
    """``z *= factor``, without fast-math: the same bits wherever inlined."""
    for c in range(z.shape[0]):
        z[c] *= factor


#: Keys per block when a tile adds a bias laid out along the keys.
_BIAS_KEYS = 32


@inner(fastmath=False)
def prefetch_bias(opt, b, h, i0, bq, j0, bk):
    """Prefetch the bias of the tile ``[i0, i0 + bq) x [j0, j0 + bk)``, one line at a time.

    A bias laid out along the keys is read by a tile as ``bq`` short runs,
    a whole row of the caller's array apart (a bias laid out along the
    queries as ``bk`` runs): too many streams for the hardware prefetcher.
    The backward calls it for its next query tile while it computes the
    current one; the forward does not (it gains nothing from it).
    """
    N, M = opt.n_queries, opt.n_keys
    s_i, s_j = opt.bias_strides[2], opt.bias_strides[3]
    if not opt.has_bias or min(s_i, s_j) != 1 or max(s_i, s_j) <= 1:
        return
    if s_j == 1:  # a run of keys per query
        first, length, lo, hi, apart = j0, min(bk, M - j0), max(i0, 0), min(i0 + bq, N), s_i
    else:  # a run of queries per key
        first, length, lo, hi, apart = i0, min(bq, N - i0), max(j0, 0), min(j0 + bk, M), s_j
    step = max(64 // opt.bias.itemsize, 1)  # elements per cache line
    start = b * opt.bias_strides[0] + h * opt.bias_strides[1] + first
    for x in range(lo, hi):
        at = start + x * apart
        for c in range(0, length, step):
            prefetch(opt.bias, at + c)


@inner(fastmath=FASTMATH)
def _modify_tile(st, opt, tile, bk, cap_slope, want_cap_slope):
    """The score modifiers on a whole tile ``st[:bk, :bq]`` of ``s_raw / tau_h`` (``tile`` as in `logits_tile`).

    ``s = softcap tanh(s_raw / softcap)``, then ``- alibi |off|``, then
    ``+ bias``, each divided by ``tau_h`` like the score and added by
    `plus_scaled` (the decode kernel's logits are the same bits); entries the caller
    removes afterwards are computed too (every tile entry is finite here, so
    that nothing is lost and the loops run from 0 and vectorise). With
    ``want_cap_slope`` (and a soft-cap), ``cap_slope[c, r]`` receives ``ds / ds_raw =
    1 - tanh^2``.
    """
    b, h, i0, bq, j0 = tile
    diag_shift = opt.diag_shift[b]
    # in the tile's dtype, so that float32 tiles stay float32
    inv_tau_t, tau_over_cap, cap_over_tau, minus_alibi_over_tau = modifier_factors(
        opt.tau[h], opt.softcap, opt.alibi[b, h] if opt.has_alibi else 0.0, st)
    b_b, b_h, b_i, b_j = opt.bias_strides[0], opt.bias_strides[1], opt.bias_strides[2], opt.bias_strides[3]
    # A bias contiguous (or constant) along the queries is added row by row
    # of the tile; a bias contiguous along the keys
    # (the usual C order) in blocks of keys after the other passes: for each
    # query, one short contiguous run of the caller's row; other layouts
    # entry by entry.
    by_rows = opt.has_bias and b_i <= 1
    if opt.has_softcap:
        _softcap_tile(st, bk, bq, tau_over_cap, cap_over_tau, cap_slope, want_cap_slope)
    # Rows are slices of length bq (loops over range(bq) on whole rows do not
    # run vectorised), offsets int32 (int64 to float has no AVX2 instruction).
    for c in range(bk if opt.has_alibi or by_rows else 0):
        row = st[c, :bq]
        if opt.has_alibi:
            base = j0 + c - i0 - diag_shift  # off of (j0 + c, i0 + r) is base - r
            for r in range(row.shape[0]):
                row[r] = plus_scaled(row[r], scalar_like(abs(np.int32(base - r)), st), minus_alibi_over_tau)
        if by_rows:
            start = b * b_b + h * b_h + (j0 + c) * b_j + i0 * b_i
            if b_i == 0:
                term = opt.bias[start]
                for r in range(row.shape[0]):
                    row[r] = plus_scaled(row[r], term, inv_tau_t)
            else:
                terms = opt.bias[start : start + bq]
                for r in range(row.shape[0]):
                    row[r] = plus_scaled(row[r], terms[r], inv_tau_t)
    if opt.has_bias and not by_rows:
        # st[c, r] += bias[i0 + r, j0 + c]: the bias is laid out query-major
        start0 = b * b_b + h * b_h + i0 * b_i + j0 * b_j
        if b_j == 1:
            _add_transposed(st, bk, bq, opt.bias, start0, b_i, inv_tau_t)
        else:
            # any other layout element by element, _BIAS_KEYS keys at a time
            for cb in range(0, bk, _BIAS_KEYS):
                nc = min(_BIAS_KEYS, bk - cb)
                for r in range(bq):
                    at = start0 + r * b_i + cb * b_j
                    for c in range(nc):
                        st[cb + c, r] = plus_scaled(st[cb + c, r], opt.bias[at + c * b_j], inv_tau_t)


@inner(fastmath=False)
def modifier_factors(tau_h, softcap, slope, like):
    """``(1 / tau_h, tau_h / softcap, softcap / tau_h, -slope / tau_h)``, the modifiers' factors, in ``like``'s dtype.

    Formed in float64 as ``softcap (1 / tau_h)`` and ``-slope (1 / tau_h)``,
    without fast-math: under ``arcp`` a caller may turn ``x (1 / y)`` into
    ``x / y`` (or the converse) as its context suits it, and the decode
    kernel's float64 soft-capped logits would be a rounding from the tiles'.
    """
    inv_tau = 1.0 / tau_h
    return (scalar_like(inv_tau, like), scalar_like(tau_h / softcap, like), scalar_like(softcap * inv_tau, like),
            scalar_like(-slope * inv_tau, like))


@inner(fastmath=False)
def plus_scaled(x, term, factor):
    """``x + term * factor``, the product rounded before the sum: never a fused multiply-add.

    How every kernel adds a score modifier's term (ALiBi's, the bias's,
    divided by ``tau_h``) to a logit: the prefill tiles (`_modify_tile`,
    whose SIMD blocks, `_add_transposed`, round the same way) and the decode
    kernel (`elastic_np.cpu._decode.decode._score_rows`). Without fast-math, so
    that no caller contracts it: a fused multiply-add in one kernel and not
    in another put the forward's logit and the backward's one rounding apart.
    """
    return x + term * factor


@inner(fastmath=FASTMATH)
def column_max(st, bk, bq, col_max, nonneg):
    """``col_max[r] = st[c, r]`` wherever that is greater (and ``>= 0`` with ``nonneg``), ``c`` in order.

    Four rows per load and store of ``col_max``: the same comparisons in the
    same order, a quarter of the loads and stores.
    """
    m = col_max[:bq]
    bk4 = bk - bk % 4
    for c in range(0, bk4, 4):
        r0, r1, r2, r3 = st[c, :bq], st[c + 1, :bq], st[c + 2, :bq], st[c + 3, :bq]
        if nonneg:
            for r in range(m.shape[0]):
                x = m[r]
                x = r0[r] if (r0[r] > x and r0[r] >= 0) else x
                x = r1[r] if (r1[r] > x and r1[r] >= 0) else x
                x = r2[r] if (r2[r] > x and r2[r] >= 0) else x
                x = r3[r] if (r3[r] > x and r3[r] >= 0) else x
                m[r] = x
        else:
            for r in range(m.shape[0]):
                x = m[r]
                x = r0[r] if r0[r] > x else x
                x = r1[r] if r1[r] > x else x
                x = r2[r] if r2[r] > x else x
                x = r3[r] if r3[r] > x else x
                m[r] = x
    for c in range(bk4, bk):
        row = st[c, :bq]
        for r in range(m.shape[0]):
            x = row[r]
            m[r] = x if (x > m[r] and (x >= 0 or not nonneg)) else m[r]


@inner(fastmath=FASTMATH)
def _softcap_tile(st, bk, bq, tau_over_cap, cap_over_tau, cap_slope, want_cap_slope):
    """``st[c, r] = cap_over_tau tanh(st[c, r] tau_over_cap)`` on ``st[:bk, :bq]``.

    With ``want_cap_slope``, ``cap_slope[c, r] = 1 - tanh^2`` too, by `sech2_any`
    (``1 - t * t`` cancels once the cap saturates). Rows go four at a
    time: four independent chains of the tangent's arithmetic in flight hide
    its latency; the rows are taken as slices of length ``bq``, without
    which LLVM's vectorised loop is not the one that runs.
    """
    bk4 = bk - bk % 4
    for c in range(0, bk4, 4):
        r0, r1, r2, r3 = st[c, :bq], st[c + 1, :bq], st[c + 2, :bq], st[c + 3, :bq]
        if want_cap_slope:
            s0, s1 = cap_slope[c, :bq], cap_slope[c + 1, :bq]
            s2, s3 = cap_slope[c + 2, :bq], cap_slope[c + 3, :bq]
            for r in range(r0.shape[0]):
                x0 = r0[r] * tau_over_cap
                x1 = r1[r] * tau_over_cap
                x2 = r2[r] * tau_over_cap
                x3 = r3[r] * tau_over_cap
                r0[r] = cap_over_tau * tanh_any(x0)
                r1[r] = cap_over_tau * tanh_any(x1)
                r2[r] = cap_over_tau * tanh_any(x2)
                r3[r] = cap_over_tau * tanh_any(x3)
                s0[r] = sech2_any(x0)
                s1[r] = sech2_any(x1)
                s2[r] = sech2_any(x2)
                s3[r] = sech2_any(x3)
        else:
            for r in range(r0.shape[0]):
                t0 = tanh_any(r0[r] * tau_over_cap)
                t1 = tanh_any(r1[r] * tau_over_cap)
                t2 = tanh_any(r2[r] * tau_over_cap)
                t3 = tanh_any(r3[r] * tau_over_cap)
                r0[r] = cap_over_tau * t0
                r1[r] = cap_over_tau * t1
                r2[r] = cap_over_tau * t2
                r3[r] = cap_over_tau * t3
    for c in range(bk4, bk):
        row = st[c]
        for r in range(bq):
            x = row[r] * tau_over_cap
            row[r] = cap_over_tau * tanh_any(x)
            if want_cap_slope:
                cap_slope[c, r] = sech2_any(x)


@inner(fastmath=False)
def _add_transposed(tile, bk, bq, src, start, stride, scale):
    """``tile[c, r] += scale * src[start + r * stride + c]`` for ``c < bk``, ``r < bq``, as `plus_scaled` adds.

    The inverse direction of
    `elastic_np.cpu._prefill.dbias._store_transposed`: square blocks of ``W`` go
    through SIMD registers (`transpose_add`), the edges
    element by element. Without fast-math: Numba sets a function's flags on
    every instruction of its code, `transpose_add`'s too, and with
    ``contract`` the blocks' products and sums would become fused multiply-adds.
    """
    width = transpose_width(tile)
    bk_w = bk - bk % width
    bq_w = bq - bq % width
    # W runs of src at a time, each read along: W streams the hardware
    # prefetcher follows (the blocks down the runs first would be bq streams)
    for rb in range(0, bq_w, width):
        for cb in range(0, bk_w, width):
            transpose_add(tile, src, start + rb * stride + cb, stride, cb, rb, scale)
    for c in range(bk):
        row = tile[c]
        for r in range(0 if c >= bk_w else bq_w, bq):
            row[r] = plus_scaled(row[r], src[start + r * stride + c], scale)


@inner(fastmath=FASTMATH)
def _remove_in_tile(st, bk, opt, tile, nvm):
    """The offset band, NVM, gate and mask on the tile's ``bk`` key rows of ``st`` (`logits_tile`'s ``tile``); True if an entry is kept.

    One call for the whole tile: the options are many arguments to pass.
    """
    b, h, i0, bq, j0 = tile
    diag_shift = opt.diag_shift[b]
    off_lo, off_hi = opt.band[b, h, 0], opt.band[b, h, 1]
    neg_inf = -np.inf
    any_kept = False
    for c in range(bk):
        j = j0 + c
        row = st[c]
        # off = j - (i0 + r) - diag_shift in [off_lo, off_hi]
        r_lo = min(max(j - diag_shift - off_hi - i0, 0), bq)
        r_hi = max(min(j - diag_shift - off_lo - i0 + 1, bq), r_lo)
        for r in range(r_lo):
            row[r] = neg_inf
        for r in range(r_hi, bq):
            row[r] = neg_inf
        if nvm:
            for r in range(r_lo, r_hi):
                x = row[r]
                row[r] = x if x >= 0 else neg_inf
        if opt.has_gate:
            base = j - diag_shift - i0 + opt.n_keys - 1  # table index of (j, i0 + r) is base - r
            for r in range(r_lo, r_hi):
                row[r] += opt.log_gate[b, h, base - r]
        if opt.has_mask:
            s_b, s_h, s_i, s_j = opt.mask_strides[0], opt.mask_strides[1], opt.mask_strides[2], opt.mask_strides[3]
            start = b * s_b + h * s_h + j * s_j + i0 * s_i
            for r in range(r_lo, r_hi):
                if not opt.mask[start + r * s_i]:
                    row[r] = neg_inf
            if not any_kept:
                for r in range(r_lo, r_hi):
                    if row[r] > neg_inf:
                        any_kept = True
                        break
        else:
            any_kept = any_kept or r_hi > r_lo
    return any_kept
