"""A packed or paged batch's per-token and per-group cache scales (`elastic_np.varlen_attention`).

Packed keys ``(total_k, Hkv, D)`` take scales ``(total_k, Hkv)`` (per
token) or ``(total_k, Hkv, D // G)`` (per group); pages ``(num_blocks,
block_size, Hkv, D)`` take scale pages ``(num_blocks, block_size, Hkv)`` or
``(num_blocks, block_size, Hkv, D // G)``, read through the same block
table. A scale for the tensor or per kv head goes to every sequence as it
is (`elastic_np._api.varlen.CACHE_SCALES`).
"""

import numpy as np

from elastic_np._contract import _quantized

#: The options that hold a cache's scales, with the cache each scales.
_SCALED = (("k_scale", 0), ("v_scale", 1))


def checked(options, k, v, table=None, used=None):
    """``options`` with a packed batch's fine scales checked against its keys and values (a `ValueError` or
    `TypeError` naming the option otherwise), each given the ``D // G`` axis of `_quantized.fine_scale`.

    With ``table``: pages, whose values are checked on the rows the sequences use (``used[s]`` keys of the
    pages ``table[s]``) alone: a pool's other rows may hold anything.
    """
    caches = (k, v)
    made = {}
    for name, which in _SCALED:
        scale = _quantized.fine_array(options[name], name, caches[which].shape, check_values=table is None)
        if scale is not None:
            if table is not None:
                for s in range(table.shape[0]):
                    _quantized.check_fine_values(used_rows(scale, table, used, s), name)
            made[name] = scale
    if made:
        _quantized.check_same_kind(*(made.get(name) for name, _ in _SCALED))
    return {**options, **made} if made else options


def used_rows(pool, table, used, s):
    """Sequence ``s``'s rows of the pages ``pool`` (keys, values or their scales): the first ``used[s]`` rows of
    its pages ``table[s]``, ``(used[s], ...)`` (a copy)."""
    block = pool.shape[1]
    pages = table[s, : -(-int(used[s]) // block)]
    return pool[pages].reshape(-1, *pool.shape[2:])[: used[s]]


def has_fine(options):
    """Whether ``options`` (`checked`) hold a fine scale."""
    return any(_quantized.is_fine(options[name]) for name, _ in _SCALED)


def sequence(options, s, cu_k):
    """``options`` for packed sequence ``s`` (keys ``cu_k[s]:cu_k[s + 1]``, one batch entry, ``bnhd``): its
    rows of each fine scale."""
    return {**options, **{name: options[name][None, cu_k[s]:cu_k[s + 1]] for name, _ in _SCALED
                          if _quantized.is_fine(options[name])}}


def stand_ins(options, count, keys):
    """``(options, pools)``: fine scale pages taken out of ``options``, ones of shape ``(count, keys, Hkv,
    D // G)`` (zero-strided) standing in for the gathered scales, and ``pools`` the pages ``(k_scale,
    v_scale)``, for the CPU kernels to read through the block table; ``(options, None)`` without them."""
    if not has_fine(options):
        return options, None
    pools = tuple(options[name] for name, _ in _SCALED)
    ones = {name: np.broadcast_to(np.ones((), dtype=pool.dtype), (count, int(keys), *pool.shape[2:]))
            for (name, _), pool in zip(_SCALED, pools)}
    return {**options, **ones}, pools


def gathered(options, table, used, s):
    """``options`` for paged sequence ``s`` with its keys gathered (`elastic_np._api.paged._paged_keys`): its
    rows of each fine scale's pages, ``(1, used[s], Hkv, D // G)``."""
    return {**options, **{name: used_rows(options[name], table, used, s)[None] for name, _ in _SCALED
                          if _quantized.is_fine(options[name])}}
