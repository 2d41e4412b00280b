"""FlashAttention 2's three functions over elastic_np: what transformers' flash path calls.

`flash_attn_func`, `flash_attn_varlen_func` and `flash_attn_with_kvcache`
take the arguments of the ``flash_attn`` package's functions of those names,
in its order and conventions: tensors ``(batch, seqlen, heads, head_dim)``
(packed ``(total, heads, head_dim)``), ``causal`` aligned bottom-right,
``window_size=(left, right)`` with -1 for no bound, ``softcap=0.0`` for none,
``alibi_slopes`` of shape ``(H,)`` or ``(B, H)``; and FlashAttention 3's
``s_aux`` (gpt-oss's per-head sink logits, ``beta = exp(s_aux)`` here, taken
in float32 or float64). They run `elastic_np.torch.attention` and
`elastic_np.torch.varlen_attention` on CPU tensors (differentiable), so each
is, bit for bit, those functions' result. Attention dropout (``dropout_p >
0``) is an error naming it; ``deterministic`` changes nothing (every
elastic_np kernel is). ``return_attn_probs=True`` returns ``(out, lse,
None)``: FlashAttention's third value, its dropout pattern for testing, does
not exist here.

With ALiBi, ``lse`` is that of elastic_np's bias ``-slope |i + M - N - j|``;
FlashAttention 2's causal kernels add ``slope j`` instead, which leaves
``out`` the same and shifts a row's ``lse`` by ``slope (i + M - N)``.

transformers loads these functions as a kernel (`elastic_np.transformers`'
`register`), the way it loads FlashAttention from the Hub, which makes the
attention one its continuous batching takes.
"""

import torch

from elastic_np import torch as enpt

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, s_aux=None):
    """Attention of ``q`` ``(B, N, H, D)`` over ``k``, ``v`` ``(B, M, Hkv, D)``: ``out`` ``(B, N, H, Dv)``.

    ``H`` a multiple of ``Hkv`` (grouped-query heads). Returns ``out``, or
    with ``return_attn_probs`` ``(out, lse of shape (B, H, N), None)``.
    """
    options = _options(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, s_aux)
    result = enpt.attention(q, k, v, layout="bnhd", return_lse=return_attn_probs, **options)
    return (*result, None) if return_attn_probs else result


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, seqused_k=None,
                           s_aux=None):
    """Packed sequences: ``q`` ``(total_q, H, D)``, ``k``, ``v`` ``(total_k, Hkv, D)``, each sequence on its own.

    ``cu_seqlens_q`` and ``cu_seqlens_k`` are where each sequence starts;
    ``max_seqlen_q`` and ``max_seqlen_k`` bound the longest (checked). With
    ``block_table`` ``(S, max_blocks)``, ``k`` and ``v`` are the pages of a
    cache, ``(num_blocks, block_size, Hkv, D)``, read in place: sequence
    ``s`` uses ``seqused_k[s]`` keys, or without ``seqused_k``
    ``cu_seqlens_k[s + 1] - cu_seqlens_k[s]``, as FlashAttention 2 reads
    them; a sequence's queries are then its last tokens, at most as many as
    its keys (else an error naming them). Rows of ``q``, ``k`` and ``v``
    past the last offset (a batch padded to a fixed size, as transformers
    pads some) are not read; the rows of ``out`` past it are zeros (``lse``
    -inf). Returns ``out`` ``(total_q, H, Dv)``, or with
    ``return_attn_probs`` ``(out, lse of shape (H, total_q), None)``.
    """
    options = _options(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, s_aux)
    if block_table is not None:
        if seqused_k is None:
            seqused_k = torch.as_tensor(cu_seqlens_k).diff()
        cu_seqlens_k = None
    else:
        k, v = _packed(cu_seqlens_k, k, v)
    (q_read,) = _packed(cu_seqlens_q, q)
    result = enpt.varlen_attention(q_read, k, v, cu_seqlens_q, cu_seqlens_k,
                                   max_q=_as_int(max_seqlen_q), max_k=_as_int(max_seqlen_k), block_table=block_table,
                                   seqused_k=seqused_k, return_lse=return_attn_probs, **options)
    out, lse = result if return_attn_probs else (result, None)
    padding = q.shape[0] - out.shape[0]
    if padding:
        out = torch.cat([out, out.new_zeros((padding, *out.shape[1:]))])
        lse = None if lse is None else torch.cat([lse, lse.new_full((padding, *lse.shape[1:]), -torch.inf)])
    return (out, lse.T.contiguous(), None) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            s_aux=None):
    """Attention of ``q`` ``(B, N, H, D)`` over a cache, after writing the new keys ``k`` and values ``v`` into it.

    ``k_cache`` and ``v_cache`` are ``(B_cache, M_cache, Hkv, D)``, rows
    ``cache_batch_idx`` (default ``0 .. B - 1``), or with ``block_table``
    ``(B, max_blocks)`` the pages of a paged cache ``(num_blocks, block_size,
    Hkv, D)``. Sequence ``b`` holds ``cache_seqlens[b]`` keys (an int for
    all; default: the whole cache); ``k`` and ``v`` ``(B, N_new, Hkv, D)``,
    when given, are written in place after them, as FlashAttention does, and
    the queries attend to the ``cache_seqlens[b] + N_new`` keys, read in
    place, ``causal`` aligned to the last of them (``N`` at most that many,
    else an error naming them). A call that fails leaves the cache as it
    was. Rotary embeddings
    (``rotary_cos``, ``rotary_sin``) and ``cache_leftpad`` are not taken:
    errors naming them. ``num_splits`` changes nothing (the kernels' plan
    splits the keys). Returns ``out`` ``(B, N, H, Dv)``, and ``lse`` ``(B, H,
    N)`` (float32 for half-precision queries) with ``return_softmax_lse``.
    """
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise ValueError(f"flash_attn_with_kvcache: elastic_np does not take `{name}`; apply rotary embeddings "
                             "and left padding before the call")
    options = _options(q, 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, s_aux)
    B, N, H, _ = q.shape
    pages, capacity = _cache_pages(k_cache, v_cache, B, cache_batch_idx, block_table)
    cached = _cache_lengths(cache_seqlens, B, capacity)
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache takes the new keys `k` and values `v` together, or neither")
    written = None if k is None else _append(k_cache, v_cache, k, v, pages, cached, capacity)
    try:
        out = enpt.varlen_attention(q.reshape(B * N, H, q.shape[-1]), k_cache, v_cache,
                                    torch.arange(B + 1, dtype=torch.int32) * N, None, block_table=pages,
                                    seqused_k=cached if written is None else written[0],
                                    return_lse=return_softmax_lse, **options)
    except BaseException:  # an error, or Ctrl-C: put back what the new keys and values overwrote
        if written is not None:
            _, where, kept_k, kept_v = written
            with torch.no_grad():
                k_cache[where], v_cache[where] = kept_k, kept_v
        raise
    if not return_softmax_lse:
        return out.view(B, N, H, out.shape[-1])
    out, lse = out
    return out.view(B, N, H, out.shape[-1]), lse.view(B, N, H).transpose(1, 2)


def _options(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, s_aux):
    """elastic_np's options for FlashAttention's arguments; a `ValueError` for dropout, which it does not apply."""
    if dropout_p:
        raise ValueError(f"elastic_np applies no attention dropout: got dropout_p={dropout_p} (pass 0.0, as "
                         "transformers does when not training)")
    left, right = window_size
    options = {"scale": softmax_scale, "causal": bool(causal), "window_size": (int(left), int(right))}
    if softcap:
        options["softcap"] = float(softcap)
    if alibi_slopes is not None:
        options["alibi_slopes"] = alibi_slopes
    if s_aux is not None:
        options["beta"] = torch.exp(s_aux.to(torch.float64 if q.dtype == torch.float64 else torch.float32))
    return options


def _packed(cu_seqlens, *arrays):
    """Each of ``arrays``' rows up to the last of ``cu_seqlens`` (all where that is not a 1-D tensor of offsets
    within), the offsets read once."""
    offsets = torch.as_tensor(cu_seqlens)
    if offsets.dim() != 1 or offsets.numel() == 0 or offsets.dtype.is_floating_point:
        return arrays  # varlen_attention's checks name the argument
    last = int(offsets[-1])
    return tuple(x[:last] if 0 <= last < x.shape[0] else x for x in arrays)


def _as_int(value):
    """A maximum length as an int (transformers may pass a one-element tensor), or None."""
    return None if value is None else int(value)


def _cache_pages(k_cache, v_cache, B, cache_batch_idx, block_table):
    """The cache as pages: the block table of the ``B`` sequences and the keys a sequence can hold.

    A contiguous cache ``(B_cache, M_cache, Hkv, D)`` is ``B_cache`` pages of
    ``M_cache`` keys, sequence ``b`` the page ``cache_batch_idx[b]``.
    """
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"flash_attn_with_kvcache takes `k_cache` and `v_cache` of shapes (B_cache or num_blocks, "
                         f"M_cache or block_size, Hkv, D) alike but for D, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("flash_attn_with_kvcache takes `cache_batch_idx` or `block_table`, not both")
        table = torch.as_tensor(block_table)
        if table.dim() != 2 or table.shape[0] != B:
            raise ValueError(f"`block_table` must be (B, max_blocks) = ({B}, max_blocks), got {tuple(table.shape)}")
        return table, table.shape[1] * k_cache.shape[1]
    rows = torch.arange(B) if cache_batch_idx is None else torch.as_tensor(cache_batch_idx).cpu()
    if rows.shape != (B,) or rows.dtype.is_floating_point or bool(((rows < 0) | (rows >= k_cache.shape[0])).any()):
        raise ValueError(f"`cache_batch_idx` must be {B} rows of the cache's {k_cache.shape[0]}, got {rows.tolist()}")
    return rows[:, None].to(torch.int32), k_cache.shape[1]


def _cache_lengths(cache_seqlens, B, capacity):
    """``cache_seqlens`` as an int32 tensor of ``B`` counts from 0 to ``capacity`` (None: ``capacity`` each)."""
    if cache_seqlens is None:
        return torch.full((B,), capacity, dtype=torch.int32)
    lengths = torch.as_tensor(cache_seqlens).cpu()
    if lengths.dtype.is_floating_point or lengths.dim() > 1 or (lengths.dim() == 1 and lengths.shape[0] != B):
        raise ValueError(f"`cache_seqlens` must be an int or {B} ints, got {lengths.tolist()}")
    lengths = lengths.to(torch.int32).expand(B)
    if bool(((lengths < 0) | (lengths > capacity)).any()):
        raise ValueError(f"`cache_seqlens` must be from 0 to the {capacity} keys a sequence's cache holds, got "
                         f"{lengths.tolist()}")
    return lengths


def _append(k_cache, v_cache, k, v, pages, cached, capacity):
    """Write ``k``, ``v`` ``(B, N_new, Hkv, D)`` into the cache after each sequence's ``cached`` keys.

    Returns ``(the new counts, where the rows went, the rows they replaced in
    k_cache and in v_cache)``; checks everything first, so that nothing is
    written where a check fails.
    """
    new = k.shape[1]
    if k.dim() != 4 or k.shape[0] != pages.shape[0] or k.shape[2:] != k_cache.shape[2:] \
            or v.shape[:3] != k.shape[:3] or v.shape[3:] != v_cache.shape[3:]:
        raise ValueError(f"`k` and `v` must be (B, N_new, Hkv, D) with the cache's Hkv and D, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)} for caches {tuple(k_cache.shape)}")
    total = cached + new
    if bool((total > capacity).any()):
        raise ValueError(f"the {new} new keys overflow the cache: sequences hold {cached.tolist()} of {capacity} "
                         "keys (`cache_seqlens`)")
    positions = cached[:, None].long() + torch.arange(new)
    size = k_cache.shape[1]
    page = pages.long().gather(1, positions // size)
    if bool(((page < 0) | (page >= k_cache.shape[0])).any()):
        raise ValueError(f"`block_table` names no page of the cache's {k_cache.shape[0]} where the new keys go "
                         f"(pages {page.tolist()})")
    where = (page.to(k_cache.device), (positions % size).to(k_cache.device))
    kept_k, kept_v = k_cache[where].clone(), v_cache[where].clone()
    with torch.no_grad():
        k_cache[where] = k.to(k_cache.dtype)
        v_cache[where] = v.to(v_cache.dtype)
    return total, where, kept_k, kept_v
