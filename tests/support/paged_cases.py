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
    pages = [np.zeros((order.size, block_size, *a.shape[2:]), a.dtype) for a in (k, v)]
    for pool in pages:
        if fill is not None:
            fill(pool)
    table = np.zeros((len(used), max(int(blocks.max()), 1)), np.int64)
    taken = 0
    for s, n in enumerate(used):
        table[s, : blocks[s]] = order[taken : taken + blocks[s]]
        for i, page in enumerate(table[s, : blocks[s]]):
            rows = slice(i * block_size, min((i + 1) * block_size, n))
            for pool, a in zip(pages, (k, v)):
                pool[page, : rows.stop - rows.start] = a[0, rows]
        taken += blocks[s]
    return (*pages, table)
