"""elastic_np.transformers.flash: FlashAttention 2's functions, against FlashAttention's semantics written out.

`fa_naive` writes, in float64 and for one sequence, what FlashAttention 2's
docstrings define: causal and the window aligned bottom-right, softcap
before ALiBi, ALiBi ``-slope |i + M - N - j|``, FlashAttention 3's sink
``s_aux`` as one more logit in each row's denominator. Each function must
give it within 1e-12 in float64: ``flash_attn_func``, the packed
``flash_attn_varlen_func`` (also over shuffled pages whose unused slots are
NaN), and ``flash_attn_with_kvcache``, whose new keys and values are written
in place into the cache, and nowhere else.
"""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from elastic_np.transformers import flash  # noqa: E402

OPTIONS = [
    {},
    {"causal": True},
    {"causal": True, "window_size": (3, 0), "softcap": 2.5},
    {"window_size": (2, 1), "alibi": True, "s_aux": True},
    {"causal": True, "softmax_scale": 0.7, "alibi": True, "s_aux": True, "softcap": 4.0},
]


def fa_naive(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
             s_aux=None):
    """``(out (N, H, Dv), lse (H, N))`` of one sequence, ``q`` ``(N, H, D)``, ``k``, ``v`` ``(M, Hkv, D)``."""
    N, H, D = q.shape
    M, Hkv, _ = k.shape
    group = H // Hkv
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1 / math.sqrt(D) if softmax_scale is None else softmax_scale
    s = torch.einsum("nhd,mhd->hnm", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(N)[:, None], torch.arange(M)[None, :]
    diagonal = i + M - N
    if alibi_slopes is not None:
        s = s - alibi_slopes[:, None, None] * (diagonal - j).abs()
    keep = torch.ones(N, M, dtype=torch.bool)
    if causal:
        keep &= j <= diagonal
    left, right = window_size
    if left >= 0:
        keep &= j >= diagonal - left
    if right >= 0:
        keep &= j <= diagonal + right
    s = s.masked_fill(~keep, -math.inf)
    if s_aux is not None:
        s = torch.cat([s, s_aux[:, None, None].expand(H, N, 1)], dim=-1)
        v = torch.cat([v, torch.zeros(1, H, v.shape[-1], dtype=v.dtype)])
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num()
    return torch.einsum("hnm,mhd->nhd", p, v), lse


def _arguments(options, H, generator):
    """FlashAttention's keyword arguments for one of `OPTIONS`."""
    kwargs = {name: options[name] for name in ("causal", "window_size", "softcap", "softmax_scale") if name in options}
    if options.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(H, generator=generator, dtype=torch.float64)
    if options.get("s_aux"):
        kwargs["s_aux"] = torch.randn(H, generator=generator, dtype=torch.float64)
    return kwargs


def _randn(*shape, generator):
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def _close(ours, expected):
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", OPTIONS)
def test_flash_attn_func_is_flash_attention(options):
    g = torch.Generator().manual_seed(0)
    q, k, v = _randn(2, 5, 4, 8, generator=g), _randn(2, 7, 2, 8, generator=g), _randn(2, 7, 2, 6, generator=g)
    kwargs = _arguments(options, 4, g)
    out = flash.flash_attn_func(q, k, v, **kwargs)
    assert out.shape == (2, 5, 4, 6)
    for b in range(2):
        _close(out[b], fa_naive(q[b], k[b], v[b], **kwargs)[0])


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("paged", [False, True])
def test_flash_attn_varlen_func_attends_each_sequence_alone(options, paged):
    g = torch.Generator().manual_seed(1)
    lengths_q, lengths_k = [3, 1, 6, 0], [5, 9, 6, 4]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    q, k, v = _randn(10, 4, 8, generator=g), _randn(24, 2, 8, generator=g), _randn(24, 2, 8, generator=g)
    kwargs = _arguments(options, 4, g)
    if paged:  # pages of 4 keys, shuffled, the unused slots NaN
        table = torch.randperm(12, generator=g)[:12].view(4, 3)
        k_pages, v_pages = torch.full((12, 4, 2, 8), math.nan, dtype=torch.float64), torch.full(
            (12, 4, 2, 8), math.nan, dtype=torch.float64)
        for s, n in enumerate(lengths_k):
            for t in range(n):
                k_pages[table[s, t // 4], t % 4] = k[cu_k[s] + t]
                v_pages[table[s, t // 4], t % 4] = v[cu_k[s] + t]
        out = flash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                           block_table=table, **kwargs)
    else:
        out = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, torch.tensor(max(lengths_q)), max(lengths_k),
                                           **kwargs)
    assert out.shape == (10, 4, 8)
    for s in range(4):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        _close(out[rows], fa_naive(q[rows], k[keys], v[keys], **kwargs)[0])


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("paged", [False, True])
def test_flash_attn_with_kvcache_writes_the_new_keys_in_place_and_attends_to_the_cache(options, paged):
    g = torch.Generator().manual_seed(2)
    B, N, cached = 3, 2, torch.tensor([4, 0, 9], dtype=torch.int32)
    q, k_new, v_new = _randn(B, N, 4, 8, generator=g), _randn(B, N, 2, 8, generator=g), _randn(B, N, 2, 8, generator=g)
    kwargs = _arguments(options, 4, g)
    if paged:
        k_cache, v_cache = _randn(9, 4, 2, 8, generator=g), _randn(9, 4, 2, 8, generator=g)
        table = torch.randperm(9, generator=g).view(3, 3).to(torch.int32)
        where = {"block_table": table}

        def keys(cache, b, n):
            return torch.cat([cache[p] for p in table[b].tolist()])[:n]
    else:
        k_cache, v_cache = _randn(4, 12, 2, 8, generator=g), _randn(4, 12, 2, 8, generator=g)
        rows = [2, 0, 3]
        where = {"cache_batch_idx": torch.tensor(rows)}

        def keys(cache, b, n):
            return cache[rows[b], :n]
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = flash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached,
                                             return_softmax_lse=True, **where, **kwargs)
    assert out.shape == (B, N, 4, 8) and lse.shape == (B, 4, N)
    written = (k_cache != before_k).any(dim=(-1, -2)) | (v_cache != before_v).any(dim=(-1, -2))
    assert int(written.sum()) == B * N  # the new keys' slots, and no other
    for b in range(B):
        n = int(cached[b]) + N
        kb, vb = keys(k_cache, b, n), keys(v_cache, b, n)
        torch.testing.assert_close(kb[-N:], k_new[b], rtol=0, atol=0)
        torch.testing.assert_close(vb[-N:], v_new[b], rtol=0, atol=0)
        torch.testing.assert_close(kb[:-N], keys(before_k, b, n)[:-N], rtol=0, atol=0)
        expected_out, expected_lse = fa_naive(q[b], kb, vb, **kwargs)
        _close(out[b], expected_out)
        _close(lse[b], expected_lse)


def test_flash_attn_with_kvcache_reads_the_cache_as_it_is_without_new_keys():
    g = torch.Generator().manual_seed(3)
    q, k_cache, v_cache = _randn(2, 1, 4, 8, generator=g), _randn(2, 6, 2, 8, generator=g), _randn(2, 6, 2, 8,
                                                                                                  generator=g)
    before = k_cache.clone()
    out = flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, causal=True)
    assert torch.equal(k_cache, before)
    for b in range(2):
        _close(out[b], fa_naive(q[b], k_cache[b, :5], v_cache[b, :5], causal=True)[0])
    whole = flash.flash_attn_with_kvcache(q, k_cache, v_cache)
    _close(whole[1], fa_naive(q[1], k_cache[1], v_cache[1])[0])


def test_what_elastic_np_does_not_take_is_an_error_naming_it():
    q = torch.zeros(1, 2, 2, 4)
    cache = torch.zeros(1, 4, 2, 4)
    with pytest.raises(ValueError, match="dropout_p=0.1"):
        flash.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="`rotary_cos`"):
        flash.flash_attn_with_kvcache(q, cache, cache, rotary_cos=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="`cache_leftpad`"):
        flash.flash_attn_with_kvcache(q, cache, cache, cache_leftpad=torch.zeros(1))
    with pytest.raises(ValueError, match="overflow the cache"):
        flash.flash_attn_with_kvcache(q, cache, cache, q, q, cache_seqlens=3)
    with pytest.raises(ValueError, match="`k` and values `v` together"):
        flash.flash_attn_with_kvcache(q, cache, cache, k=q, cache_seqlens=0)
    with pytest.raises(ValueError, match="`cache_seqlens` must be from 0"):
        flash.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5)
    with pytest.raises(ValueError, match="`cache_batch_idx` must be 1 rows"):
        flash.flash_attn_with_kvcache(q, cache, cache, cache_batch_idx=[1])
    with pytest.raises(ValueError, match="not both"):
        flash.flash_attn_with_kvcache(q, cache, cache, cache_batch_idx=[0], block_table=[[0]])
    with pytest.raises(ValueError, match="max_k"):
        flash.flash_attn_varlen_func(q[0], q[0], q[0], [0, 2], [0, 2], 2, 1)


def test_rows_past_the_last_offset_are_not_read_and_give_zeros():
    """transformers pads a batch to a fixed size: FlashAttention reads the offsets' rows alone."""
    g = torch.Generator().manual_seed(4)
    q, k = _randn(9, 4, 8, generator=g), _randn(8, 2, 8, generator=g)
    q[6:], k[5:] = math.nan, math.nan
    out = flash.flash_attn_varlen_func(q, k, k, [0, 2, 6], [0, 3, 5], 4, 3, causal=True)
    assert out.shape == (9, 4, 8) and not out[6:].any()
    _close(out[2:6], fa_naive(q[2:6], k[3:5], k[3:5], causal=True)[0])


def test_return_attn_probs_gives_flash_attentions_lse():
    g = torch.Generator().manual_seed(5)
    q, k = _randn(2, 3, 4, 8, generator=g), _randn(2, 5, 2, 8, generator=g)
    out, lse, probs = flash.flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 3)
    _close(lse[1], fa_naive(q[1], k[1], k[1], causal=True)[1])
    packed, packed_lse, _ = flash.flash_attn_varlen_func(q.reshape(6, 4, 8), k.reshape(10, 2, 8), k.reshape(10, 2, 8),
                                                         [0, 3, 6], [0, 5, 10], 3, 5, causal=True,
                                                         return_attn_probs=True)
    assert packed_lse.shape == (4, 6) and packed_lse.is_contiguous()
    _close(packed_lse, lse.transpose(0, 1).reshape(4, 6))
    assert torch.equal(packed.view(2, 3, 4, 8), out)


@pytest.mark.parametrize("cached", [3, [0, 2]])
def test_new_keys_unlike_the_queries_in_number_and_slopes_per_batch_entry(cached):
    """Three new keys for one query each (an int ``cache_seqlens`` too), ALiBi of shape (B, H)."""
    g = torch.Generator().manual_seed(6)
    q, k_new, v_new = _randn(2, 1, 4, 8, generator=g), _randn(2, 3, 2, 8, generator=g), _randn(2, 3, 2, 8,
                                                                                             generator=g)
    k_cache, v_cache = _randn(2, 8, 2, 8, generator=g), _randn(2, 8, 2, 8, generator=g)
    slopes = torch.rand(2, 4, generator=g, dtype=torch.float64)
    out = flash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached, causal=True,
                                        alibi_slopes=slopes)
    lengths = [cached] * 2 if isinstance(cached, int) else cached
    for b in range(2):
        n = lengths[b] + 3
        assert torch.equal(k_cache[b, n - 3:n], k_new[b])
        _close(out[b], fa_naive(q[b], k_cache[b, :n], v_cache[b, :n], causal=True, alibi_slopes=slopes[b])[0])


@pytest.mark.parametrize("bad", ["slopes", "page", "queries"])
def test_a_call_that_fails_leaves_the_cache_as_it_was(bad):
    g = torch.Generator().manual_seed(7)
    q, new = _randn(1, 1, 4, 8, generator=g), _randn(1, 1, 2, 8, generator=g)
    k_cache, v_cache = _randn(3, 4, 2, 8, generator=g), _randn(3, 4, 2, 8, generator=g)
    before = k_cache.clone(), v_cache.clone()
    kwargs = {"cache_seqlens": 4, "block_table": torch.tensor([[2, -1]])}
    if bad == "slopes":
        kwargs["alibi_slopes"], kwargs["block_table"] = torch.ones(3), torch.tensor([[2, 0]])
    elif bad == "queries":  # five queries over two keys: a paged sequence's queries are its last tokens
        q, kwargs = _randn(1, 5, 4, 8, generator=g), {"cache_seqlens": 1, "block_table": torch.tensor([[2, 0]])}
    with pytest.raises(ValueError, match={"slopes": "alibi_slopes", "page": "`block_table` names no page",
                                          "queries": "seqused_k"}[bad]):
        flash.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, **kwargs)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_half_precision_within_its_rounding():
    """bfloat16 inputs: ``out`` in bfloat16 within a few of its ulps of the float64 result on the same values;
    sink logits past float16's range of ``exp`` are taken (``beta`` in float32)."""
    g = torch.Generator().manual_seed(8)
    q, k = _randn(1, 6, 4, 16, generator=g).bfloat16(), _randn(1, 9, 2, 16, generator=g).bfloat16()
    s_aux = torch.tensor([12.0, -3.0, 0.5, 1.0])
    out = flash.flash_attn_func(q, k, k, causal=True, s_aux=s_aux)
    assert out.dtype == torch.bfloat16
    exact = fa_naive(q[0].double(), k[0].double(), k[0].double(), causal=True, s_aux=s_aux.double())[0]
    assert float((out[0].double() - exact).abs().max()) <= 4 * 2.0 ** -8 * float(exact.abs().max())
    half = flash.flash_attn_func(q.half(), k.half(), k.half(), causal=True, s_aux=s_aux)
    assert half.dtype == torch.float16 and bool(half.isfinite().all())
