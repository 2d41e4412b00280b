"""Key and value tiles of a paged cache, read where they lie, for the prefill products.

A paged cache's pages, ``(num_blocks, block_size, Hkv, D)``, are an operand
in the ``(B, N, H, D)`` layout whose batch entries are the pages
(`elastic_np.cpu._tiles.operands`); ``pages = (block_table, block_size)``
maps key ``j`` of batch entry ``b`` to row ``j % block_size`` of page
``block_table[b, j // block_size]``. A contiguous operand has `NO_PAGES`
(``block_size`` 0), so both are one compiled type.
"""

import numpy as np

from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._tiles.halves import copied, readable
from elastic_np.cpu._tiles.operands import head_rows, operand

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
