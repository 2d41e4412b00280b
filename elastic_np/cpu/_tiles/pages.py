"""Key and value tiles of a paged cache, read where they lie, for the prefill products.

A paged cache's pages, ``(num_blocks, block_size, Hkv, D)``, are an operand
in the ``(B, N, H, D)`` layout whose batch entries are the pages
(`elastic_np.cpu._tiles.operands`); ``pages = (block_table, block_size)``
maps key ``j`` of batch entry ``b`` to row ``j % block_size`` of page
``block_table[b, j // block_size]``. A contiguous operand has `NO_PAGES`
(``block_size`` 0), so both are one compiled type. `cache_tile` reads a
quantized cache's rows too, dequantized into scratch a tile at a time.
"""

import numpy as np
from numba import njit, types
from numba.extending import overload

from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._tiles.halves import copied, readable, widen
from elastic_np.cpu._tiles.operands import head_rows, operand, shape
from elastic_np.cpu._tiles.quantized import scaled_bytes

#: ``pages`` of a contiguous operand.
NO_PAGES = (np.zeros((0, 0), dtype=np.int64), 0)


def paged(block_table, block_size):
    """``pages`` of a paged operand: the table as the kernels read it (int64, C-contiguous)."""
    return np.array(block_table, dtype=np.int64, order="C"), int(block_size)


def pool_operand(pool):
    """The operand of a paged cache's pool: its ``(num_blocks, block_size, Hkv, D)`` storage read as a
    ``(B, N, H, D)`` one whose batch entries are the pages."""
    return operand(pool.transpose(0, 2, 1, 3))


def used_pages(table, lengths, block_size):
    """``(b, j0, page, n)`` of every page batch entry ``b`` uses: keys ``j0 .. j0 + n - 1`` of its first
    ``lengths[b]`` lie in the first ``n`` rows of page ``page`` (host code: the checks and copies made a page
    at a time)."""
    for b, length in enumerate(np.asarray(lengths).tolist()):
        for j0 in range(0, length, block_size):
            yield b, j0, table[b, j0 // block_size], min(block_size, length - j0)


@inner(fastmath=False)
def page_of(pages, b, j, left):
    """``(page, row, n)``: where key ``j`` of batch entry ``b`` lies, and how many keys of at most ``left`` follow
    it there."""
    table, block_size = pages
    row = j % block_size
    return table[b, j // block_size], row, min(block_size - row, left)


@inner(fastmath=False)
def tile_rows(x, pages, b, hk, j0, n, width, half_scratch, gathered):
    """Rows ``j0 .. j0 + n - 1`` of ``(b, hk)`` of operand ``x`` as the tile products read them (`readable`).

    In place from a contiguous operand or from one page (a half's converted
    into ``half_scratch``); a tile over several pages is copied (converted)
    from them into ``gathered``, ``(n, width)`` floats at least.
    """
    if pages[1] == 0:
        return readable(head_rows(x, b, hk, j0, n), width, half_scratch)
    page, row, m = page_of(pages, b, j0, n)
    if m == n:
        return readable(head_rows(x, page, hk, row, n), width, half_scratch)
    c = 0
    while c < n:
        page, row, m = page_of(pages, b, j0 + c, n - c)
        copied(head_rows(x, page, hk, row, m), width, gathered[c : c + m])
        c += m
    return gathered[:n], c - c


def is_none(ty):
    """Whether the Numba type ``ty`` is None's (an argument given as None, or left out): an overload's test."""
    return isinstance(ty, (types.NoneType, types.Omitted))


def _make_part(which):
    def part(quant):
        """``quant[which]``, None for ``quant`` None (jit code only)."""
        raise NotImplementedError("only callable from compiled code")

    @overload(part, inline="always")
    def _part(quant):
        if is_none(quant):
            return lambda quant: None
        return lambda quant: quant[which]

    return part


#: A kernel's ``quant`` (None, or ``(k's, v's)`` of `cache_tile`) for ``k`` and for ``v``.
key_quant, value_quant = _make_part(0), _make_part(1)


def cache_tile(x, pages, b, hk, j0, n, width, scratch, gathered, quant):
    """`tile_rows` of a float cache (``quant`` None); of a quantized one, its bytes times their scales in float32
    in ``scratch`` (``(n, width)`` at least), run by run (jit code only).

    ``quant = (factors, fine)``: the cache's per-head factors, ``(Hkv,)``
    (its scale over `elastic_np.cpu._tiles.quantized.UNIT`), and the
    operand of its per-token or per-group scales, of none for per-head
    scales (`elastic_np.cpu._tiles.cache_scales.fine_operands`).
    """
    raise NotImplementedError("only callable from compiled code")


@overload(cache_tile, jit_options={"fastmath": FASTMATH})
def _cache_tile(x, pages, b, hk, j0, n, width, scratch, gathered, quant):
    if is_none(quant):
        return lambda x, pages, b, hk, j0, n, width, scratch, gathered, quant: tile_rows(
            x, pages, b, hk, j0, n, width, scratch, gathered)

    def dequantized(x, pages, b, hk, j0, n, width, scratch, gathered, quant):
        c = 0
        while c < n:
            at, row, m = (b, j0 + c, n - c) if pages[1] == 0 else page_of(pages, b, j0 + c, n - c)
            _dequantized_rows(quant, head_rows(x, at, hk, row, m), (at, hk, row, m), width, scratch[c : c + m])
            c += m
        return scratch[:n], c - c

    return dequantized


def _dequantized_rows(quant, tile, where, width, out):
    """``out[:m] = `` the byte rows of ``tile`` times their scales, ``where = (at, hk, row, m)`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_dequantized_rows, inline="always")
def _dequantized_rows_impl(quant, tile, where, width, out):
    def dequantized_rows(quant, tile, where, width, out):
        factors, fine = quant
        at, hk, row, m = where
        if shape(fine)[3] == 0:  # per-head scales (`elastic_np.cpu._tiles.cache_scales.NO_FINE`)
            whole, col = tile
            for c in range(whole.shape[0]):
                scaled_bytes(whole[c, col : col + width], out[c], 0, width, factors[hk])
        else:
            scaled_rows(tile, head_rows(fine, at, hk, row, m), shape(fine)[3], factors[hk], width, out)

    return dequantized_rows


@njit(inline="always", fastmath=FASTMATH)
def scaled_rows(tile, scales, n_groups, factor, width, out):
    """``out[:m] = `` the ``m`` byte rows of ``tile`` widened, each group of ``width // n_groups`` columns times
    ``factor`` and its row's scale in ``scales`` (``(whole, col)`` rows of ``n_groups`` entries, float or a
    half's bits), a vector of bytes at a time (`scaled_bytes`) (jit code only)."""
    whole, col = tile
    s_whole, s_col = scales
    G = width // n_groups
    for c in range(whole.shape[0]):
        src, dst, row_scales = whole[c, col : col + width], out[c], s_whole[c, s_col : s_col + n_groups]
        for g in range(n_groups):
            scaled_bytes(src, dst, g * G, (g + 1) * G, widen(row_scales[g]) * factor)
