"""Paged caches in a packed batch (`elastic_np.varlen_attention` with ``block_table``): checks and kernel calls.

A paged cache is ``k`` and ``v`` pools of pages ``(num_blocks, block_size,
Hkv, D)``; sequence ``s`` uses the first ``used[s]`` keys of the pages
``table[s]``. `checked_pages` checks the table and lengths; the CPU kernels
read the pages in place, every sequence with the same number of a decode's
few queries in one call (`batch`), any other one sequence at a time
(`sequence`); the other backends get each sequence's keys gathered.
"""

import numpy as np

from elastic_np._api import cache_scales, dispatch
from elastic_np._contract import _spec


def page_shape_error(heads, k, why):
    """The `ValueError` for pages ``k`` that do not fit ``heads`` query heads, saying ``why``.

    It names the per-head order, ``(num_blocks, Hkv, block_size, D)``
    (vLLM's paged attention), where the pages could be in it (`_per_head_order`).
    """
    message = (f"with `block_table`, `k` and `v` must be pages of shape (num_blocks, block_size, Hkv, D), got `k` "
               f"of shape {tuple(k.shape)}: {why}")
    if _per_head_order(heads, k):
        message += (f"; these look like pages in the per-head order (num_blocks, Hkv, block_size, D) of "
                    f"vLLM's paged attention, {k.shape[1]} heads of {k.shape[2]} keys: pass `k.swapaxes(1, 2)` "
                    "and `v.swapaxes(1, 2)` (views; a call then copies the pages it reads)")
    return ValueError(message)


def _per_head_order(heads, k):
    """Whether pages ``k`` could be in vLLM's per-head order: their axis 1 divides the ``heads`` query heads."""
    return k.shape[1] != k.shape[2] and k.shape[1] > 0 and heads % k.shape[1] == 0


def checked_pages(k, block_table, seqused_k, count, heads):
    """``(table, used)`` of a paged cache, checked: each sequence's pages, and the keys it uses of them.

    ``heads`` is ``q``'s number of heads: pages too small for ``seqused_k``
    that would hold it in vLLM's per-head order are a `page_shape_error`.
    """
    table, used = np.asarray(block_table), None if seqused_k is None else np.asarray(seqused_k)
    if table.ndim != 2 or table.shape[0] != count or not np.issubdtype(table.dtype, np.integer):
        raise ValueError(f"`block_table` must be an integer array (sequences, max_blocks) = ({count}, ...), "
                         f"got {table.dtype} {table.shape}")
    valid = used is not None and used.shape == (count,) and np.issubdtype(used.dtype, np.integer) \
        and (used >= 0).all()
    if valid and (used > table.shape[1] * k.shape[1]).any() and (used <= table.shape[1] * k.shape[2]).all() \
            and _per_head_order(heads, k):
        raise page_shape_error(heads, k, f"{table.shape[1]} pages of {k.shape[1]} keys (axis 1) a sequence hold "
                                          f"fewer than `seqused_k` {used.tolist()}")
    if not valid or (used > table.shape[1] * k.shape[1]).any():
        raise ValueError(f"a paged cache needs `seqused_k`, the keys each of the {count} sequences uses, from 0 "
                         f"to its {table.shape[1]} pages of {k.shape[1]}, got {seqused_k!r}")
    read = _read_pages(table, used, k.shape[1])
    if ((table < 0) | (table >= k.shape[0]))[read].any():
        raise ValueError(f"`block_table` names a page outside the {k.shape[0]} of the cache (`k` and `v`)")
    _check_distinct(table, read)
    return table, used


def _read_pages(table, used, block_size):
    """Which entries of ``table`` hold keys the sequences use: ``(S, max_blocks)`` bools."""
    return np.arange(table.shape[1]) * block_size < np.asarray(used).reshape(-1, 1)


def _check_distinct(table, read):
    """A `ValueError` naming the first row of ``table`` whose pages that are ``read`` repeat one.

    One sort of every row, the pages not read replaced by negative numbers
    of their own (the pages read are at least 0, checked before).
    """
    pages = np.sort(np.where(read, table, -1 - np.arange(table.shape[1])), axis=1)
    repeats = pages[:, 1:] == pages[:, :-1]
    if repeats.any():
        s = int(np.argmax(repeats.any(axis=1)))
        page = pages[s, 1:][repeats[s]][0]
        raise ValueError(f"`block_table` row {s} names page {page} twice: a sequence's pages must differ")


def batch(q, k, v, cu_q, table, used, options, backend):
    """``(out, lse, run)``, every sequence of a paged cache in one call of the CPU decode kernel, or None.

    Each sequence keeps the key splits of a call of its own (`sequence`'s
    stand-in problem, ``splits(1, Hkv, used[s])``) and so its bits; the tasks
    of all of them share the threads. None, for the caller to go sequence by
    sequence, unless the backend is the CPU, every sequence has the same
    number of queries, and the batch is a
    problem the decode kernel takes (one that `prepare` rejects, the
    sequences' own calls raise about). ``run(q, k, v)``: the same call for
    other arrays of the same shapes and dtype, the same table and lengths
    (`elastic_np._api.paged_plans`), where the pools are C-contiguous (else None).
    """
    module = dispatch.get_backend(backend)
    lengths = np.diff(cu_q)
    if module.__name__ != "elastic_np.cpu" or (lengths != lengths[0]).any():
        return None
    count, N = lengths.size, int(lengths[0])
    options, scale_pages = cache_scales.stand_ins(options, count, used.max())
    batch = {**options, "kv_lengths": used, "align": "kv_lengths", "layout": "bnhd"}
    try:
        problem = dispatch.validated(module, q.reshape(count, N, *q.shape[1:]), *_stand_ins(k, v, count, used.max()),
                                     batch)
    except (ValueError, TypeError):
        return None
    if not module.decode_plan.takes(problem):
        return None
    entry_splits = [module.decode_plan.splits(1, k.shape[2], n) for n in used]
    decode = module.planned.paged(problem, k.shape[1], entry_splits)
    (k_pool, v_pool, pool_table), scale_pages = _kernel_pools(k, v, table, used, scale_pages)
    pool_table = np.array(pool_table, dtype=np.int64, order="C")

    def run(q, k_pool, v_pool):
        out, lse = decode(q.reshape(count, N, *q.shape[1:]).swapaxes(1, 2), k_pool, v_pool, pool_table, scale_pages)
        return out.swapaxes(1, 2).reshape(-1, *out.shape[1:2], out.shape[3]), lse.transpose(0, 2, 1).reshape(
            -1, lse.shape[1])

    with dispatch._reported(module, "forward", problem):
        out, lse = run(q, k_pool, v_pool)
    return out, lse, run if k_pool is k and v_pool is v else None


def sequence(q, k, v, table, used, options, backend, into=None, variant=None):
    """``(out, lse)`` of one sequence of a paged cache: its first ``used`` keys, pages ``table[0]`` (see `batch`).

    The CPU kernels read them from the pages in place (`elastic_np.cpu.paged_forward`), and may write
    ``out`` into ``into`` (the sequence's rows of the packed output, ``(1, N, H, Dv)``); the other backends
    get them gathered into a copy (`_paged_keys`), one sequence at a time. ``variant``: a user's
    (`elastic_np._variants.variant.Variant`, on the prefill kernel), or None.
    """
    module = dispatch.get_backend(backend)
    if module.__name__ == "elastic_np.cpu":
        kernel_options, scale_pages = cache_scales.stand_ins(options, 1, used)
        problem = dispatch.validated(module, q, *_stand_ins(k, v, 1, used), kernel_options)
        problem = problem if variant is None else problem.with_variant(variant)
        pools, scale_pages = _kernel_pools(k, v, table, [used], scale_pages)
        with dispatch._reported(module, "forward", problem):
            out, lse = module.paged_forward(problem, pools, into=into, scale_pages=scale_pages)
        return problem.as_given(out), lse
    k_s, v_s = _paged_keys(k, v, table, np.array([used]), 0)
    options = cache_scales.gathered(options, table, np.array([used]), 0)
    if variant is not None:
        return dispatch.variant_forward(q, k_s, v_s, _spec.complete(options, "attention"), variant, True, backend)
    return dispatch.attention(q, k_s, v_s, return_lse=True, backend=backend, **options)


def _kernel_pools(k, v, table, used, scale_pages=None):
    """``((k, v, table), scale_pages)`` as the CPU kernels read them (`elastic_np.cpu.paged_forward`'s ``paged``
    and ``scale_pages``: a quantized cache's per-token or per-group scale pages, or None).

    C-contiguous pools, writeable or not, are read in place, and so are pools
    stored per head (`_per_head`). The kernels read no other layout (pages
    apart, rows strided or broadcast): then the pages the call reads, and
    only those, are copied into compact pools, the table renumbered to them,
    and the scale pages' same pages with them.
    """
    if all(a.flags.c_contiguous or _per_head(a) for a in (k, v)):
        return (k, v, table), scale_pages
    read = _read_pages(table, used, k.shape[1])
    pages, renumbered = np.unique(table[read], return_inverse=True)
    compact_table = np.zeros(table.shape, dtype=np.int64)  # the entries not read: any page
    compact_table[read] = renumbered
    taken = tuple(_take_pages(pool, pages) for pool in (k, v, *(scale_pages or ())))
    return (*taken[:2], compact_table), taken[2:] or None


def _per_head(pool):
    """Whether ``pool`` is the ``(num_blocks, block_size, Hkv, D)`` view of a C-contiguous ``(num_blocks, Hkv,
    block_size, D)`` one (the page order of vLLM's CPU backend): each page's keys of one head contiguous."""
    return pool.transpose(0, 2, 1, 3).flags.c_contiguous


def _take_pages(pool, pages):
    """``pool[pages]``, C-contiguous whatever ``pool``'s layout.

    Indexing, not `numpy.take`, which first copies the whole of a pool that
    is not C-contiguous. The result is C-contiguous already unless a page's
    own axes are laid out otherwise (a Fortran-ordered pool): copied once
    more then.
    """
    return np.ascontiguousarray(pool[pages])


def _stand_ins(k, v, count, keys):
    """Zero-strided ``(count, keys, Hkv, D)`` keys and values (layout "bnhd") standing in for the gathered ones.

    They give a problem its shapes; the kernels read the pages.
    """
    shape = (count, int(keys), k.shape[2])
    return [np.broadcast_to(np.zeros((), dtype=a.dtype), shape + a.shape[3:]) for a in (k, v)]


def _paged_keys(k, v, table, used, s):
    """Sequence ``s``'s used keys and values gathered from their pages, ``(1, used, Hkv, D)`` each (a copy)."""
    return tuple(cache_scales.used_rows(a, table, used, s)[None] for a in (k, v))
