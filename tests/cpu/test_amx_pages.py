"""A paged cache's prefill chunk on AMX tiles (`elastic_np.cpu._prefill.forward_amx` with ``paged``).

The keys are read from the pages in place (16 rows a tile, each tile's rows
in one page; else copied into the kernel's scratch), the values transposed
from the pages into the kernel's own copy: every chunk gets the bits of the
tiles over its gathered keys, with no gathered copy in the peak memory.
"""

import tracemalloc

import numpy as np
import pytest

import elastic_np as enp
import paged_cases
from elastic_np.cpu._prefill import forward_amx as _forward_amx
from elastic_np.cpu._tiles import amx as _amx

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)

pytestmark = pytest.mark.skipif(not (_amx.AVAILABLE and _amx.permitted()), reason="this CPU has no AMX tiles")


def _chunk(seed, N, M, block_size, H=4, Hkv=2, D=64, scale=1.0, v_scale=1.0):
    """``(q, k, v, k_pages, v_pages, table)``: ``q (N, H, D)``, the gathered ``(1, M, Hkv, D)`` keys and values,
    and the same in pages of ``block_size`` keys in shuffled order, the spare pages NaN."""
    rng = np.random.default_rng(seed)
    draw = lambda shape, s=1.0: (rng.standard_normal(shape) * s).astype(np.float32).astype(BF16)  # noqa: E731
    q, k, v = draw((N, H, D), scale), draw((1, M, Hkv, D), scale), draw((1, M, Hkv, D), v_scale)
    return q, k, v, *paged_cases.paged(rng, k, v, [M], block_size, fill=lambda pool: pool.fill(np.nan))


def _paged_on_the_tiles(monkeypatch):
    """The calls of `_forward_amx.forward` with ``paged``, recorded."""
    calls, forward = [], _forward_amx.forward
    monkeypatch.setattr(_forward_amx, "forward", lambda problem, paged=None, into=None:
                        calls.append(paged is not None) or forward(problem, paged=paged, into=into))
    return calls


def _both(q, k, v, k_pages, v_pages, table, **options):
    """``(paged, gathered)``: the chunk through `varlen_attention` over the pages, and `attention` on the keys."""
    N, M = q.shape[0], k.shape[1]
    paged = enp.varlen_attention(q, k_pages, v_pages, [0, N], None, block_table=table, seqused_k=[M],
                                 return_lse=True, backend="cpu", **options)
    gathered = enp.attention(q[None], k, v, layout="bnhd", kv_lengths=[M], align="kv_lengths", return_lse=True,
                             backend="cpu", **options)
    return paged, (gathered[0][0], gathered[1][0].T)


@pytest.mark.parametrize("block_size", [5, 16, 32, 128])
@pytest.mark.parametrize("options", [{"causal": True}, {"causal": True, "window_size": (70, 0), "beta": 0.5},
                                     {"softcap": 8.0, "tau": 0.7}], ids=["causal", "window", "softcap"])
def test_a_paged_chunk_on_the_tiles_has_the_bits_of_its_gathered_keys(monkeypatch, block_size, options):
    calls = _paged_on_the_tiles(monkeypatch)
    (out, lse), (want, want_lse) = _both(*_chunk(block_size, 100, 333, block_size), **options)
    assert calls == [True, False]  # the pages, then the gathered keys, both on the tiles
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))
    assert np.array_equal(lse, want_lse)


def test_tiny_values_in_pages_are_scaled_up_as_contiguous_ones(monkeypatch):
    calls = _paged_on_the_tiles(monkeypatch)
    (out, lse), (want, want_lse) = _both(*_chunk(3, 40, 200, 16, v_scale=2.0 ** -128), causal=True)
    assert calls == [True, False]
    assert np.abs(want.astype(np.float32)).max() > 0
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16)) and np.array_equal(lse, want_lse)


def test_an_overflowing_product_over_pages_takes_the_float32_products_over_them(monkeypatch):
    calls = _paged_on_the_tiles(monkeypatch)
    chunk = _chunk(4, 40, 60, 16, scale=1e19)
    (out, lse), (want, want_lse) = _both(*chunk, tau=1e30)
    assert calls == [True, False]
    assert np.isfinite(lse).all()
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16)) and np.array_equal(lse, want_lse)


def test_a_paged_chunk_on_the_tiles_gathers_no_copy_of_its_keys():
    q, k, v, k_pages, v_pages, table = _chunk(5, 256, 4096, 16, H=8, Hkv=4)
    call = dict(block_table=table, seqused_k=[4096], causal=True, backend="cpu")
    enp.varlen_attention(q, k_pages, v_pages, [0, 256], None, **call)  # compiled before the peak is taken
    tracemalloc.start()
    enp.varlen_attention(q, k_pages, v_pages, [0, 256], None, **call)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    transposed = 4 * 64 * (4096 + 96) * 2  # the values as the tiles read them, (Hkv, Dv, M rounded), bits
    # and the packed output the chunk writes into, the checks' slabs, its lse: the gathered keys and values
    # would be 4 MiB more
    assert peak < transposed + q.nbytes + (768 << 10) < transposed + k.nbytes + v.nbytes, (peak, transposed)
