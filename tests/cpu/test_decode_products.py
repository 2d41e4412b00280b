"""The stacked-rows decode kernel's products (`elastic_np.cpu._decode.products`) and what rests on them.

The products read the cache where and as it is stored (float32, float64, or
the bits of bfloat16 and float16 widened in registers) and must give the
bits of the tile products (`elastic_np.cpu._tiles.products.matmul_nn` on the keys
transposed and converted): the backward recomputes the decode kernel's
logits with those. At the kernel's own tile sizes (not `test_decode`'s
small ones), whole ``W x W`` key blocks, the keys and entries past them,
pages and the ``(B, N, H, D)`` layout are all crossed; a NaN or inf in any
of them is found.
"""

import itertools
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from numba import njit

import elastic_np as enp
from elastic_np.cpu._decode import plan as _decode_plan, products as _decode_products
from elastic_np.cpu._runtime import config as _config
from elastic_np.cpu._tiles.halves import bits
from elastic_np.cpu._tiles.products import matmul_nn
from elastic_np.cpu._tiles.simd import compile_for

# (compute dtype, storage dtype)
STORAGE = [(np.float32, np.float32), (np.float64, np.float64), (np.float32, ml_dtypes.bfloat16),
           (np.float32, np.float16)]
STORAGE_IDS = ["float32", "float64", "bfloat16", "float16"]


@njit(fastmath={"contract"})
def _both_products(qs, keys, values, st, s_col, acc, sizes):
    k, k_col, v, v_col = keys[0], keys[1], values[0], values[1]
    rows, bk, D, Dv = sizes
    # hints: the keys 128 rows on, past the arrays' ends (a hint never faults)
    _decode_products.key_scores(qs, (k, k_col), (k, k_col, 128), st, s_col, rows, bk, D)
    _decode_products.value_products(st, s_col, (v, v_col), (v, v_col, 128), acc, rows, bk, Dv)


@pytest.mark.parametrize("dtype, storage", STORAGE, ids=STORAGE_IDS)
def test_the_bits_of_the_tile_products(dtype, storage):
    """``st`` is ``matmul_nn(qs, K^T)``'s and ``acc`` ``matmul_nn(st, V, acc, accumulate=True)``'s, bit for bit."""
    compile_for(dtype)
    rng = np.random.default_rng(0)
    width = _decode_products.key_block(np.dtype(dtype))
    sizes = [(rows, bk, D, Dv) for rows, bk, D, Dv in
             [(1, 1, 1, 1), (4, width, width, 4 * width), (4, 128, 128, 128), (5, 2 * width + 3, width + 5, 70),
              (9, 40, 3 * width, 2 * width - 1), (2, width - 1, 2 * width, 8 * width + 1), (13, 37, 24, 33),
              (3, 20, 2 * width + 1, 3 * width + 5), (6, 128, 128, 128), (7, 17, width, 9 * width - 3)]]
    rounded = _decode_products._QUERY_ROUND
    for (rows, bk, D, Dv), padded in itertools.product(sizes, (False, True)):
        k_col, v_col, s_col = (int(x) for x in rng.integers(0, 5, 3))
        qs = rng.standard_normal((rows, D)).astype(dtype)
        if padded:  # as the kernel's: a row's tail past its last whole chunk is a masked chunk (`_key_tail`)
            qs = np.concatenate([qs, np.zeros((rows, -(-D // rounded) * rounded - D), dtype)], axis=1)
        k = rng.standard_normal((bk, D + k_col + 3)).astype(storage)
        v = rng.standard_normal((bk, Dv + v_col + 2)).astype(storage)
        for a, first, n in ((k, k_col, D), (v, v_col, Dv)):  # what a product reads past its rows would show
            a[:, :first] = np.nan
            a[:, first + n:] = np.nan
        st = np.full((rows, s_col + bk + 3), 7.0, dtype)
        acc0 = rng.standard_normal((rows, Dv)).astype(dtype)
        acc = acc0.copy()
        _both_products(qs, (bits(k), k_col), (bits(v), v_col), st, s_col, acc, (rows, bk, D, Dv))
        keys_t = np.ascontiguousarray(k[:, k_col:k_col + D].astype(dtype).T)
        want_st = np.empty((rows, bk), dtype)
        matmul_nn(np.ascontiguousarray(qs[:, :D]), 0, keys_t, 0, want_st, rows, bk, D, False)
        want_acc = acc0.copy()
        matmul_nn(want_st, 0, np.ascontiguousarray(v[:, v_col:v_col + Dv].astype(dtype)), 0, want_acc, rows, Dv, bk,
                  True)
        assert np.array_equal(st[:, s_col:s_col + bk], want_st), (rows, bk, D, Dv, padded)
        assert (st[:, :s_col] == 7).all() and (st[:, s_col + bk:] == 7).all()  # nothing else written
        assert np.array_equal(acc, want_acc), (rows, bk, D, Dv)


def _cache(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("D", [128, 40])
def test_full_tiles_against_the_oracle_in_both_layouts(dtype, D):
    """The kernel's own tiles (128 keys, whole key blocks, a partial last tile); ``(B, N, H, D)`` gives the same bits."""
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(1)
    B, H, Hkv, M = 2, 8, 2, 700
    tol = {"float64": 1e-12, "float32": 2e-6}.get(dtype.name, 2e-2)
    for N, options in ((1, {}), (3, dict(causal=True, tau=0.8, beta=0.5, kv_lengths=[700, 333])),
                       (2, dict(window_size=(200, 0), causal=True, softcap=10.0))):
        q, k, v = _cache(rng, (B, H, N, D), dtype), _cache(rng, (B, Hkv, M, D), dtype), _cache(rng, (B, Hkv, M, D), dtype)
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **options)
        ref, ref_lse = enp.attention(*(a.astype(np.float64) for a in (q, k, v)), return_lse=True,
                                     backend="reference", **options)
        np.testing.assert_allclose(out.astype(np.float64), ref, atol=tol * 10, rtol=tol * 10)
        np.testing.assert_allclose(lse.astype(np.float64), ref_lse, atol=tol * 10, rtol=tol * 10)
        k_bnhd, v_bnhd = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for a in (k, v))
        out_bnhd, lse_bnhd = enp.attention(q, k_bnhd, v_bnhd, return_lse=True, backend="cpu", **options)
        assert np.array_equal(out_bnhd, out) and np.array_equal(lse_bnhd, lse)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["k", "v"])
def test_a_non_finite_entry_anywhere_in_full_tiles_is_found(dtype, name):
    """In a whole key block, a key or entry past the last one, a key no row keeps, a tile no row keeps."""
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(2)
    B, H, Hkv, M, D = 1, 4, 1, 600, 40  # tiles of 128 keys; D = 40: two whole blocks of 16 entries and 8 past them
    q, k, v = _cache(rng, (B, H, 1, D), dtype), _cache(rng, (B, Hkv, M, D), dtype), _cache(rng, (B, Hkv, M, D), dtype)
    mask = np.ones((B, 1, 1, M), bool)
    mask[..., 128:256] = False  # no row keeps a key of the second tile: its values are not multiplied
    option_sets = [dict(), dict(window_size=(300, 0), causal=True), dict(mask=mask)]  # keys 0 .. 298 out of the window
    for options in option_sets:
        enp.attention(q, k, v, backend="cpu", **options)
    for j, d in ((130, 3), (16 * 9 + 5, 39), (599, 0), (511, 20), (5, 7), (200, 17)):
        for value in (np.nan, np.inf, -np.inf):
            bad = {"k": k.copy(), "v": v.copy()}
            bad[name][0, 0, j, d] = value
            for options in option_sets:
                with pytest.raises(ValueError, match=f"`{name}` contains NaN or inf"):
                    enp.attention(q, bad["k"], bad["v"], backend="cpu", **options)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 48, 128, 200])
@pytest.mark.parametrize("hint_keys", [0, 40, 128])
def test_paged_decoding_gives_the_contiguous_bits_whatever_the_hints(monkeypatch, dtype, block_size, hint_keys):
    """Pages of any size, read head by head (float32) or run by run (bfloat16), hints of any distance: the gathered
    cache's bits (`elastic_np.cpu._decode.plan.tile_reads`; runs of 24 keys here, within pages of 16 and 48 and across
    tiles of 128)."""
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    for name in ("DECODE_HINT_KEYS", "DECODE_RUN_HINT_KEYS"):
        monkeypatch.setattr(_config, name, hint_keys)
    monkeypatch.setattr(_config, "DECODE_RUN_KEYS", 24)
    half = dtype.itemsize == 2
    ahead, by_run, run_keys = _decode_plan.tile_reads(True, half, block_size, 128)
    assert by_run == half and run_keys == (min(24, block_size) if half else min(128, block_size))
    assert ahead >= hint_keys and ahead % (run_keys if half else block_size) == 0
    rng = np.random.default_rng(3)
    used, Hkv, D = 1000, 2, 64
    blocks = -(-used // block_size)
    table = rng.permutation(blocks + 2)[None, :blocks]
    k_pages, v_pages = (_cache(rng, (blocks + 2, block_size, Hkv, D), dtype) for _ in "kv")
    q = _cache(rng, (1, 8, D), dtype)
    out = enp.varlen_attention(q, k_pages, v_pages, [0, 1], None, block_table=table, seqused_k=[used],
                               causal=True, backend="cpu")
    k, v = (a[table[0]].reshape(-1, Hkv, D)[None, :used] for a in (k_pages, v_pages))
    want = enp.attention(q[None], k, v, layout="bnhd", causal=True, backend="cpu")
    assert np.array_equal(out.view(np.uint8), want[0].view(np.uint8))
    if half:  # the (B, N, H, D) cache is read run by run too: the (B, H, N, D) one's bits
        want_bhnd = enp.attention(q[None].transpose(0, 2, 1, 3), *(a.transpose(0, 2, 1, 3) for a in (k, v)),
                                  causal=True, backend="cpu")
        assert np.array_equal(out[0].view(np.uint8), want_bhnd[0, :, 0].view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_a_kv_head_that_keeps_no_key_has_its_values_checked_in_either_order(dtype, block_size):
    """NVM removes every key of kv head 0 (its scores are all negative), not of head 1: pages read head by head
    (float32) or run by run (bfloat16) give the gathered cache's bits, and a NaN in head 0's values is still found."""
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(4)
    used, Hkv, D = 600, 2, 32
    blocks = -(-used // block_size)
    table = rng.permutation(blocks + 1)[None, :blocks]
    k_pages, v_pages = (_cache(rng, (blocks + 1, block_size, Hkv, D), dtype) for _ in "kv")
    k_pages[:, :, 0] = np.abs(k_pages[:, :, 0])
    q = _cache(rng, (1, 4, D), dtype)
    q[:, :2] = -np.abs(q[:, :2])  # the query heads of kv head 0: every score below 0
    k, v = (a[table[0]].reshape(-1, Hkv, D)[None, :used] for a in (k_pages, v_pages))
    out = enp.varlen_attention(q, k_pages, v_pages, [0, 1], None, block_table=table, seqused_k=[used], nvm=True,
                               beta=0.5, backend="cpu")
    want = enp.attention(q[None], k, v, layout="bnhd", nvm=True, beta=0.5, backend="cpu")
    assert np.array_equal(out.view(np.uint8), want[0].view(np.uint8)) and not out[0, :2].any() and out[0, 2:].all()
    v_pages[table[0, 1], 3, 0, 5] = np.nan
    with pytest.raises(ValueError, match="`v` contains NaN or inf"):
        enp.varlen_attention(q, k_pages, v_pages, [0, 1], None, block_table=table, seqused_k=[used], nvm=True,
                             backend="cpu")


_GUARDED = """
import ctypes, mmap, sys
import ml_dtypes, numpy as np
import elastic_np as enp

def before_a_guard_page(a):
    '''A copy of ``a`` whose last byte ends a page that a page no read may touch follows.'''
    page = mmap.PAGESIZE
    total = -(-a.nbytes // page) * page + page
    buf = mmap.mmap(-1, total, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    out = np.frombuffer(buf, np.uint8, a.nbytes, total - page - a.nbytes).view(a.dtype).reshape(a.shape)
    out[...] = a
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(start + total - page, page, 0) == 0
    return out

dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[sys.argv[1]]
D, M = int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal(s).astype(np.float32).astype(dtype) for s in ((1, 4, 1, D), (1, 1, M, D), (1, 1, M, D)))
want = enp.attention(q, k, v, backend="cpu")
got = enp.attention(q, before_a_guard_page(k), before_a_guard_page(v), backend="cpu")
assert np.array_equal(got, want)
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect of an anonymous map")
@pytest.mark.parametrize("dtype, D", [("float32", 40), ("bfloat16", 40), ("float16", 49), ("bfloat16", 80)])
def test_the_last_rows_tail_is_read_to_its_end_and_no_further(dtype, D):
    """A row's tail past its last whole chunk is a masked load: a cache that ends at a page that faults is fine."""
    for M in (256, 300):  # the last key in a whole block of 16 (its tail a masked chunk), and one past them
        result = subprocess.run([sys.executable, "-c", _GUARDED, dtype, str(D), str(M)], capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0 and result.stdout.strip() == "ok", (M, result.returncode, result.stderr[-2000:])
