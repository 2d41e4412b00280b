"""Read-only page pools (and dense keys) read in place (issue 71, item 6).

A read-only C-contiguous array is read where it lies, with the bits of the
same call on a writeable one, and nothing the caller passed changes.
"""

import os
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np

import elastic_np as enp


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


def test_dense_read_only_keys_are_not_copied():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 8, 64, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, 8, 4096, 64), dtype=np.float32) for _ in "kv")  # 8 MiB each
    enp.attention(q, k, v, causal=True, backend="cpu")  # compiled before the peaks are taken
    want, writeable_peak = _peak(lambda: enp.attention(q, k, v, causal=True, backend="cpu"))
    k_ro, v_ro = _read_only(k), _read_only(v)
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
