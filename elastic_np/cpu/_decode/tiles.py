"""How the decode kernels find their key and value rows: in place, from a half, from a paged cache.

`_tiles` gives a kv head's tile to the key-major kernel as the prefill
products read it (``(whole, col)`` rows, `elastic_np.cpu._tiles.operands`), with a
check of its values: in place from a contiguous cache, converted into
scratch from a bfloat16 or float16 one (`elastic_np.cpu._tiles.halves`), gathered
from the pages of a paged cache (``pages = (block_table, block_size,
together)``, `elastic_np.cpu._decode.decode.forward`). The stacked-rows kernel reads
its rows in place, a run at a time (`_run`), in the order `_visit` gives;
those of a quantized cache with per-token or per-group scales, dequantized
into the thread's scratch as they are read (`fine_key_rows`,
`fine_value_rows`). `_check_unread_cache` checks what the kernels did not read.
"""

import numpy as np
from numba import njit
from numba.extending import overload

from elastic_np._contract import _validation
from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._tiles.halves import copied_checked, readable_checked, widen
from elastic_np.cpu._tiles.operands import head, head_rows, shape
from elastic_np.cpu._tiles.pages import is_none, scaled_rows
from elastic_np.cpu._tiles.scalar import scalar_like


#: The block table of a contiguous cache (`_tiles`).
_NO_TABLE = np.zeros((0, 0), dtype=np.int64)


def _together(opt):
    """Whether every query head of each batch entry keeps the same offsets, so every kv head the same keys."""
    return bool((opt.band == opt.band[:, :1]).all())


def _check_unread_cache(cache, lengths, read, suspect, q=None):
    """`elastic_np._contract._validation.check_cache_values` for what the kernel did not check as it read.

    ``cache = (k, v)``: ``(B, Hkv, M, D)`` arrays, or `_paged_rows` of a
    paged cache, or None where they were checked before. A suspect split (a
    sum that is not finite) is checked again exactly: it was a NaN or inf
    key or value, or a product that overflowed (no error); the keys below
    ``lengths[b]`` that no split read are checked here.

    ``q``: the queries' values, where the caller left their check to the
    stacked-rows kernel: its raw products ``q . k`` are checked before any
    mask, so a NaN or inf in ``q`` makes a split suspect wherever its rows
    met a key; where some kv head read none, or a split is suspect, ``q``
    is checked here, first, as a call in full checks it.
    """
    if _all_read(read, lengths, suspect):
        return  # every key below its length was read, and checked, by the kernel (q with them)
    if q is not None:
        _validation.check_finite(q, "q")
    if cache is None:
        return
    ranges = []
    for b, hk in np.ndindex(*read.shape[:2]):
        lo, hi, length = read[b, hk, 0], read[b, hk, 1], lengths[b]
        if suspect[b, hk].any() or hi <= lo:
            ranges.append((b, hk, 0, length))
        else:
            ranges += [(b, hk, 0, lo), (b, hk, hi, length)]
    for name, a in zip("kv", cache):
        if not all(np.isfinite(a[b, hk, lo:hi]).all() for b, hk, lo, hi in ranges if hi > lo):
            raise ValueError(f"`{name}` contains NaN or inf")


@njit(nogil=True, cache=True, fastmath=False)
def _all_read(read, lengths, suspect):
    """Whether every (batch, kv head) read keys ``[0, lengths[b])``, at least one, and no split is suspect (one
    call: NumPy's reductions cost microseconds each)."""
    for b in range(read.shape[0]):
        for hk in range(read.shape[1]):
            if read[b, hk, 0] > 0 or read[b, hk, 1] < lengths[b] or read[b, hk, 1] == 0:
                return False
            for s in range(suspect.shape[2]):
                if suspect[b, hk, s]:
                    return False
    return True


class _paged_rows:
    """A paged cache's keys (or values) indexed as ``[b, hk, lo:hi]``, like the ``(B, Hkv, M, D)`` array they stand for.

    Gathers just those rows (`forward`'s ``paged`` describes the layout).
    """

    def __init__(self, pages, table):
        self.pages, self.table = pages, table

    def __getitem__(self, index):
        b, hk, rows = index
        keys = np.arange(rows.start, rows.stop)
        block = self.pages.shape[1]
        return self.pages[self.table[b, keys // block], keys % block, hk]


@inner(fastmath=FASTMATH)
def _tiles(k, v, pages, b, hk, j0, bk, scratch):
    """``(k_tile, v_tile, checksum)``: keys ``j0 .. j0 + bk - 1`` of ``(b, hk)`` as the prefill products read them.

    ``k_tile``, ``v_tile`` are ``(whole, col)`` rows
    (`elastic_np.cpu._tiles.operands.head_rows`); ``checksum`` is 0 when their
    values are finite, else NaN. The rows of a contiguous cache, or of a tile
    within one page of a paged cache (`forward`'s ``paged``), are read in
    place (half ones converted into ``scratch = (keys, values)``); a tile
    over several pages is gathered from them into ``scratch``. Either way one
    pass reads the tile in memory order ahead of the products, which read
    ``V`` in column strips: those stream from memory far worse than rows in
    order.
    """
    D, Dv = shape(k)[3], shape(v)[3]
    at, row, n = _run(pages, b, j0, 0, bk)
    if n == bk:  # in place: one array, or one page
        return _in_place(k, v, (at, hk, row, bk), scratch)
    check = scalar_like(0.0, scratch[0])
    c = 0
    while c < bk:
        page, row, n = _segment(pages, b, j0 + c, bk - c)
        check += copied_checked(head_rows(k, page, hk, row, n), D, scratch[0][c : c + n])
        check += copied_checked(head_rows(v, page, hk, row, n), Dv, scratch[1][c : c + n])
        c += n
    return (scratch[0][:bk], c - c), (scratch[1][:bk], c - c), check


@inner(fastmath=FASTMATH)
def _in_place(k, v, rows, scratch):
    """`_tiles`' result for rows ``r0 .. r0 + n - 1`` of ``(at, hk)`` (``rows = (at, hk, r0, n)``), read in place and checked."""
    at, hk, r0, n = rows
    k_tile, k_check = readable_checked(head_rows(k, at, hk, r0, n), shape(k)[3], scratch[0])
    v_tile, v_check = readable_checked(head_rows(v, at, hk, r0, n), shape(v)[3], scratch[1])
    return k_tile, v_tile, k_check + v_check


@inner(fastmath=False)
def _run(pages, b, j0, c, bk):
    """``(at, row, n)``: where key ``j0 + c`` of batch entry ``b`` lies (``at`` the operand's batch entry or page) and how many of the tile's keys follow it there."""
    if pages is None:
        return b, j0 + c, bk - c
    if pages[1] == 0:
        return b, j0 + c, bk - c
    return _segment(pages, b, j0 + c, bk - c)


@inner(fastmath=False)
def _segment(pages, b, j, bk_left):
    """``(page, row, n)``: where key ``j`` of batch entry ``b`` lies, and how many keys of at most ``bk_left`` follow it there."""
    table, block_size, _ = pages
    row = j % block_size
    return table[b, j // block_size], row, min(block_size - row, bk_left)


@inner(fastmath=False)
def _visit(x, pages, order, runs, i, j, length):
    """``(t, c, n, rows, hint)``: the head and run a pass visits at step ``(i, j)``, its rows and the rows it hints.

    ``order = (b, hk0, heads, j0, ahead, by_run, n_runs)``; ``length``: the
    keys of batch entry ``b`` (no hint past them). ``by_run``: run
    after run, every head's rows of a run in turn (in a paged cache they
    are adjacent: each page is read in one stretch), each head hinting its
    own rows ``ahead`` keys on; else head after head, each hinting the next
    head's same rows (in a ``(B, N, H, D)`` or paged cache, the next ``D``
    entries), the last head the first one's ``ahead`` keys on: what is read
    next, soon enough to stay in the L2 cache.
    """
    b, hk0, heads, j0, ahead, by_run, _ = order
    t, c, at, hk, row, n = _visited(order, runs, i, j)
    if by_run:
        hint_head, hint_key = hk, j0 + c + ahead
    elif t + 1 < heads:
        hint_head, hint_key = hk + 1, j0 + c
    else:
        hint_head, hint_key = hk0, j0 + c + ahead
    return t, c, n, head_rows(x, at, hk, row, n), _ahead(x, pages, b, hint_head, hint_key, j0 + c, length)


@inner(fastmath=False)
def _ahead(x, pages, b, hk, j, here, length):
    """``(whole, col, row)``: where key ``j`` of ``(b, hk)`` lies, for the products' hints; key ``here`` (the one read) where ``j`` is past ``length``.

    (A paged cache's table names no page past ``length``.)
    """
    at, row, _ = _run(pages, b, here if j >= length else j, 0, 1)
    whole, col = head(x, at, hk)
    return whole, col, row


@inner(fastmath=False)
def _visited(order, runs, i, j):
    """``(t, c, at, hk, row, n)``: the head and run `_visit` visits at step ``(i, j)``, and where its rows lie."""
    hk0, by_run = order[1], order[5]
    r, t = (i, j) if by_run else (j, i)
    return t, runs[r, 2], runs[r, 0], hk0 + t, runs[r, 1], runs[r, 3]


def _make_fine(which):
    """The three jit-code steps of a quantized cache's per-token or per-group scales for ``k`` (``which`` 0) or
    ``v`` (1), ``fine = (k_scales, v_scales)`` (operands of ``D // G`` entries a row:
    `elastic_np._contract._quantized.fine_scale`; of none for per-head scales) or None for a float cache:
    ``(groups, rows, scaled)``."""

    def groups(fine):
        """``D // G`` of the scales, 0 for ``fine`` None or per-head scales (jit code only)."""
        raise NotImplementedError("only callable from compiled code")

    def rows(fine, order, runs, i, j, x_rows, into):
        """The rows the products read at `_visit`'s step ``(i, j)``: ``x_rows`` themselves for ``fine`` None,
        else times their per-group scales, in float32 in ``into``: ``(into[:n], 0)`` (jit code only)."""
        raise NotImplementedError("only callable from compiled code")

    def scaled(fine, order, runs, i, j, st, s_col, n_rows):
        """``st[r, s_col + c] *= scale of key c`` of the run at step ``(i, j)``, ``r < n_rows``: per-token
        scales applied to the scores (keys) or the probabilities (values) instead of the rows; nothing for
        ``fine`` None or per-head scales (jit code only)."""
        raise NotImplementedError("only callable from compiled code")

    @overload(groups, inline="always")
    def _groups(fine):
        if is_none(fine):
            return lambda fine: 0
        return lambda fine: shape(fine[which])[3]

    @overload(rows, jit_options={"fastmath": FASTMATH})
    def _rows(fine, order, runs, i, j, x_rows, into):
        if is_none(fine):
            return lambda fine, order, runs, i, j, x_rows, into: x_rows

        def dequantized(fine, order, runs, i, j, x_rows, into):
            scales = fine[which]
            _, _, at, hk, row, n = _visited(order, runs, i, j)
            scaled_rows(x_rows, head_rows(scales, at, hk, row, n), shape(scales)[3], np.float32(1.0),
                        into.shape[1], into)
            return into[:n], 0

        return dequantized

    @overload(scaled, jit_options={"fastmath": FASTMATH})
    def _scaled(fine, order, runs, i, j, st, s_col, n_rows):
        if is_none(fine):
            return lambda fine, order, runs, i, j, st, s_col, n_rows: None

        def per_key(fine, order, runs, i, j, st, s_col, n_rows):
            scales = fine[which]
            if shape(scales)[3] == 0:  # per-head scales (`elastic_np.cpu._tiles.cache_scales.NO_FINE`)
                return
            _, _, at, hk, row, n = _visited(order, runs, i, j)
            s_whole, s_c = head_rows(scales, at, hk, row, n)
            for r in range(n_rows):
                st_row = st[r, s_col : s_col + n]
                for c in range(n):
                    st_row[c] *= widen(s_whole[c, s_c])

        return per_key

    return groups, rows, scaled


key_groups, fine_key_rows, token_scaled_keys = _make_fine(0)
value_groups, fine_value_rows, token_scaled_values = _make_fine(1)
