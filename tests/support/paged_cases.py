"""Paged caches built from contiguous keys and values, for the tests of `varlen_attention` with ``block_table``."""

import numpy as np


def paged(rng, k, v, used, block_size, spare=3, fill=None):
    """``(k_pages, v_pages, table)``: sequence ``s`` = the first ``used[s]`` keys of ``k`` and ``v`` (``(1, M, Hkv,
    D)``), in pages of its own, shuffled among ``spare`` pages no sequence uses.

    ``fill(pool)`` writes each pool first (default zeros): what the spare pages, and each sequence's last
    page past its keys, keep.
    """
    blocks = -(-np.asarray(used) // block_size)
    order = rng.permutation(int(blocks.sum()) + spare)
    table = np.zeros((len(used), max(int(blocks.max()), 1)), np.int64)
    taken = 0
    for s in range(len(used)):
        table[s, : blocks[s]] = order[taken : taken + blocks[s]]
        taken += blocks[s]
    pages = [in_pages(a, table, used, block_size, order.size, fill) for a in (k, v)]
    return (*pages, table)


def in_pages(a, table, used, block_size, n_pages, fill=None):
    """``a`` (``(1, M, ...)``) in ``n_pages`` pages of ``block_size`` rows: sequence ``s``'s first ``used[s]`` rows
    in its pages ``table[s]``, the other rows zeros or what ``fill(pool)`` wrote."""
    pool = np.zeros((n_pages, block_size, *a.shape[2:]), a.dtype)
    if fill is not None:
        fill(pool)
    for s, n in enumerate(used):
        for i in range(-(-n // block_size)):
            rows = slice(i * block_size, min((i + 1) * block_size, n))
            pool[table[s, i], : rows.stop - rows.start] = a[0, rows]
    return pool
