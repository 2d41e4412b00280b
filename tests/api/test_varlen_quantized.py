"""Quantized (int8, float8) caches in `varlen_attention`: packed and paged, with ``k_scale`` and ``v_scale``.

Each sequence gets the bits of `attention` on its own quantized keys (whose
kernels `tests/cpu/test_quantized.py` holds to the oracle): a paged step's
decodes in one call of the decode kernel, reading the pages' bytes in place
with the scales folded in, its prefill chunks through float32 copies, as
`attention` reads a quantized cache; the reference backend reads the
dequantized cache.
"""

import tracemalloc

import numpy as np
import pytest

import elastic_np as enp
import paged_cases

pytest.importorskip("ml_dtypes")
FORMATS = ("int8", "float8_e4m3fn", "float8_e5m2")


def _cache(rng, fmt, M, Hkv, D, scale):
    """``(k, v, k_scale, v_scale)``: a quantized ``(1, M, Hkv, D)`` cache and its scales (per token ``(1, M,
    Hkv)``, per group of 16 columns ``(1, M, Hkv, D // 16)``)."""
    k, v = (rng.standard_normal((1, M, Hkv, D)).astype(np.float32) * s for s in (3.0, 0.5))
    group = 16 if scale == "group" else None
    (kd, ks), (vd, vs) = (enp.quantize_kv(a, fmt, scale=scale, group_size=group, layout="bnhd") for a in (k, v))
    return kd, vd, ks, vs


def _paged(rng, k, v, used, block_size):
    """`paged_cases.paged`, the spare pages' bytes drawn (small: no float8 NaN)."""
    def fill(pool):
        pool.view(np.uint8)[...] = rng.integers(0, 256, pool.view(np.uint8).shape, dtype=np.uint8) & 0x3F

    return paged_cases.paged(rng, k, v, used, block_size, fill=fill)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", ["head", "tensor"])
@pytest.mark.parametrize("block_size", [16, 5])
def test_a_paged_step_over_a_quantized_cache_has_each_sequences_bits(fmt, scale, block_size):
    rng = np.random.default_rng(1)
    H, Hkv, D = 8, 2, 64
    k, v, ks, vs = _cache(rng, fmt, 700, Hkv, D, scale)
    used, lengths_q = [300, 47, 129, 700], [1, 40, 1, 3]  # decodes of 1 and 3 queries, a chunk of 40
    k_pages, v_pages, table = _paged(rng, k, v, used, block_size)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)])
    q = rng.standard_normal((cu_q[-1], H, D)).astype(np.float32)
    options = dict(causal=True, k_scale=ks, v_scale=vs, softcap=30.0)
    out, lse = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used,
                                    return_lse=True, backend="cpu", **options)
    for s, n in enumerate(used):
        rows = slice(cu_q[s], cu_q[s + 1])
        want, want_lse = enp.attention(q[None, rows], k[:, :n], v[:, :n], layout="bnhd", kv_lengths=[n],
                                       align="kv_lengths", return_lse=True, backend="cpu", **options)
        assert np.array_equal(out[rows], want[0]), s
        assert np.array_equal(lse[rows], want_lse[0].T), s
    ref = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used,
                               backend="reference", **options)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("scale", ["token", "group"])
@pytest.mark.parametrize("block_size", [16, 5])
def test_per_token_and_per_group_scale_pages(fmt, scale, block_size):
    """Scale pages ``(num_blocks, block_size, Hkv[, D // G])`` read through the block table: each sequence the
    bits of `attention` on its own keys and scales, the oracle within float32's reach (float8_e5m2's bytes
    with these scales: tests/cpu/test_quantized.py, whose kernels are these)."""
    rng = np.random.default_rng(7)
    H, Hkv, D = 8, 2, 64
    k, v, ks, vs = _cache(rng, fmt, 400, Hkv, D, scale)
    used, lengths_q = [300, 47, 129, 400], [1, 40, 1, 3]
    k_pages, v_pages, table = _paged(rng, k, v, used, block_size)
    ks_pages, vs_pages = (paged_cases.in_pages(a, table, used, block_size, k_pages.shape[0]) for a in (ks, vs))
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)])
    q = rng.standard_normal((cu_q[-1], H, D)).astype(np.float32)
    options = dict(causal=True, softcap=30.0)
    call = dict(block_table=table, seqused_k=used, k_scale=ks_pages, v_scale=vs_pages, **options)
    out, lse = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, return_lse=True, backend="cpu", **call)
    for s, n in enumerate(used):
        rows = slice(cu_q[s], cu_q[s + 1])
        want, want_lse = enp.attention(q[None, rows], k[:, :n], v[:, :n], layout="bnhd", k_scale=ks[:, :n],
                                       v_scale=vs[:, :n], return_lse=True, backend="cpu", **options)
        assert np.array_equal(out[rows], want[0]), s
        assert np.array_equal(lse[rows], want_lse[0].T), s
    ref = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, backend="reference", **call)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def halved_past_the_diagonal(score, b, h, q_idx, kv_idx):
    return score * 0.5 if kv_idx > q_idx else score


def test_a_users_variant_over_quantized_scale_pages_has_each_sequences_bits():
    """A ``score_mod`` over an int8 cache with per-token scale pages: the prefill kernel reads the pages and their
    scales in place, each sequence the bits of `attention` with the variant on its own keys and scales."""
    rng = np.random.default_rng(8)
    H, Hkv, D = 4, 2, 32
    k, v, ks, vs = _cache(rng, "int8", 90, Hkv, D, "token")
    used, lengths_q = [90, 33], [1, 6]
    k_pages, v_pages, table = _paged(rng, k, v, used, 16)
    ks_pages, vs_pages = (paged_cases.in_pages(a, table, used, 16, k_pages.shape[0]) for a in (ks, vs))
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)])
    q = rng.standard_normal((cu_q[-1], H, D)).astype(np.float32)
    out = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used, k_scale=ks_pages,
                               v_scale=vs_pages, score_mod=halved_past_the_diagonal, backend="cpu")
    for s, n in enumerate(used):
        rows = slice(cu_q[s], cu_q[s + 1])
        want = enp.attention(q[None, rows], k[:, :n], v[:, :n], layout="bnhd", k_scale=ks[:, :n], v_scale=vs[:, :n],
                             score_mod=halved_past_the_diagonal, backend="cpu")
        assert np.array_equal(out[rows], want[0]), s


def test_scale_pages_are_checked_where_they_are_read():
    rng = np.random.default_rng(8)
    k, v, ks, vs = _cache(rng, "int8", 40, 2, 32, "token")
    k_pages, v_pages, table = _paged(rng, k, v, [40], 16)
    ks_pages, vs_pages = (paged_cases.in_pages(a, table, [40], 16, k_pages.shape[0]) for a in (ks, vs))
    q = rng.standard_normal((1, 4, 32)).astype(np.float32)
    call = dict(block_table=table, seqused_k=[40], backend="cpu")
    with pytest.raises(ValueError, match=r"`v_scale` of shape \(6, 16, 2, 5\) is neither per token, \(6, 16, 2\)"):
        enp.varlen_attention(q, k_pages, v_pages, [0, 1], None, k_scale=ks_pages,
                             v_scale=np.ones((6, 16, 2, 5), np.float32), **call)
    bad = ks_pages.copy()
    bad[table[0, 2], 7, 1] = -1.0  # key 39, the last one used
    with pytest.raises(ValueError, match=r"`k_scale` must be finite and > 0 everywhere, got -1.0"):
        enp.varlen_attention(q, k_pages, v_pages, [0, 1], None, k_scale=bad, v_scale=vs_pages, **call)
    bad[table[0, 2], 7, 1] = ks_pages[table[0, 2], 7, 1]
    bad[table[0, 2], 8, 1] = -1.0  # past the keys used: never read
    got = enp.varlen_attention(q, k_pages, v_pages, [0, 1], None, k_scale=bad, v_scale=vs_pages, **call)
    want = enp.varlen_attention(q, k_pages, v_pages, [0, 1], None, k_scale=ks_pages, v_scale=vs_pages, **call)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", ["head", "token", "group"])
def test_a_packed_batch_over_a_quantized_cache_has_each_sequences_bits(fmt, scale):
    rng = np.random.default_rng(2)
    k, v, ks, vs = _cache(rng, fmt, 240, 2, 32, scale)
    cu_k, cu_q = np.array([0, 100, 101, 240]), np.array([0, 1, 2, 50])
    q = rng.standard_normal((50, 4, 32)).astype(np.float32)
    fine = scale != "head"
    packed = dict(k_scale=ks[0] if fine else ks, v_scale=vs[0] if fine else vs)  # (total_k, Hkv[, D // G])
    out = enp.varlen_attention(q, k[0], v[0], cu_q, cu_k, causal=True, backend="cpu", **packed)
    for s in range(3):
        keys = slice(cu_k[s], cu_k[s + 1])
        scales = {name: a[:, keys] if fine else a for name, a in (("k_scale", ks), ("v_scale", vs))}
        want = enp.attention(q[None, cu_q[s]:cu_q[s + 1]], k[:, keys], v[:, keys], layout="bnhd", causal=True,
                             backend="cpu", **scales)
        assert np.array_equal(out[cu_q[s]:cu_q[s + 1]], want[0]), s
    with pytest.raises(ValueError, match="`k_scale` of shape"):
        enp.varlen_attention(q, k[0], v[0], cu_q, cu_k, k_scale=np.ones((239, 2), np.float32), v_scale=vs)


def test_a_quantized_paged_decode_reads_the_pages_in_place():
    rng = np.random.default_rng(3)
    k, v, ks, vs = _cache(rng, "int8", 8192, 8, 128, "head")
    k_pages, v_pages, table = _paged(rng, k, v, [8192, 8192], 16)
    q = rng.standard_normal((2, 32, 128)).astype(np.float32)
    call = dict(block_table=table, seqused_k=[8192, 8192], k_scale=ks, v_scale=vs, backend="cpu")
    enp.varlen_attention(q, k_pages, v_pages, [0, 1, 2], None, **call)  # compiled before the peak is taken
    tracemalloc.start()
    enp.varlen_attention(q, k_pages, v_pages, [0, 1, 2], None, **call)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < k_pages.nbytes / 16, (peak, k_pages.nbytes)  # its keys and values, gathered, are 4 MiB


def test_the_scales_of_a_quantized_paged_cache_are_checked_by_name():
    rng = np.random.default_rng(4)
    k, v, ks, vs = _cache(rng, "int8", 64, 2, 16, "head")
    k_pages, v_pages, table = _paged(rng, k, v, [64], 16)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    call = dict(block_table=table, seqused_k=[64], backend="cpu")
    with pytest.raises(ValueError, match="k_scale"):
        enp.varlen_attention(q, k_pages, v_pages, [0, 1], None, v_scale=vs, **call)
    with pytest.raises(ValueError, match="k_scale"):
        enp.varlen_attention(q, k_pages, v_pages, [0, 1], None, k_scale=np.ones(3), v_scale=vs, **call)


def test_a_nan_float8_byte_in_a_used_page_is_an_error_one_in_a_spare_page_is_not():
    import ml_dtypes

    rng = np.random.default_rng(5)
    k, v, ks, vs = _cache(rng, "float8_e4m3fn", 100, 2, 16, "head")
    k_pages, v_pages, table = _paged(rng, k, v, [100], 16)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    call = dict(block_table=table, seqused_k=[100], k_scale=ks, v_scale=vs, backend="cpu")
    spare = sorted(set(range(k_pages.shape[0])) - set(table[0].tolist()))
    k_pages[spare[0]] = np.float32(np.nan)
    enp.varlen_attention(q, k_pages, v_pages, [0, 1], None, **call)
    assert np.isnan(k_pages[spare[0]].astype(np.float32)).all() and k_pages.dtype == ml_dtypes.float8_e4m3fn
    k_pages[table[0, 6], 3, 1, 5] = np.float32(np.nan)  # key 99, the last one used
    with pytest.raises(ValueError, match="NaN or inf"):
        enp.varlen_attention(q, k_pages, v_pages, [0, 1], None, **call)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("scale", ["head", "group"])
def test_the_torch_adapter_takes_a_quantized_packed_or_paged_cache(fmt, scale):
    """Its tensors' (float8 through a uint8 view) bits through `varlen_attention`; no gradient through them."""
    torch = pytest.importorskip("torch")
    import elastic_np.torch as enpt
    from elastic_np.torch import _arrays

    rng = np.random.default_rng(9)
    k, v, ks, vs = _cache(rng, fmt, 140, 2, 32, scale)
    cu_k, cu_q = np.array([0, 40, 140]), np.array([0, 1, 30])
    q = rng.standard_normal((30, 4, 32)).astype(np.float32)
    fine = scale != "head"
    packed = {"k_scale": ks[0] if fine else ks, "v_scale": vs[0] if fine else vs}
    tensors = [_arrays.from_numpy(np.ascontiguousarray(a)) for a in (q, k[0], v[0])]
    got = enpt.varlen_attention(*tensors, torch.from_numpy(cu_q), torch.from_numpy(cu_k), causal=True,
                                **{n: torch.from_numpy(a) for n, a in packed.items()})
    want = enp.varlen_attention(q, k[0], v[0], cu_q, cu_k, causal=True, backend="cpu", **packed)
    assert np.array_equal(got.numpy(), want)
    used = [40, 100]
    k_pages, v_pages, table = _paged(rng, k, v, used, 16)
    paged = {n: paged_cases.in_pages(a, table, used, 16, k_pages.shape[0]) if fine else a
             for n, a in (("k_scale", ks), ("v_scale", vs))}
    call = dict(block_table=table, seqused_k=used, causal=True)
    got = enpt.varlen_attention(*(_arrays.from_numpy(a) for a in (q, k_pages, v_pages)), torch.from_numpy(cu_q),
                                None, **{n: torch.from_numpy(np.asarray(x)) for n, x in {**call, **paged}.items()
                                         if n != "causal"}, causal=True)
    want = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, backend="cpu", **call, **paged)
    assert np.array_equal(got.numpy(), want)
    q_grad = tensors[0].clone().requires_grad_()
    out = enpt.varlen_attention(q_grad, *tensors[1:], torch.from_numpy(cu_q), torch.from_numpy(cu_k),
                                **{n: torch.from_numpy(a) for n, a in packed.items()})
    with pytest.raises(TypeError, match="no gradient through a quantized cache"):
        out.sum().backward()


def test_a_quantized_prefill_chunk_over_pages_reads_them_in_place():
    """No gathered copy of the bytes, no dequantized copy of the cache: a key tile at a time, in scratch."""
    rng = np.random.default_rng(6)
    k, v, ks, vs = _cache(rng, "int8", 4096, 8, 64, "head")
    k_pages, v_pages, table = _paged(rng, k, v, [4096], 16)
    q = rng.standard_normal((64, 16, 64)).astype(np.float32)
    call = dict(block_table=table, seqused_k=[4096], causal=True, k_scale=ks, v_scale=vs, backend="cpu")
    want = enp.attention(q[None], k, v, layout="bnhd", kv_lengths=[4096], align="kv_lengths",
                         backend="cpu", **{n: call[n] for n in ("causal", "k_scale", "v_scale")})
    enp.varlen_attention(q, k_pages, v_pages, [0, 64], None, **call)  # compiled before the peak is taken
    tracemalloc.start()
    got = enp.varlen_attention(q, k_pages, v_pages, [0, 64], None, **call)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert np.array_equal(got, want[0])
    assert peak < 1 << 20, peak  # the output alone is 0.25 MiB; a gathered copy would be 4 MiB
