"""How the decode kernels read their key and value tiles: in place, from a half, from a paged cache.

`_tiles` gives a kv head's tile as the products read it (``(whole, col)``
rows, `elastic_np.cpu._operands`), with a check of its values: in place
from a contiguous cache, converted into scratch from a bfloat16 or float16
one (`elastic_np.cpu._halves`), from the pages of a paged cache (``pages =
(block_table, block_size, together)``, `elastic_np.cpu._decode.forward`).
Where a task takes every kv head (`_together`), `_read_all_heads` first
reads the tile across the heads in memory order, and a float tile over
several pages is not gathered: `_keys_by_page` transposes its keys and
`_values_by_page` multiplies its values a page at a time, the sums in the
same order. `_check_unread_cache` checks what the kernels did not read.
"""

import numpy as np
from numba import types
from numba.extending import overload

from elastic_np.cpu._calls import matmul_nn
from elastic_np.cpu._config import _FASTMATH
from elastic_np.cpu._halves import checked, copied, copied_checked, readable, readable_checked, storage_format, \
    stores_floats
from elastic_np.cpu._numba_private import inner
from elastic_np.cpu._operands import head_rows, shape
from elastic_np.cpu._scalar import _like
from elastic_np.cpu._transpose import transpose_store, transpose_width


#: The block table of a contiguous cache (`_tiles`).
_NO_TABLE = np.zeros((0, 0), dtype=np.int64)


def _together(opt):
    """Whether every query head of each batch entry keeps the same offsets, so every kv head the same keys."""
    return bool((opt.band == opt.band[:, :1]).all())


def _check_unread_cache(cache, lengths, read, suspect):
    """`elastic_np._validation.check_cache_values` for what the kernel did not check as it read.

    ``cache = (k, v)``: ``(B, Hkv, M, D)`` arrays, or `_paged_rows` of a
    paged cache. A suspect split (a sum that is not finite) is checked again
    exactly: it was a NaN or inf key or value, or a product that overflowed
    (no error); the keys below ``lengths[b]`` that no split read are checked
    here.
    """
    lengths_by_pair = np.asarray(lengths)[:, None]
    if not suspect.any() and not ((read[..., 0] > 0) | (read[..., 1] < lengths_by_pair)).any():
        return  # every key below its length was read, and checked, by the kernel
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


@inner(fastmath=_FASTMATH)
def _read_all_heads(k, v, pages, b, j0, bk):
    """Keys and values ``j0 .. j0 + bk - 1`` of every kv head of batch entry ``b`` read in memory order: 0 when finite.

    In a ``(B, N, H, D)`` or paged cache the rows of one key for all kv heads
    are adjacent: this pass streams them in order (which the hardware
    prefetcher follows, where a head's rows alone are ``Hkv * D`` entries
    apart), so the products that follow, head by head, find them in cache.
    Returns NaN if any is not finite.
    """
    check = 0.0
    c = 0
    while c < bk:
        at, row, n = (b, j0 + c, bk - c) if pages[1] == 0 else _segment(pages, b, j0 + c, bk - c)
        check += checked(head_rows(k, at, 0, row, n), shape(k)[1] * shape(k)[3])
        check += checked(head_rows(v, at, 0, row, n), shape(v)[1] * shape(v)[3])
        c += n
    return check


@inner(fastmath=_FASTMATH)
def _tiles(k, v, pages, b, hk, j0, bk, scratch):
    """``(k_tile, v_tile, checksum)``: keys ``j0 .. j0 + bk - 1`` of ``(b, hk)`` as the products read them.

    ``k_tile``, ``v_tile`` are ``(whole, col)`` rows
    (`elastic_np.cpu._operands.head_rows`); ``checksum`` is 0 when their
    values are finite, else NaN. The rows of a contiguous cache, or of a tile
    within one page of a paged cache (`forward`'s ``paged``), are read in
    place (half ones converted into ``scratch = (keys, values)``); a tile
    over several pages is gathered from them into ``scratch``. Either way one pass reads the tile in
    memory order ahead of the products, which read ``V`` in column strips:
    those stream from memory far worse than rows in order.
    """
    D, Dv = shape(k)[3], shape(v)[3]
    if pages is None:
        return _in_place(k, v, (b, hk, j0, bk), scratch)
    _, block_size, together = pages
    zero = _like(0.0, scratch[0])
    if block_size == 0 or j0 // block_size == (j0 + bk - 1) // block_size:  # in place: one array, or one page
        at, row, _ = (b, j0, bk) if block_size == 0 else _segment(pages, b, j0, bk)
        if together:  # checked by `_read_all_heads` already
            return readable(head_rows(k, at, hk, row, bk), D, scratch[0]), \
                readable(head_rows(v, at, hk, row, bk), Dv, scratch[1]), zero, False
        return _in_place(k, v, (at, hk, row, bk), scratch)
    if together and stores_floats(k[0]):  # checked; the steps read the pages a segment at a time
        return (scratch[0][:0], 0), (scratch[1][:0], 0), zero, True
    check = zero
    c = 0
    while c < bk:
        page, row, n = _segment(pages, b, j0 + c, bk - c)
        if together:  # checked by `_read_all_heads` already
            copied(head_rows(k, page, hk, row, n), D, scratch[0][c : c + n])
            copied(head_rows(v, page, hk, row, n), Dv, scratch[1][c : c + n])
        else:
            check += copied_checked(head_rows(k, page, hk, row, n), D, scratch[0][c : c + n])
            check += copied_checked(head_rows(v, page, hk, row, n), Dv, scratch[1][c : c + n])
        c += n
    return (scratch[0][:bk], c - c), (scratch[1][:bk], c - c), check, False


@inner(fastmath=_FASTMATH)
def _in_place(k, v, rows, scratch):
    """`_tiles`' result for rows ``r0 .. r0 + n - 1`` of ``(at, hk)`` (``rows = (at, hk, r0, n)``), read in place and checked."""
    at, hk, r0, n = rows
    k_tile, k_check = readable_checked(head_rows(k, at, hk, r0, n), shape(k)[3], scratch[0])
    v_tile, v_check = readable_checked(head_rows(v, at, hk, r0, n), shape(v)[3], scratch[1])
    return k_tile, v_tile, k_check + v_check, False


def _keys_by_page(segmented, b, hk, j0, bk, kt):
    """`_transpose_keys` of a tile over several pages, a page at a time (jit code only; float storage)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_keys_by_page, jit_options={"fastmath": _FASTMATH})
def _keys_by_page_float(segmented, b, hk, j0, bk, kt):
    if not _reads_floats(segmented):
        return lambda segmented, b, hk, j0, bk, kt: None  # a half's tiles are converted, never segmented

    def by_page(segmented, b, hk, j0, bk, kt):
        k, v, pages = segmented
        c = 0
        while c < bk:
            page, row, n = _segment(pages, b, j0 + c, bk - c)
            _transpose_keys(head_rows(k, page, hk, row, n), kt, n, shape(k)[3], c)
            c += n

    return by_page


def _values_by_page(segmented, b, hk, j0, bk, st, acc):
    """``acc += P V`` of a tile over several pages, a page at a time, the sums in key order (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_values_by_page, jit_options={"fastmath": _FASTMATH})
def _values_by_page_float(segmented, b, hk, j0, bk, st, acc):
    if not _reads_floats(segmented):
        return lambda segmented, b, hk, j0, bk, st, acc: None

    def by_page(segmented, b, hk, j0, bk, st, acc):
        k, v, pages = segmented
        c = 0
        while c < bk:
            page, row, n = _segment(pages, b, j0 + c, bk - c)
            v_rows, v_col = head_rows(v, page, hk, row, n)
            matmul_nn(st, c, v_rows, v_col, acc, acc.shape[0], acc.shape[1], n, True)
            c += n

    return by_page


def _reads_floats(segmented):
    """Whether the (Optional) ``(k, v, pages)`` type holds float storage."""
    ty = segmented.type if isinstance(segmented, types.Optional) else segmented
    return isinstance(ty, types.BaseTuple) and storage_format(ty.types[0].types[0].dtype) is None


@inner(fastmath=False)
def _segment(pages, b, j, bk_left):
    """``(page, row, n)``: where key ``j`` of batch entry ``b`` lies, and how many keys of at most ``bk_left`` follow it there."""
    table, block_size, _ = pages
    row = j % block_size
    return table[b, j // block_size], row, min(block_size - row, bk_left)


@inner(fastmath=False)
def _transpose_keys(k_tile, kt, bk, D, at):
    """``kt[d, at + c] = K[c, d]`` for ``c < bk``, ``d < D``: square blocks in registers, the edges one by one.

    ``k_tile = (whole, col)``: the keys' rows, ``K = whole[:, col:]`` (`elastic_np.cpu._operands.head_rows`).

    The blocks follow the key rows, which are then read in order; ``kt``'s
    rows are a cache line longer than the tile, so that the ``D`` rows of
    ``kt`` that a block row writes do not fall into the same few cache sets.
    """
    whole, col = k_tile
    width = transpose_width(kt)
    stride = kt.shape[1]
    flat = kt.reshape(kt.size)
    bk_w = bk - bk % width
    d_w = D - D % width
    one = _like(1.0, kt)
    for c0 in range(0, bk_w, width):
        for d0 in range(0, d_w, width):
            transpose_store(whole, flat, d0 * stride + at + c0, stride, c0, col + d0, one)
    for c in range(bk):
        kc = whole[c, col : col + D]
        for d in range(0 if c >= bk_w else d_w, D):
            kt[d, at + c] = kc[d]
