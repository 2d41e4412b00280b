"""The prefill forward of a bfloat16 problem with both products on AMX tiles (`elastic_np.cpu._tiles.amx`).

The tasks, the key ranges and every step between the products are the
forward's (`elastic_np.cpu._prefill.forward`); the products are the tiles':

- ``S^T = K_j Q^T``: the key rows as they are stored (a tile loads 16 rows
  of 32 bfloat16 in place), the task's queries as pairs of consecutive
  entries (``q_pairs[d // 2, r]``, built once per task), unscaled: the
  product is multiplied by ``scale / tau_h`` after it (`scale_logits`), as
  under NVM, so that no rounding of ``q`` comes before it.
- ``O^T += V_j^T P``: the values transposed once per call (``vt[b, hk, d, j]``,
  `values_transposed`) and the probabilities as pairs of consecutive keys,
  each split into two bfloat16, ``p = hi + lo`` to ``2**-16`` of itself
  (`_pack_probabilities`), two products for ``P V``; the accumulator is
  ``acc_t[d, r]``, transposed.

Every product of the tiles is exact and every sum float32, as in the float32
kernels, in the tile unit's order: the bits are not the float32 kernels' (the
contract's accuracy rule holds them; ``config.AMX = False`` gives those). A task's last keys that do not fill the
32 a pair of tiles takes are copied into zeroed scratch first, so that no
tile reads past them. The unit reads a number below float32's smallest
normal as zero and writes one as zero (`elastic_np.cpu._tiles.amx`), so a problem
under NVM, whose ``s >= 0`` test would see a flushed ``-1e-40`` as ``+0``,
takes the float32 products (`takes`), and a head of tiny values is scaled
up for the tiles (`values_transposed`). A logit of ``+inf`` can only be an
unscaled ``q . k`` beyond float32's range: the call then returns the float32
products' result (`forward`).
"""

import math

import numpy as np
from numba import njit

from elastic_np._contract._ranges import key_range
from elastic_np._contract._validation import dtype_name
from elastic_np.cpu._prefill import forward as prefill
from elastic_np.cpu._prefill.plan import check_cache, check_paged_cache, kernel_options
from elastic_np.cpu._runtime import config
from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._runtime.threads import claim, query_tile, run_tasks, task_counter
from elastic_np.cpu._tiles import amx
from elastic_np.cpu._tiles.calls import exp_shift_sum
from elastic_np.cpu._tiles.exp import float_from_bits
from elastic_np.cpu._tiles.halves import bits, float32_bits
from elastic_np.cpu._tiles.logits import column_max, modify_tile, scale_logits, shape_logits
from elastic_np.cpu._tiles.online_softmax import finish_rows, rescale_rows
from elastic_np.cpu._tiles.operands import BNHD, head, head_rows, new, operand, shape
from elastic_np.cpu._tiles.pages import NO_PAGES, page_of, paged as paged_pages, pool_operand, used_pages
from elastic_np.cpu._tiles.simd import compile_for

#: Keys and queries a pair of tiles takes, and entries of a row a tile loads.
_PAIR = 2 * amx.ROWS
_CHUNK = amx.ROW_BYTES // 2


def takes(problem):
    """Whether the problem's forward runs on the tiles: bfloat16, no NVM, head dims whole chunks, a CPU that has them."""
    B, H, Hkv, N, M, D, Dv = problem.shape
    return (
        dtype_name(problem.dtype) == "bfloat16" and not problem.nvm and D % _CHUNK == 0 and Dv % _PAIR == 0
        and config.BLOCK_Q % _PAIR == 0 and config.BLOCK_K % _PAIR == 0 and config.AMX and amx.permitted()
    )


#: A head whose largest value is below this is scaled up by a power of two on the tiles (`values_transposed`).
_TINY_VALUES = 2.0 ** -60


def values_transposed(v, kv_lengths):
    """``(vt, unscale)``: ``vt[b * Hkv + hk, d, j]``, the bits of the values ``(B, Hkv, M, Dv)``, each head transposed.

    A row holds ``M`` rounded up to 64, plus 32, entries (zeros past ``M``):
    an odd number of cache lines, so that the 16 rows a tile loads fall in
    16 sets of the L1 cache (rows of 4,096 bytes would all fall in one).

    The unit writes a product ``p v`` below float32's smallest normal as
    zero: a head whose values (those of its first ``kv_lengths[b]`` keys)
    all lie below `_TINY_VALUES` is multiplied by the power of two that
    brings the largest to ``[1, 2)`` (exact: bfloat16 has float32's
    exponents), and ``unscale[b * Hkv + hk]`` is that power's inverse, for
    the sums. Elsewhere what is flushed is below ``2**-126`` of the head's
    largest value, a key, far under the rule's floor.
    """
    B, Hkv, M, Dv = v.shape
    vt = _zeroed(B, Hkv, Dv, M)
    heads = bits(v)
    # a block of keys at a time: NumPy transposed the whole of a (B, M, Hkv, Dv) array's view 10 times slower
    for j0 in range(0, M, _PAIR):
        vt[..., j0 : min(j0 + _PAIR, M)] = heads[:, :, j0 : j0 + _PAIR].transpose(0, 1, 3, 2)
    return _scaled(vt, kv_lengths, M)


def paged_values_transposed(pool, table, kv_lengths, M):
    """`values_transposed` of the values of a paged cache: entry ``b``'s first ``kv_lengths[b]`` keys of the
    ``(num_blocks, block_size, Hkv, Dv)`` ``pool``'s pages ``table[b]``, transposed from the pages a page at a
    time (zeros past them, never read); ``M``: the most keys an entry uses."""
    vt = _zeroed(table.shape[0], *pool.shape[2:], M)
    pages = bits(pool)
    for b, j0, page, n in used_pages(table, kv_lengths, pool.shape[1]):
        vt[b, :, :, j0 : j0 + n] = pages[page, :n].transpose(1, 2, 0)
    return _scaled(vt, kv_lengths, M)


def _zeroed(B, Hkv, Dv, M):
    """`values_transposed`'s zeros, ``(B, Hkv, Dv, row)``, bits."""
    return np.zeros((B, Hkv, Dv, -(-M // 64) * 64 + 32), dtype=np.uint16)


def _scaled(vt, kv_lengths, M):
    """``(vt, unscale)`` of `values_transposed`: the heads of tiny values scaled up in ``vt``, in place."""
    B, Hkv = vt.shape[:2]
    unscale = np.ones((B, Hkv), dtype=np.float32)
    largest = _largest(vt, kv_lengths)
    for b, hk in zip(*np.nonzero((largest > 0) & (largest < _TINY_VALUES))):
        shift = -int(np.floor(np.log2(largest[b, hk])))  # the largest times 2**shift lies in [1, 2)
        wide = (vt[b, hk, :, :M].astype(np.uint32) << np.uint32(16)).view(np.float32)
        with np.errstate(over="ignore"):  # past kv_lengths[b] anything may overflow: never read
            scaled = np.ldexp(wide, shift).view(np.uint32) >> np.uint32(16)  # exact: no low bits
        vt[b, hk, :, :M] = scaled.astype(np.uint16)
        unscale[b, hk] = np.ldexp(np.float32(1.0), -shift)
    return vt.reshape(B * Hkv, vt.shape[2], vt.shape[3]), unscale.reshape(B * Hkv)


def _largest(vt, kv_lengths):
    """The largest magnitude of each ``(b, hk)`` head's values, float32, over its first ``kv_lengths[b]`` keys
    (``vt[b, hk, d, j]``, bits).

    A bfloat16's bits without the sign order like its magnitude. Keys past
    a sequence's length may hold anything, so they are left out.
    """
    B, Hkv, Dv = vt.shape[:3]
    magnitude = np.zeros((B, Hkv), dtype=np.uint16)
    for b, hk in np.ndindex(B, Hkv):
        for d in range(0, Dv, 16):  # a slab of 16 rows at a time: no temporary the size of the values
            slab = vt[b, hk, d : d + 16, : kv_lengths[b]] & np.uint16(0x7FFF)
            magnitude[b, hk] = max(magnitude[b, hk], slab.max(initial=0))
    return (magnitude.astype(np.uint32) << np.uint32(16)).view(np.float32)


def forward(problem, paged=None, into=None):
    """`elastic_np.cpu._prefill.forward.forward` for a problem that `takes` says runs on the tiles: ``(out, lse)``.

    ``paged = (k_pages, v_pages, block_table)``: the keys are read from the
    pages in place, and the values transposed from them
    (`paged_values_transposed`); ``paged`` and ``into`` as
    `elastic_np.cpu._prefill.forward.forward` takes them.
    """
    compile_for(np.dtype(np.float32), (exp_shift_sum, modify_tile))
    B, H, Hkv, N, M, D, Dv = problem.shape
    q = operand(problem.q)
    if paged is None:
        check_cache(problem)
        k, pages = operand(problem.k), NO_PAGES
        vt, unscale = values_transposed(problem.v, problem.kv_lengths)
    else:
        check_paged_cache(paged, problem)
        k, pages = pool_operand(paged[0]), paged_pages(paged[2], paged[0].shape[1])
        vt, unscale = paged_values_transposed(paged[1], pages[0], problem.kv_lengths, M)
    out, out_operand = new((B, H, N, Dv), problem.dtype, q[1], storage=into if q[1] == BNHD else None)
    lse = np.empty((B, H, N), dtype=np.float32)
    opt = kernel_options(problem, with_sigma_grad=False, dtype=np.dtype(np.float32))
    overflow = np.zeros(1, dtype=np.bool_)
    run_tasks(_amx_kernel, q, k, pages, (vt, unscale), opt, config.BLOCK_Q, config.BLOCK_K,
              (out_operand, lse, overflow), tasks=task_counter(), work=B * H * N * M * (D + Dv) // 16)
    if overflow[0]:  # a product of the unscaled queries overflowed: the float32 products scale them first
        return prefill.forward(problem, paged=paged, into=into)
    return out, lse


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _amx_kernel(q, k, pages, values, opt, block_q, block_k, outs, tasks, part, parts):
    """The prefill forward kernel's tasks with the products on the tiles (the module's docstring).

    ``k`` a paged cache's pool where ``pages`` is not `NO_PAGES` (`elastic_np.cpu._tiles.pages`);
    ``values = (vt, unscale)`` (`values_transposed`); ``outs = (out, lse,
    overflow)``: ``overflow[0]`` is set when a logit came out ``+inf`` (a
    product of the unscaled queries beyond float32's range; the inputs are
    finite), and the caller then discards ``out`` and ``lse``.
    """
    vt, unscale = values
    out, lse, overflow = outs
    B, H, N, D = shape(q)
    Hkv, Dv = shape(k)[1], vt.shape[1]
    group = H // Hkv
    n_qt = (N + block_q - 1) // block_q
    q_pairs = np.zeros((D // 2, block_q), dtype=np.uint32)
    st = np.empty((block_k, block_q), dtype=np.float32)
    p_hi = np.empty((block_k // 2, block_q), dtype=np.uint32)
    p_lo = np.empty((block_k // 2, block_q), dtype=np.uint32)
    acc_t = np.empty((Dv, block_q), dtype=np.float32)
    acc = np.empty((block_q, Dv), dtype=np.float32)
    k_edge = np.zeros((_PAIR, D), dtype=np.uint16)
    v_edge = np.zeros((Dv, _PAIR), dtype=np.uint16)
    row_max = np.empty(block_q, dtype=np.float32)
    tile_max = np.empty(block_q, dtype=np.float32)
    shift_by = np.empty(block_q, dtype=np.float32)
    rescale_by = np.empty(block_q, dtype=np.float32)
    tile_sum = np.empty(block_q, dtype=np.float32)
    row_sum = np.empty(block_q)
    no_acc = np.empty((block_q, 0), dtype=np.float32)  # `rescale_rows` rescales acc_t's columns here instead
    no_cap_slope = np.empty((0, 0), dtype=np.float32)
    n_tasks = B * H * n_qt
    # the tiles' configuration, once a part: loaded again after the tiles are released, it slows
    # each product that follows
    amx.configure()
    for _ in range(n_tasks):
        task = claim(tasks)
        if task >= n_tasks:
            break
        b, h, hk, qt, i0, bq = query_tile(task, n_qt, H, group, block_q, N)
        bq_pad = -(-bq // _PAIR) * _PAIR

        _query_pairs(head_rows(q, b, h, i0, bq), q_pairs)
        acc_t[:] = 0.0
        row_max[:] = -np.inf
        row_sum[:] = 0.0
        v_t = vt[b * Hkv + hk]
        off_lo, off_hi = opt.band[b, h, 0], opt.band[b, h, 1]
        j_lo, j_hi = key_range(opt.diag_shift[b], i0, i0 + bq, off_lo, off_hi, opt.kv_lengths[b])
        for j0 in range(j_lo, j_hi, block_k):
            bk = min(block_k, j_hi - j0)
            tile = (b, h, i0, bq, j0)
            _key_products((k, pages, b, hk), j0, bk, q_pairs, bq_pad, st, k_edge)
            scale_logits(st, bk, bq, opt, h, tile_max[:0])
            kept, _ = shape_logits(st, bk, opt, tile, False, no_cap_slope, tile_max[:0], False, None)
            if not kept:
                continue
            for r in range(bq):
                tile_max[r] = -np.inf
            column_max(st, bk, bq, tile_max, False)
            for r in range(bq):
                if tile_max[r] == np.inf:
                    overflow[0] = True
            rescale_rows(tile_max, row_max, row_sum, shift_by, rescale_by, no_acc, bq)
            for d in range(Dv):
                acc_row = acc_t[d, :bq]
                for r in range(bq):
                    acc_row[r] *= rescale_by[r]
            for r in range(bq):
                tile_sum[r] = 0.0
            exp_shift_sum(st, bk, bq, shift_by, False, tile_sum)
            for r in range(bq):
                row_sum[r] += tile_sum[r]
            _pack_probabilities(st, bk, bq, p_hi, p_lo)
            _value_products(v_t, j0, bk, p_hi, p_lo, bq_pad, acc_t, v_edge)
        back = unscale[b * Hkv + hk]
        for r in range(bq):
            for d in range(Dv):
                acc[r, d] = acc_t[d, r] * back
        log_beta = math.log(opt.beta[h]) if opt.beta[h] > 0 else -np.inf
        finish_rows(acc, row_max, row_sum, log_beta, head_rows(out, b, h, i0, bq), lse[b, h, i0 : i0 + bq])
    amx.release()


@inner(fastmath=False)
def _query_pairs(q_tile, q_pairs):
    """``q_pairs[p, r]``: entries ``2 p`` (low half) and ``2 p + 1`` of query ``r`` of ``q_tile`` (`head_rows`), bits."""
    whole, col = q_tile
    for r in range(whole.shape[0]):
        row = whole[r, col : col + 2 * q_pairs.shape[0]]
        for p in range(q_pairs.shape[0]):
            q_pairs[p, r] = np.uint32(row[2 * p]) | (np.uint32(row[2 * p + 1]) << np.uint32(16))


@inner(fastmath=False)
def _key_products(keys, j0, bk, q_pairs, bq_pad, st, k_edge):
    """``st[c, r] = K[j0 + c] . Q[r]`` for ``c < bk`` rounded up to `_PAIR`, ``r < bq_pad``, on the tiles.

    ``keys = (k, pages, b, hk)``: the keys of ``(b, hk)`` of operand ``k``,
    bits (`_key_rows`). A tile's 16 rows are read in place where they lie in
    one page (or the cache is contiguous), else copied into ``k_edge``, as
    is a last block of fewer than `_PAIR` keys (zeros after them). The
    caller has configured the tiles (`amx.configure`).
    """
    D = 2 * q_pairs.shape[0]
    q_lead, s_lead = q_pairs.shape[1], st.shape[1]
    for c0 in range(0, bk, _PAIR):
        n = min(_PAIR, bk - c0)
        if n == _PAIR:
            rows_a, at_a, lead_a = _key_rows(keys, j0 + c0, k_edge, 0)
            rows_b, at_b, lead_b = _key_rows(keys, j0 + c0 + amx.ROWS, k_edge, amx.ROWS)
        else:
            for c in range(n):
                _copy_key(keys, j0 + c0 + c, k_edge[c])
            k_edge[n:] = 0
            rows_a, at_a, lead_a = k_edge, 0, D
            rows_b, at_b, lead_b = k_edge, amx.ROWS * D, D
        for r0 in range(0, bq_pad, _PAIR):
            amx.zero_block()
            for d0 in range(0, D, _CHUNK):
                amx.load(4, rows_a, at_a + d0, lead_a)
                amx.load(5, rows_b, at_b + d0, lead_b)
                amx.load(6, q_pairs, (d0 // 2) * q_lead + r0, q_lead)
                amx.load(7, q_pairs, (d0 // 2) * q_lead + r0 + amx.ROWS, q_lead)
                amx.dot_block()
            amx.store_block(st, c0 * s_lead + r0, s_lead)


@inner(fastmath=False)
def _key_rows(keys, j, k_edge, r0):
    """``(rows, at, lead)``: keys ``j .. j + 15`` of ``keys = (k, pages, b, hk)`` as a tile loads them, from
    ``rows.flat[at]`` on, ``lead`` entries apart: in place where they lie in one page (or the cache is
    contiguous), else copied into rows ``r0 .. r0 + 15`` of ``k_edge``."""
    k, pages, b, hk = keys
    if pages[1] == 0:
        rows, col = head(k, b, hk)
        return rows, j * rows.shape[1] + col, rows.shape[1]
    page, row, m = page_of(pages, b, j, amx.ROWS)
    if m == amx.ROWS:
        rows, col = head(k, page, hk)
        return rows, row * rows.shape[1] + col, rows.shape[1]
    for c in range(amx.ROWS):
        _copy_key(keys, j + c, k_edge[r0 + c])
    return k_edge, r0 * k_edge.shape[1], k_edge.shape[1]


@inner(fastmath=False)
def _copy_key(keys, j, into):
    """Key ``j`` of ``keys = (k, pages, b, hk)`` (`_key_rows`) into ``into``, bits."""
    k, pages, b, hk = keys
    at, row = b, j
    if pages[1] != 0:
        at, row, _ = page_of(pages, b, j, 1)
    rows, col = head(k, at, hk)
    for d in range(into.shape[0]):
        into[d] = rows[row, col + d]


@inner(fastmath=False)
def _pack_probabilities(st, bk, bq, p_hi, p_lo):
    """``p_hi[c // 2, r]``, ``p_lo[...]``: ``st[c, r] = hi + lo`` in bfloat16, keys ``c`` and ``c + 1`` a 32-bit lane.

    ``hi`` is ``st[c, r]`` cut to a bfloat16 (its high 16 bits), ``lo`` the
    rest (exact in float32) rounded to the nearest: ``|st - hi - lo| <=
    2**-16 st``. Keys from ``bk`` to the next multiple of `_PAIR` are zeros.
    """
    bk_pad = -(-bk // _PAIR) * _PAIR
    for c in range(0, bk_pad, 2):
        hi, lo = p_hi[c // 2, :bq], p_lo[c // 2, :bq]
        if c + 1 < bk:
            first, second = st[c, :bq], st[c + 1, :bq]
            for r in range(bq):
                h0, l0 = _split(first[r])
                h1, l1 = _split(second[r])
                hi[r] = h0 | (h1 << np.uint32(16))
                lo[r] = l0 | (l1 << np.uint32(16))
        elif c < bk:
            first = st[c, :bq]
            for r in range(bq):
                h0, l0 = _split(first[r])
                hi[r] = h0
                lo[r] = l0
        else:
            for r in range(bq):
                hi[r] = 0
                lo[r] = 0


@njit(inline="always", fastmath=False)
def _round_bits(x):
    """The bits of ``x`` (a float32, finite) rounded to the nearest even bfloat16, as a uint32 below 2**16."""
    u = np.uint32(float32_bits(x))
    return np.uint32((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(inline="always", fastmath=False)
def _split(x):
    """``(hi, lo)``: bfloat16 bits, ``hi`` the high half of ``x`` (a float32, finite), ``lo`` the rest rounded."""
    u = np.uint32(float32_bits(x))
    hi = np.uint32(u >> np.uint32(16))
    rest = x - float_from_bits(np.int32(u & np.uint32(0xFFFF0000)))
    return hi, _round_bits(rest)


@inner(fastmath=False)
def _value_products(v_t, j0, bk, p_hi, p_lo, bq_pad, acc_t, v_edge):
    """``acc_t[d, r] += sum_c V[j0 + c, d] P[r, c]`` on the tiles, ``P`` as `_pack_probabilities` split it.

    ``v_t[d, j] = V[j, d]``, bits; a last block of fewer than `_PAIR` keys
    is copied into ``v_edge`` (zeros after them) and read there. The caller
    has configured the tiles (`amx.configure`).
    """
    Dv, lead, p_lead, a_lead = v_t.shape[0], v_t.shape[1], p_hi.shape[1], acc_t.shape[1]
    last = bk - bk % _PAIR  # the first key of a block of fewer than _PAIR, if any
    if last < bk:
        for d in range(Dv):
            for c in range(_PAIR):
                v_edge[d, c] = v_t[d, j0 + last + c] if last + c < bk else np.uint16(0)
    for d0 in range(0, Dv, _PAIR):
        for r0 in range(0, bq_pad, _PAIR):
            first = d0 * a_lead + r0
            amx.load_block(acc_t, first, a_lead)
            for c0 in range(0, bk, _PAIR):
                values, at, stride = v_t, d0 * lead + j0 + c0, lead
                if c0 == last:
                    values, at, stride = v_edge, d0 * _PAIR, _PAIR
                amx.load(4, values, at, stride)
                amx.load(5, values, at + amx.ROWS * stride, stride)
                for p in (p_hi, p_lo):
                    amx.load(6, p, (c0 // 2) * p_lead + r0, p_lead)
                    amx.load(7, p, (c0 // 2) * p_lead + r0 + amx.ROWS, p_lead)
                    amx.dot_block()
            amx.store_block(acc_t, first, a_lead)
