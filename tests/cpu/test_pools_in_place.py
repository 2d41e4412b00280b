"""Page pools (and dense keys) read in place whatever their strides or write flag (issue 71, item 6).

A read-only C-contiguous array is read where it lies; a pool whose layout
the decode kernel cannot read has only the pages the call reads copied.
Either way the result has the bits of the same call on C-contiguous,
writeable pools, and nothing the caller passed changes.
"""

import math
import os
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import elastic_np as enp
from elastic_np.cpu._runtime import config as cpu_config

FUZZ = settings(max_examples=30, deadline=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow])


def _peak(call):
    """``(result, peak bytes NumPy allocated during call())``."""
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _with_layout(pool, layout, rng):
    """An array equal to C-contiguous ``pool`` laid out as ``layout`` says."""
    if layout == "read-only":
        return _read_only(pool)
    if layout == "every other page":
        wider = rng.standard_normal((2 * pool.shape[0], *pool.shape[1:])).astype(pool.dtype)
        wider[::2] = pool
        return wider[::2]
    if layout == "read-only, every other page":
        strided = _with_layout(pool, "every other page", rng)
        strided.flags.writeable = False
        return strided
    if layout == "pages reversed":
        return np.ascontiguousarray(pool[::-1])[::-1]
    if layout == "fortran":
        return np.asfortranarray(pool)
    if layout == "per head":  # vLLM's CPU page order, (num_blocks, Hkv, block_size, D), in our axes' order
        return np.ascontiguousarray(pool.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if layout == "some heads of a wider pool":
        return np.concatenate([pool, rng.standard_normal(pool.shape).astype(pool.dtype)], axis=2)[:, :, :pool.shape[2]]
    raise AssertionError(layout)


LAYOUTS = ["read-only", "every other page", "read-only, every other page", "pages reversed", "fortran",
           "some heads of a wider pool", "per head"]


@FUZZ
@given(seed=st.integers(0, 2**16), k_layout=st.sampled_from(LAYOUTS + ["C"]), v_layout=st.sampled_from(LAYOUTS),
       block_size=st.sampled_from([1, 3, 16]), lengths=st.lists(st.integers(0, 40), min_size=1, max_size=3),
       queries=st.sampled_from([1, 16]), dtype=st.sampled_from([np.float32, np.float64]))
def test_pools_of_any_layout_give_the_bits_of_contiguous_ones(seed, k_layout, v_layout, block_size, lengths,
                                                              queries, dtype):
    rng = np.random.default_rng(seed)
    used = np.array(lengths) + queries  # a sequence's queries are among its keys
    blocks = -(-used // block_size)
    num_blocks = int(blocks.sum()) + 2
    order = rng.permutation(num_blocks)
    table = np.zeros((used.size, max(int(blocks.max()), 1)), np.int64)
    for s, start in enumerate(np.cumsum(blocks) - blocks):
        table[s, :blocks[s]] = order[start:start + blocks[s]]
    k, v = (rng.standard_normal((num_blocks, block_size, 2, 8)).astype(dtype) for _ in "kv")
    q = rng.standard_normal((queries * used.size, 4, 8)).astype(dtype)
    cu_q = np.arange(used.size + 1) * queries
    call = dict(block_table=table, seqused_k=used, return_lse=True, backend="cpu", causal=True, softcap=20.0)
    want = enp.varlen_attention(q, k, v, cu_q, None, **call)
    k_given = k if k_layout == "C" else _with_layout(k, k_layout, rng)
    v_given = _with_layout(v, v_layout, rng)
    before = [(a.copy(), a.strides, a.flags.writeable) for a in (k_given, v_given)]
    got = enp.varlen_attention(q, k_given, v_given, cu_q, None, **call)
    for a, b in zip(got, want):
        assert np.array_equal(a, b)
    for a, (values, strides, writeable) in zip((k_given, v_given), before):
        assert np.array_equal(a, values) and a.strides == strides and a.flags.writeable == writeable


def _pools(rng, num_blocks=1024, block_size=16, Hkv=8, D=64):
    """Two float32 pools of 32 MiB each, and a table of two sequences reading 32 pages each (4 MiB in all)."""
    k, v = (rng.standard_normal((num_blocks, block_size, Hkv, D), dtype=np.float32) for _ in "kv")
    table = rng.permutation(num_blocks)[:64].reshape(2, 32)
    return k, v, table, np.array([32 * block_size] * 2), rng.standard_normal((2, 4 * Hkv, D), dtype=np.float32)


def test_a_read_only_pool_is_not_copied():
    rng = np.random.default_rng(1)
    k, v, table, used, q = _pools(rng)
    want = enp.varlen_attention(q, k, v, [0, 1, 2], None, block_table=table, seqused_k=used, backend="cpu")
    k_ro, v_ro = _read_only(k), _read_only(v)
    got, peak = _peak(lambda: enp.varlen_attention(q, k_ro, v_ro, [0, 1, 2], None, block_table=table,
                                                   seqused_k=used, backend="cpu"))
    assert np.array_equal(got, want)
    assert peak < 1 << 20, peak  # the pools are 64 MiB, the pages read 4 MiB


@pytest.mark.parametrize("queries", [1, 40], ids=["decode", "prefill chunk"])
def test_a_pool_stored_per_head_is_read_in_place(queries, monkeypatch):
    """Pages stored ``(num_blocks, Hkv, block_size, D)`` (vLLM's CPU order), given in our axes' order as a view.

    On the calling thread alone: the pool's workers keep scratch of their own, which a worker that took no
    task in a warm-up call would make during the measured one (the two layouts' peaks then differ by it).
    """
    monkeypatch.setattr(cpu_config, "SERIAL_WORK", math.inf)
    rng = np.random.default_rng(5)
    k, v, table, used, _ = _pools(rng)
    q = rng.standard_normal((2 * queries, 32, 64), dtype=np.float32)
    cu_q = [0, queries, 2 * queries]
    call = dict(block_table=table, seqused_k=used, causal=True, backend="cpu")
    enp.varlen_attention(q, k, v, cu_q, None, **call)  # compiled, planned before the peaks are taken
    want, contiguous_peak = _peak(lambda: enp.varlen_attention(q, k, v, cu_q, None, **call))
    k_h, v_h = (_read_only(np.ascontiguousarray(a.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3) for a in (k, v))
    enp.varlen_attention(q, k_h, v_h, cu_q, None, **call)
    got, peak = _peak(lambda: enp.varlen_attention(q, k_h, v_h, cu_q, None, **call))
    assert np.array_equal(got, want)
    assert peak < contiguous_peak + (64 << 10), (peak, contiguous_peak)  # the pages read are 4 MiB


def test_a_strided_pool_copies_only_the_pages_it_reads():
    rng = np.random.default_rng(2)
    k, v, table, used, q = _pools(rng)
    want = enp.varlen_attention(q, k, v, [0, 1, 2], None, block_table=table, seqused_k=used, backend="cpu")
    wider = [np.concatenate([a, a], axis=2) for a in (k, v)]
    k_s, v_s = (a[:, :, :8] for a in wider)
    got, peak = _peak(lambda: enp.varlen_attention(q, k_s, v_s, [0, 1, 2], None, block_table=table,
                                                   seqused_k=used, backend="cpu"))
    assert np.array_equal(got, want)
    read = 2 * 64 * k[0].nbytes  # k's and v's pages read: 4 MiB
    assert read <= peak < read + (1 << 20), (peak, read)


def test_a_zero_strided_pool_of_ten_million_pages():
    rng = np.random.default_rng(3)
    page = rng.standard_normal((1, 16, 1, 64), dtype=np.float32)
    pool = np.broadcast_to(page, (10**7, 16, 1, 64))  # 38 GiB as a C-contiguous array
    q = rng.standard_normal((1, 2, 64), dtype=np.float32)
    got = enp.varlen_attention(q, pool, pool, [0, 1], None, block_table=[[123456, 10**7 - 1]], seqused_k=[20],
                               backend="cpu")
    two = np.concatenate([page, page])
    assert np.array_equal(got, enp.varlen_attention(q, two, two, [0, 1], None, block_table=[[0, 1]],
                                                    seqused_k=[20], backend="cpu"))


def test_dense_read_only_keys_are_not_copied():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 8, 64, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, 8, 4096, 64), dtype=np.float32) for _ in "kv")  # 8 MiB each
    enp.attention(q, k, v, causal=True, backend="cpu")  # compiled before the peaks are taken
    want, writeable_peak = _peak(lambda: enp.attention(q, k, v, causal=True, backend="cpu"))
    k_ro, v_ro = _read_only(k), _read_only(v)
    enp.attention(q, k_ro, v_ro, causal=True, backend="cpu")  # its plan made before the peak is taken, as above
    got, peak = _peak(lambda: enp.attention(q, k_ro, v_ro, causal=True, backend="cpu"))
    assert np.array_equal(got, want)
    assert peak < min(writeable_peak + (64 << 10), k.nbytes / 2), (peak, writeable_peak)  # the finite check's bools


CHILD = """
import sys
import numpy as np
import elastic_np as enp

folder = sys.argv[1]
k, v = (np.load(f"{folder}/{name}.npy", mmap_mode="r") for name in "kv")  # mapped read-only: a write faults
q, table = np.load(f"{folder}/q.npy"), np.load(f"{folder}/table.npy")
assert not k.flags.writeable
out = enp.varlen_attention(q, k, v, [0, 1, 2], None, block_table=table, seqused_k=[40, 7], causal=True,
                           backend="cpu")
dense = [a.reshape(1, -1, *a.shape[2:]) for a in (k, v)]
out_dense, lse = enp.attention(q[None], *dense, layout="bnhd", return_lse=True, backend="cpu")
for a in (out_dense, lse):
    a.flags.writeable = False
grads = enp.attention_backward(out_dense, q[None], *dense, out_dense, lse, layout="bnhd", backend="cpu")
np.savez(f"{folder}/got.npz", out=out, out_dense=out_dense, dk=grads.dk)
"""


def test_read_only_mappings_are_read_never_written(tmp_path):
    """Pools mapped from files read-only (a write would kill the process) give the bits of writeable ones.

    The dense forward and backward too, with ``out`` and ``lse`` read-only.
    """
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((6, 16, 2, 8), dtype=np.float32) for _ in "kv")
    q, table = rng.standard_normal((2, 4, 8), dtype=np.float32), np.array([[5, 0, 3], [1, 2, 4]])
    for name, a in (("k", k), ("v", v), ("q", q), ("table", table)):
        np.save(tmp_path / f"{name}.npy", a)
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path)], capture_output=True,
                           text=True, timeout=300, env=os.environ.copy())
    assert child.returncode == 0, child.stderr[-2000:]
    got = np.load(tmp_path / "got.npz")
    want = enp.varlen_attention(q, k, v, [0, 1, 2], None, block_table=table, seqused_k=[40, 7], causal=True,
                                backend="cpu")
    dense = [a.reshape(1, -1, *a.shape[2:]) for a in (k, v)]
    assert np.array_equal(got["out"], want)
    out_dense, lse = enp.attention(q[None], *dense, layout="bnhd", return_lse=True, backend="cpu")
    assert np.array_equal(got["out_dense"], out_dense)
    grads = enp.attention_backward(out_dense, q[None], *dense, out_dense, lse, layout="bnhd", backend="cpu")
    assert np.array_equal(got["dk"], grads.dk)
