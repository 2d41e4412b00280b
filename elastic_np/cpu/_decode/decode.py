"""The decode kernels and the merge of their key splits: a few new queries against a long key/value cache.

Decoding attends ``N <= DECODE_MAX_QUERIES`` queries per sequence to ``M``
cached keys; its cost is reading ``K`` and ``V`` once, so the kernel is laid
out for memory, not for the products of `elastic_np.cpu`'s prefill tiles:

- a task is one (batch, kv head, key split): the ``group * N`` query rows of
  the kv head's query heads are stacked (row ``r = g * N + i`` is query ``i``
  of head ``hk * group + g``), so each key and value row is read once for
  all of them;
- with fewer than `DECODE_KEY_MAJOR_QUERIES` queries (`_decode_kernel`),
  score tiles are query-major, ``st[r, c]`` for key ``j0 + c``: the scores'
  pipeline, the exponential, the row maxima and sums run along the keys.
  ``Q K^T`` and ``P V`` are the products of
  `elastic_np.cpu._decode.products`, which read the keys and values where
  they lie, in their own dtype (a bfloat16 or float16 cache is widened in
  registers, never converted or copied), transpose blocks of keys in
  registers, and hint the rows some keys on into the cache as they go: the
  cache is read once, from memory, while the products compute. A NaN or inf
  key makes the tile's products so, a value the split's sums: both are
  found there (`_score_rows`, `elastic_np.cpu._decode.merge.store_split`);
- with `DECODE_KEY_MAJOR_QUERIES` or more (`_decode_heads_kernel`), each
  head of the group is a prefill tile of its ``N`` queries, key-major
  (``st[c, i]``), through the prefill's own steps, one head after the other
  while the key tile is in cache: the per-query work runs along the SIMD
  lanes, and no key tile is transposed. Each key tile is first read in
  memory order (`_tiles`), which also finds a NaN or inf key or value and
  converts a half tile to float32 (`elastic_np.cpu._tiles.halves`);
- in a ``(B, N, H, D)`` cache, or a paged one (`forward`'s ``paged``: pages
  ``(num_blocks, block_size, Hkv, D)`` and a block table), a key's rows for
  all kv heads are adjacent and one head's rows ``Hkv * D`` entries apart:
  there, when every head keeps the same keys, a task of `_decode_kernel`
  takes every kv head of its key split and reads a tile's runs (the tile,
  or its parts in each page) head after head, or, where pages are shorter
  than a tile, page after page, every head's rows of a page in turn
  (`_tile_of_heads`, `elastic_np.cpu._decode.plan.tile_reads`). Each head's products, and so its bits,
  are those of a task of its own;
- a quantized cache (int8, float8) is read in place by the stacked-rows
  kernel, its bytes widened in registers by the same products; the scales
  are folded in (`elastic_np.cpu._tiles.cache_scales.cache_scales`): ``k_scale``
  into the scaled queries, ``v_scale`` into each split's sums; per-token
  and per-group scales as `_tile_of_heads` reads the rows;
- split-KV: when (batch x kv head) pairs are fewer than `DECODE_MIN_TASKS`,
  the keys each pair may keep are cut into ``n_split`` ranges, one task
  each, whose partial ``(max, sum, unnormalised out)`` are merged in split
  order (`elastic_np.cpu._decode.merge`; an entry of one split is
  finished by its task). ``n_split`` depends on the shape only, so the
  result has the same bits for every thread count. A batch entry may have
  a count of its own (`forward`'s ``entry_splits``): the tasks of every
  entry then run together, each entry with the splits, and so the bits, of
  a call of its own.

The logits are those of the prefill tiles, rounding included (the queries
scaled by ``scale / tau_h``, the score modifiers divided by ``tau_h``): the
backward, which recomputes them with the prefill tiles, then sees the
``lse`` it would have computed itself.
"""

import numpy as np
from numba import njit

from elastic_np._contract._ranges import key_range
from elastic_np.cpu._decode.merge import _merge_kernel, one_split, task_result
from elastic_np.cpu._decode.plan import schedule
from elastic_np.cpu._decode.products import key_scores, query_width, value_products
from elastic_np.cpu._decode.tiles import (
    _NO_TABLE, _all_read, _check_unread_cache, _paged_rows, _run, _tiles, _visit, fine_key_rows, fine_value_rows, key_groups,
    token_scaled_keys, token_scaled_values, value_groups,
)
from elastic_np.cpu._runtime import config
from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._runtime.numba_private import direct_call, inner
from elastic_np.cpu._runtime.threads import claim, run_tasks, task_counter
from elastic_np.cpu._tiles.cache_scales import cache_scales, fine_operands
from elastic_np.cpu._tiles.calls import exp_inplace, exp_shift_sum, matmul_nn, matmul_nn_max, matmul_tn
from elastic_np.cpu._tiles.halves import checked, widen
from elastic_np.cpu._tiles.logits import (
    logits_factor, logits_tile, modifier_factors, modify_tile, plus_scaled, query_factor, scale_row,
)
from elastic_np.cpu._tiles.online_softmax import load_queries, online_update, query_major_update
from elastic_np.cpu._tiles.operands import head, head_rows, new, operand, shape
from elastic_np.cpu._tiles.pages import paged as paged_pages, pool_operand
from elastic_np.cpu._tiles.scalar import scalar_like
from elastic_np.cpu._tiles.simd import compile_for
from elastic_np.cpu._tiles.tanh import tanh_any

#: ``pages`` of a contiguous cache, by a launch's ``kind = (key_major, together)``: the key-major kernel always takes
#: a table, empty (page size 0), so that a contiguous and a paged cache share its one specialisation; the
#: stacked-rows kernel takes one where a task takes every kv head, else None (given the empty table too, its
#: contiguous calls ran slower: docs/architecture.rst, "One specialisation where two did the same work").
CONTIGUOUS_PAGES = {(key_major, together): (_NO_TABLE, 0, together) if key_major or together else None
                    for key_major in (False, True) for together in (False, True)}

#: The typed tile functions each kernel calls (see `elastic_np.cpu._tiles.simd.compile_for`).
_ROWS_TILES = (exp_inplace,)
_HEADS_TILES = (matmul_nn, matmul_nn_max, matmul_tn, exp_shift_sum, modify_tile)


def forward(problem, paged=None, entry_splits=None, scale_pages=None):
    """Attention forward through the decode kernel: ``(out, lse)`` in the input dtype, ``out`` in ``q``'s layout.

    ``paged = (k_pages, v_pages, block_table)``: the keys and values from a
    paged cache, read in place, ``problem.k`` and ``problem.v`` giving only
    their shapes. Pages are ``(num_blocks, block_size, Hkv, D)`` (``Dv`` for
    ``v``); key ``j`` of batch entry ``b`` is row ``j % block_size`` of
    page ``block_table[b, j // block_size]``. The caller has checked the
    table against ``problem.kv_lengths`` (`elastic_np._api.varlen`).
    ``entry_splits``: int ``(B,)``, the key splits of each batch entry (at
    least 1; default `splits` of the whole shape for all): those of
    ``plan.splits(1, Hkv, kv_lengths[b])`` give entry ``b`` the bits of a call
    of its own on its first ``kv_lengths[b]`` keys, its queries aligned to
    their end. ``scale_pages``: a paged quantized cache's per-token or
    per-group scales, ``(num_blocks, block_size, Hkv, D // G)`` for ``k`` and
    for ``v`` (``problem``'s stand in for them); a contiguous cache's are
    ``problem``'s own.
    """
    q = operand(problem.q)
    if paged is None:
        k, v = operand(problem.k), operand(problem.v)
        cache = (problem.k, problem.v)
        plan = schedule(problem, k[1], None, entry_splits)
        pages = CONTIGUOUS_PAGES[plan.key_major, plan.together]
    else:
        k, v = pool_operand(paged[0]), pool_operand(paged[1])
        table, block_size = paged_pages(paged[2], paged[0].shape[1])
        cache = [_paged_rows(a, paged[2]) for a in paged[:2]] if problem.kv_unchecked else None
        plan = schedule(problem, k[1], block_size, entry_splits)
        pages = (table, block_size, plan.together)
    return _launcher(problem, plan)(q, k, v, pages, cache, fine_operands(problem, scale_pages))


def _launcher(problem, plan, direct=False, like=None):
    """``launch(q, k, v, pages, cache, fine=None, q_values=None) -> (out, lse)``: `forward`'s kernels on the operands
    ``q``, ``k``, ``v`` with `schedule`'s ``plan`` and ``pages`` (`forward`'s: the table, the page size and
    whether a task takes every kv head, or for a contiguous cache `CONTIGUOUS_PAGES` ``[launch.kind]``),
    ``cache`` the keys and values `_check_unread_cache` reads where the kernel did not (where
    ``problem.kv_unchecked``), ``fine`` a quantized cache's scales' operands (`fine_operands`; None for a float cache);
    ``q_values``: ``q``'s storage, for the stacked-rows kernel of a caller that left ``q``'s check to it
    (`_check_unread_cache`).

    ``direct``: a launcher run again and again calls the kernels through their entry points from its
    second run on (`direct_call`). ``like``: the launcher of a problem that differs in its number of keys
    alone (so its arguments have the same types), whose entry points and count of runs this one shares:
    a growing cache, whose every step is a new launcher run once, finds them from the family's second run.
    """
    B, H, Hkv, N, M, D, Dv = problem.shape
    dtype, out_dtype = problem.compute_dtype, problem.dtype
    compile_for(dtype, _HEADS_TILES if plan.key_major else _ROWS_TILES)
    kernel = _decode_heads_kernel if plan.key_major else _decode_kernel
    rows = (H // Hkv) * N
    merged = plan.most > 1  # else every task finishes its rows: no partials, no merge
    stored = plan.most if merged else 0
    sums, accs, reads, splits = (B, Hkv, stored, rows), (B, Hkv, stored, rows, Dv), (B, Hkv, 2), (B, Hkv, plan.most)
    out_shape, lse_shape = (B, H, N, Dv), (B, H, N)
    no_parts = None if merged else (np.empty(sums), np.empty(sums), np.empty(accs, dtype=dtype))  # never written
    opt, split_start, tiles, work, beta = plan.opt, plan.split_start, plan.tiles, plan.work, plan.opt.beta
    scales = () if plan.key_major else (cache_scales(problem),)  # the stacked-rows kernel's (Hkv, 2) scales
    unchecked, lengths = problem.kv_unchecked, problem.kv_lengths
    # the dispatchers (the kernel's, the merge's, `_all_read`), then, from a launch's second run, their entry points
    # (`direct_call`: a launch that runs once, a plan's first, skips the fingerprint of its arguments)
    calls, runs, kind = [kernel, _merge_kernel, _all_read], [0, False], (plan.key_major, plan.together)
    if like is not None and like.kind == kind:  # the like launcher's lists alone, which hold no launcher:
        calls, runs = like.calls, like.runs  # a growing cache's plans make no chain

    def launch(q, k, v, pages, cache, fine=None, q_values=None):
        parts = (np.empty(sums), np.empty(sums), np.empty(accs, dtype=dtype)) if merged else no_parts
        read, suspect, tasks = np.zeros(reads, dtype=np.int64), np.zeros(splits, dtype=np.bool_), task_counter()
        out, out_operand = new(out_shape, out_dtype, q[1])
        lse = np.empty(lse_shape, dtype=dtype)
        args = (q, k, v, pages, opt, *((*scales, fine) if scales else ()), split_start, tiles,
                (*parts, read, suspect, out_operand, lse), tasks)
        if work < config.SERIAL_WORK:  # `run_tasks`' own test, without its call
            calls[0](*args, 0, 1)
        else:
            run_tasks(calls[0], *args[:-1], tasks=tasks, work=work)
        if (unchecked or q_values is not None) and not calls[2](read, lengths, suspect):
            _check_unread_cache(cache if unchecked else None, lengths, read, suspect, q_values)
        merge_args = (*parts, split_start, beta, N, out_operand, lse, 0, 1)
        if merged or runs[0] == 0:  # small; unmerged, it does nothing, and its first call compiles it with the kernel
            calls[1](*merge_args)
        if direct and (runs[0] < 2 or merged and not runs[1]):
            _go_direct(calls, runs, kernel, (*args, 0, 1), merge_args if merged else None, (read, lengths, suspect))
        return out, lse

    launch.calls, launch.runs, launch.kind = calls, runs, kind
    return launch


def _go_direct(calls, runs, kernel, kernel_args, merge_args, read_args):
    """A launch family's ``calls`` through their entry points (`direct_call`) from its second run on: the decode
    kernel's and `_all_read`'s, and the merge's from its first run that merges (``merge_args`` not None). ``runs =
    [runs, whether the merge's entry point was looked up]``: each is looked up once."""
    if runs[0] < 2:
        runs[0] += 1
        if runs[0] < 2:
            return
        calls[0] = direct_call(kernel, kernel_args)
        calls[2] = direct_call(_all_read, read_args)
    if merge_args is not None and not runs[1]:
        runs[1] = True
        calls[1] = direct_call(_merge_kernel, merge_args)


@inner(fastmath=False)
def _row_ranges(opt, b, hk, group, N, row_lo, row_hi):
    """Keys ``[row_lo[r], row_hi[r])`` each stacked row may keep; their union's ``(lo, hi)``."""
    diag_shift = opt.diag_shift[b]
    length = opt.kv_lengths[b]
    u_lo, u_hi = length, 0
    for g in range(group):
        off_lo, off_hi = opt.band[b, hk * group + g, 0], opt.band[b, hk * group + g, 1]
        for i in range(N):
            r = g * N + i
            lo, hi = key_range(diag_shift, i, i + 1, off_lo, off_hi, length)
            row_lo[r], row_hi[r] = lo, hi
            if hi > lo:
                u_lo, u_hi = min(u_lo, lo), max(u_hi, hi)
    return u_lo, max(u_hi, u_lo)


@inner(fastmath=FASTMATH)
def _score_rows(st, tile_max, opt, where, row_span):
    """Turn each stacked row's ``z = st[r, :bk]``, ``z[c] = (q_i scale / tau_h) . k_{j0 + c}``, into its logits.

    (Under NVM ``z[c] = q_i . k_{j0 + c}``, scaled here: see `elastic_np.cpu._tiles.logits.query_factor`.)

    ``where = (b, hk, N, j0, bk)``; row ``r`` is query ``i = r % N`` of head
    ``h = hk * group + r // N``, keeping the keys ``[row_span[0, r],
    row_span[1, r])``. The score modifiers, each divided by ``tau_h`` like
    the product, with the arithmetic of `elastic_np.cpu._tiles.logits._modify_tile`
    (each term added by `plus_scaled`: the backward recomputes these logits
    with it, bit for bit); then ``-inf`` outside
    that range (causal, window, ``kv_lengths``, the gate's band) and where
    NVM, a closed gate, a false mask entry or a ``-inf`` bias removes the
    key; ``log G`` added. ``tile_max[r]`` receives the row's maximum.
    Returns ``check``: NaN where a key may not be finite (a raw product ``q
    . k`` that is not, before any mask: an inf or NaN in ``k`` makes every
    row's one so, as does an overflow), else 0. (One call for all the rows,
    and the only helper of a tile that takes ``opt``: the options are many
    arguments to pass.)
    """
    b, hk, N, j0, bk = where
    group = st.shape[0] // N
    neg_inf = -np.inf
    zero = scalar_like(0.0, st)
    check = zero
    for r in range(st.shape[0]):
        z = st[r, :bk]
        for c in range(bk):
            check += z[c] * zero
    for r in range(st.shape[0]):
        z = st[r, :bk]
        h, i = hk * group + r // N, r % N
        inv_tau_t, tau_over_cap, cap_over_tau, minus_alibi_over_tau = modifier_factors(
            opt.tau[h], opt.softcap, opt.alibi[b, h] if opt.has_alibi else 0.0, z)
        if opt.nvm:  # the product of unscaled queries (`query_factor`), scaled as the prefill tiles are
            scale_row(z, logits_factor(opt, h, z))
        if opt.has_softcap:
            for c in range(bk):
                z[c] = cap_over_tau * tanh_any(z[c] * tau_over_cap)
        base = j0 - i - opt.diag_shift[b]  # the offset of key j0 + c is base + c
        if opt.has_alibi:
            for c in range(bk):
                z[c] = plus_scaled(z[c], scalar_like(abs(np.int32(base + c)), z), minus_alibi_over_tau)
        if opt.has_bias:
            s_j = opt.bias_strides[3]
            at = b * opt.bias_strides[0] + h * opt.bias_strides[1] + i * opt.bias_strides[2] + j0 * s_j
            if s_j == 1:
                for c in range(bk):
                    z[c] = plus_scaled(z[c], opt.bias[at + c], inv_tau_t)
            else:
                for c in range(bk):
                    z[c] = plus_scaled(z[c], opt.bias[at + c * s_j], inv_tau_t)
        if opt.nvm:
            for c in range(bk):
                z[c] = z[c] if z[c] >= 0 else neg_inf
        c_lo = min(max(row_span[0, r] - j0, 0), bk)
        c_hi = max(min(row_span[1, r] - j0, bk), c_lo)
        for c in range(c_lo):
            z[c] = neg_inf
        for c in range(c_hi, bk):
            z[c] = neg_inf
        if opt.has_gate:
            at = base + opt.n_keys - 1  # the table's index of offset base + c is at + c
            for c in range(c_lo, c_hi):
                z[c] += opt.log_gate[b, h, at + c]
        if opt.has_mask:
            s_j = opt.mask_strides[3]
            at = b * opt.mask_strides[0] + h * opt.mask_strides[1] + i * opt.mask_strides[2] + j0 * s_j
            for c in range(c_lo, c_hi):
                if not opt.mask[at + c * s_j]:
                    z[c] = neg_inf
        tile_max[r] = _row_max(z, c_lo, c_hi)
    return check


@inner(fastmath={"nnan", "nsz", "arcp", "contract", "reassoc"})
def _row_max(z, c_lo, c_hi):
    """``max(z[c_lo:c_hi])``, ``-inf`` when empty (no NaN reaches it: it may assume none).

    Eight running maxima, independent of one another: LLVM does not vectorise
    this reduction, and one running maximum waits on each step's latency.
    """
    kept = z[c_lo:c_hi]  # indexed from 0: no wraparound of a negative index to test
    n = kept.shape[0]
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = scalar_like(-np.inf, z)
    for c in range(0, n - n % 8, 8):
        m0, m1, m2, m3 = max(m0, kept[c]), max(m1, kept[c + 1]), max(m2, kept[c + 2]), max(m3, kept[c + 3])
        m4, m5, m6, m7 = max(m4, kept[c + 4]), max(m5, kept[c + 5]), max(m6, kept[c + 6]), max(m7, kept[c + 7])
    m = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    for c in range(n - n % 8, n):
        m = max(m, kept[c])
    return m


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _decode_kernel(q, k, v, pages, opt, scales, fine, split_start, tiles, outs, tasks, part, parts):
    """Tasks (batch, kv head, split), or (batch, split) over every kv head: partial ``(max, sum, acc)`` of every stacked row.

    ``q``, ``k``, ``v``: operands (`elastic_np.cpu._tiles.operands`); ``pages``:
    None for a contiguous cache read head by head, else ``(table,
    block_size, together)``: a paged cache when ``block_size > 0``, and
    whether a task takes every kv head, a tile at a time, so that the rows
    of one key for all heads, adjacent in a ``(B, N, H, D)`` or paged cache,
    are read together (every head's keys then lie in the same range:
    `elastic_np.cpu._decode.tiles._together`). Either way each head's tiles, and so its bits, are the
    same. ``tiles = (block_k, ahead, by_run, run_keys)``: keys per tile, how
    far ahead the products hint, in which order a task's heads read a tile
    and the longest run (`elastic_np.cpu._decode.plan.tile_reads`). ``scales``: `cache_scales`; ``fine``: None for a float
    cache, else the operands of a quantized cache's per-token or per-group scales, of none for per-head ones
    (`_tile_of_heads`, `elastic_np.cpu._tiles.cache_scales.fine_operands`). Batch entry ``b`` has the key splits
    ``split_start[b] .. split_start[b + 1] - 1`` (`_locate`).
    ``outs = (part_max, part_sum, part_acc, read, suspect, out, lse)``: a
    task of an entry of several splits leaves its partials, one of a single
    split its rows of ``out`` and ``lse`` (`elastic_np.cpu._decode.merge`).
    ``read[b, hk]`` receives the keys ``[lo, hi)`` the splits of ``(b, hk)``
    read; ``suspect[b, hk, s]`` is set when a NaN or inf key or value (or an
    overflow) may have reached split ``s``'s sums.
    """
    part_acc, read, suspect = outs[2:5]
    block_k, ahead, by_run, run_keys = tiles
    B, H, N, D = shape(q)
    Hkv, Dv = shape(k)[1], shape(v)[3]
    group = H // Hkv
    rows = group * N
    dtype = part_acc.dtype
    heads = _heads_per_task(pages, Hkv)
    st = np.empty((heads, rows, block_k), dtype=dtype)
    shift_by = np.empty(rows, dtype=dtype)
    kept = np.empty(heads, dtype=np.bool_)
    runs = np.empty((block_k, 4), dtype=np.int64)  # the tile's runs: (at, row, c, n)
    qs = np.zeros((heads, rows, query_width(D)), dtype=dtype)  # zeros past D: `key_scores` reads a whole chunk
    acc = np.empty((heads, rows, Dv), dtype=dtype)
    row_max = np.empty((heads, rows), dtype=dtype)
    row_sum = np.empty((heads, rows))
    row_span = np.empty((heads, 2, rows), dtype=np.int64)  # the keys [lo, hi) each row may keep
    checksum = np.empty(heads, dtype=dtype)
    fine_keys = block_k if key_groups(fine) > 1 or value_groups(fine) > 1 else 0
    fine_scratch = np.empty((fine_keys, D), dtype=np.float32), np.empty((fine_keys, Dv), dtype=np.float32)
    one = one_split(rows, Dv, dtype)
    b = 0
    n_tasks = (Hkv // heads) * split_start[B]
    for _ in range(n_tasks):
        task = claim(tasks)  # the next unclaimed (`elastic_np.cpu._runtime.threads.claim`); a thread's tasks rise
        if task >= n_tasks:
            break
        b, head_group, s, n_split = _locate(task, split_start, Hkv // heads, b)
        hk0 = head_group * heads
        for t in range(heads):
            u_lo, u_hi = _row_ranges(opt, b, hk0 + t, group, N, row_span[t, 0], row_span[t, 1])
            read[b, hk0 + t, 0], read[b, hk0 + t, 1] = u_lo, u_hi
            _start_rows(q, opt, b, hk0 + t, scales[hk0 + t, 0], qs[t], (acc[t], row_max[t], row_sum[t]))
        checksum[:] = 0.0
        u_lo, u_hi = read[b, hk0, 0], read[b, hk0, 1]  # the same for every head of the task
        a = u_lo + (u_hi - u_lo) * s // n_split
        e = u_lo + (u_hi - u_lo) * (s + 1) // n_split
        for j0 in range(a, e, block_k):
            _tile_of_heads(k, v, pages, (b, hk0, heads, N, j0, min(block_k, e - j0), ahead, by_run, run_keys),
                           (st, shift_by, kept, runs, fine_scratch), (qs, row_span, checksum), opt,
                           (acc, row_max, row_sum), fine)
        for t in range(heads):
            hk = hk0 + t
            check = checksum[t] + task_result(acc[t], row_max[t], row_sum[t], scales[hk, 1],
                                              (b, hk, s, n_split, N, opt.beta), outs, one)
            suspect[b, hk, s] = not check == 0.0


@inner(fastmath=False)
def _locate(task, split_start, groups, b):
    """``(b, group, s, n_split)`` of ``task``: its batch entry, head group, split, and the entry's splits.

    Entry ``b`` has the ``groups * n_split`` tasks from ``groups *
    split_start[b]``, the split fastest; the search starts at entry ``b``
    (a thread's tasks rise).
    """
    while task >= groups * split_start[b + 1]:
        b += 1
    n_split = split_start[b + 1] - split_start[b]
    local = task - groups * split_start[b]
    return b, local // n_split, local % n_split, n_split


@inner(fastmath=False)
def _heads_per_task(pages, Hkv):
    """Kv heads a task of `_decode_kernel` takes: all of them where ``pages`` says so (never for ``pages=None``)."""
    if pages is None:
        return 1
    return Hkv if pages[2] else 1


@inner(fastmath=FASTMATH)
def _tile_of_heads(k, v, pages, where, work, rows_of, opt, state, fine):
    """The online softmax's step of the stacked rows of kv heads ``hk0 .. hk0 + heads - 1`` with keys ``j0 .. j0 + bk - 1``.

    ``where = (b, hk0, heads, N, j0, bk, ahead, by_run, run_keys)`` (`elastic_np.cpu._decode.plan.tile_reads`);
    ``work = (st, shift_by, kept, runs, fine_scratch)``, the thread's scratch (``st`` and
    ``kept`` by head of the task, ``runs`` the tile's runs); ``rows_of =
    (qs, row_span, checksum)`` and ``state = (acc, row_max, row_sum)`` by
    head of the task (``row_span``: `_row_ranges`' ``(row_lo, row_hi)``).
    ``fine``: None, or a quantized cache's per-token or per-group scales (none
    a row for per-head ones: `elastic_np.cpu._decode.tiles`): per group, a run's rows are
    dequantized into ``fine_scratch`` (float32 ``(block_k, D)`` and
    ``(block_k, Dv)``, in L1) as the products read them; per token, the
    products read the bytes and a key's scale multiplies its scores, a
    value's its probabilities (after the row sums took them).

    The keys and values are read where they lie, by the products of
    `elastic_np.cpu._decode.products`, a run of rows at a time (`_run`: the
    whole tile, or a page's part of it, at most ``run_keys`` keys): ``Q
    K^T`` of every head, then the softmax steps, then ``P V`` of every head,
    each pass in `_visit`'s order (the passes are written here: in a helper
    of their own the kernel runs slower). Each head's products, and so its
    bits, are those of a task of its own.
    """
    b, hk0, heads, N, j0, bk, ahead, by_run, run_keys = where
    st, shift_by, kept, runs, fine_scratch = work
    qs, row_span, checksum = rows_of
    acc, row_max, row_sum = state
    n_runs = 0
    c = 0
    while c < bk:
        at, row, n = _run(pages, b, j0, c, min(bk, c + run_keys))
        runs[n_runs, 0], runs[n_runs, 1], runs[n_runs, 2], runs[n_runs, 3] = at, row, c, n
        n_runs += 1
        c += n
    order = (b, hk0, heads, j0, ahead, by_run, n_runs)
    length = opt.kv_lengths[b]
    rows, D, Dv = qs.shape[1], shape(k)[3], acc.shape[2]  # qs rows are `query_width(D)` long
    for i in range(n_runs if by_run else heads):
        for j in range(heads if by_run else n_runs):
            t, c, n, rows_at, hint = _visit(k, pages, order, runs, i, j, length)
            # the sums of the prefill tiles: the backward recomputes these logits bit for bit
            if key_groups(fine) > 1:  # per group: the rows dequantized
                keys = fine_key_rows(fine, order, runs, i, j, rows_at, fine_scratch[0])
                key_scores(qs[t], keys, hint, st[t], c, rows, n, D)
            else:  # per token: the scores scaled
                key_scores(qs[t], rows_at, hint, st[t], c, rows, n, D)
                token_scaled_keys(fine, order, runs, i, j, st[t], c, rows)
    for t in range(heads):
        checksum[t] += _score_rows(st[t], shift_by, opt, (b, hk0 + t, N, j0, bk), row_span[t])
        kept[t] = query_major_update(st[t], bk, shift_by, (acc[t], row_max[t], row_sum[t]))
    for i in range(n_runs if by_run else heads):
        for j in range(heads if by_run else n_runs):
            t, c, n, rows_at, hint = _visit(v, pages, order, runs, i, j, length)
            if value_groups(fine) > 1:  # per group: the rows dequantized
                values = fine_value_rows(fine, order, runs, i, j, rows_at, fine_scratch[1])
                if kept[t]:
                    value_products(st[t], c, values, hint, acc[t], rows, n, Dv)
                else:  # the values are not multiplied: checked alone
                    checksum[t] += checked(values, Dv)
            elif kept[t]:  # per token: the probabilities scaled
                token_scaled_values(fine, order, runs, i, j, st[t], c, rows)
                value_products(st[t], c, rows_at, hint, acc[t], rows, n, Dv)
            else:
                checksum[t] += checked(rows_at, Dv)


@inner(fastmath=FASTMATH)
def _start_rows(q, opt, b, hk, k_scale, qs, state):
    """The stacked rows of kv head ``hk`` before its first tile: ``qs`` the queries scaled (by ``k_scale`` too, the
    keys' factor of `cache_scales`), ``state`` emptied."""
    acc, row_max, row_sum = state
    N, D = shape(q)[2], shape(q)[3]
    group = qs.shape[0] // N
    for g in range(group):
        h = hk * group + g
        factor = query_factor(opt, h) * k_scale
        q_h, col = head(q, b, h)
        for i in range(N):
            for d in range(D):
                qs[g * N + i, d] = widen(q_h[i, col + d]) * factor
    acc[:] = 0.0
    row_max[:] = -np.inf
    row_sum[:] = 0.0


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _decode_heads_kernel(q, k, v, pages, opt, split_start, block_k, outs, tasks, part, parts):
    """`_decode_kernel`'s tasks and partials, each head of the group a prefill tile of its ``N`` queries.

    ``pages = (table, block_size, together)`` as `_decode_kernel`'s, never None: ``block_size = 0`` for a
    contiguous cache, whose call then has the paged cache's types (`CONTIGUOUS_PAGES`).

    The key tiles are key-major, ``st[c, i]``, and go through the prefill's
    steps (`logits_tile`, `online_update`) one head after the other while
    the tile's keys and values are in cache: no transposed keys, and the
    per-query work runs along the SIMD lanes.
    """
    part_acc, read, suspect = outs[2:5]
    B, H, N, D = shape(q)
    Hkv, Dv = shape(k)[1], shape(v)[3]
    group = H // Hkv
    dtype = part_acc.dtype
    q_t = np.empty((group, D, N), dtype=dtype)
    st = np.empty((block_k, N), dtype=dtype)
    acc = np.empty((group, N, Dv), dtype=dtype)
    row_max = np.empty((group, N), dtype=dtype)
    row_sum = np.empty((group, N))
    tile_max = np.empty(N, dtype=dtype)
    shift_by = np.empty(N, dtype=dtype)
    rescale_by = np.empty(N, dtype=dtype)
    tile_sum = np.empty(N, dtype=dtype)
    scratch = (tile_max, shift_by, rescale_by, tile_sum)  # of `online_update`
    spans = np.empty((group, 2), dtype=np.int64)  # per head: its keys [j_lo, j_hi)
    row_lo = np.empty(group * N, dtype=np.int64)
    row_hi = np.empty(group * N, dtype=np.int64)
    kv_scratch = (np.empty((block_k, D), dtype=dtype), np.empty((block_k, Dv), dtype=dtype))  # see `_tiles`
    no_cap_slope = np.empty((0, 0), dtype=dtype)
    nvm_in_logits = opt.nvm and opt.has_gate  # as in the prefill forward
    nvm_in_max = opt.nvm and not opt.has_gate
    one = one_split(group * N, Dv, dtype)
    b = 0
    n_tasks = Hkv * split_start[B]
    for _ in range(n_tasks):
        task = claim(tasks)
        if task >= n_tasks:
            break
        b, hk, s, n_split = _locate(task, split_start, Hkv, b)
        u_lo, u_hi = _row_ranges(opt, b, hk, group, N, row_lo, row_hi)
        read[b, hk, 0], read[b, hk, 1] = u_lo, u_hi
        a = u_lo + (u_hi - u_lo) * s // n_split
        e = u_lo + (u_hi - u_lo) * (s + 1) // n_split
        for g in range(group):
            h = hk * group + g
            load_queries(head_rows(q, b, h, 0, N), query_factor(opt, h), q_t[g])
            spans[g, 0], spans[g, 1] = key_range(
                opt.diag_shift[b], 0, N, opt.band[b, h, 0], opt.band[b, h, 1], opt.kv_lengths[b]
            )
        acc[:] = 0.0
        row_max[:] = -np.inf
        row_sum[:] = 0.0
        checksum = scalar_like(0.0, st)
        for j0 in range(a, e, block_k):
            bk = min(block_k, e - j0)
            k_tile, v_tile, tile_check = _tiles(k, v, pages, b, hk, j0, bk, kv_scratch)
            checksum += tile_check
            for g in range(group):
                if j0 >= spans[g, 1] or j0 + bk <= spans[g, 0]:
                    continue
                tile_max[:] = -np.inf
                kept, maxed = logits_tile(
                    st, k_tile, q_t[g], opt, (b, hk * group + g, 0, N, j0), nvm_in_logits, no_cap_slope, tile_max,
                    nvm_in_max, None,
                )
                if kept:
                    online_update(st, v_tile, bk, N, maxed, nvm_in_max, scratch, (row_max[g], row_sum[g], acc[g]))
        checksum += task_result(acc.reshape(group * N, Dv), row_max.reshape(group * N), row_sum.reshape(group * N),
                                scalar_like(1.0, st), (b, hk, s, n_split, N, opt.beta), outs, one)
        suspect[b, hk, s] = not checksum == 0.0
