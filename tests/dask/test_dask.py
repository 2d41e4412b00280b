"""elastic_np.dask: chunked attention, forward and backward, against the float64 oracle.

Every case cuts the problem into blocks along batch, heads (through the
grouped-query groups), queries and keys, on the CPU kernels; float64 must
agree with `elastic_np.reference` to ``1e-12 * max(1, max|oracle|)``, float32
by the float32 rule of the kernel tests (`oracle_checks.check_results`).
The result must not depend on the scheduler: threads, processes and a
`distributed.LocalCluster` of two worker processes give the same bits.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import elastic_np as enp  # noqa: E402
import elastic_np.dask as enpd  # noqa: E402
from elastic_np import cpu, reference
from elastic_np._api import dispatch
from elastic_np.dask import _blocks  # noqa: E402
from oracle_checks import check_results, make_dlse, make_inputs  # noqa: E402

B, H, HKV, D, DV = 2, 4, 2, 5, 3
FIELDS = ("dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias")


def _inputs(dtype, N, M, seed=0):
    return make_inputs(dtype, B=B, H=H, Hkv=HKV, N=N, M=M, D=D, Dv=DV, seed=seed)


def _cases(N, M):
    rng = np.random.default_rng(1)
    return {
        "plain": {},
        "causal": dict(causal=True),
        "window": dict(window_size=(3, 2)),
        "causal_window": dict(causal=True, window_size=(4, 0)),
        "kv_lengths": dict(kv_lengths=[M - 6, M], causal=True),
        "kv_lengths_aligned": dict(kv_lengths=[M - 7, M - 2], align="kv_lengths", causal=True),
        "mask_nvm_tau_beta": dict(mask=rng.random((H, N, M)) > 0.3, nvm=True,
                                  tau=np.array([0.5, 1.0, 2.0, 0.7]), beta=np.array([0.0, 0.5, 1.0, 2.0])),
        "dynamic_window": dict(dynamic_window=enp.DynamicWindow(np.array([0.2, 0.3, 0.5, 1.0]), 4.0, 0.05),
                               causal=True, beta=0.5),
        "dynamic_window_aligned": dict(dynamic_window=enp.DynamicWindow(0.3, 2.0, 0.0),
                                       kv_lengths=[M - 5, M], align="kv_lengths"),
        "alibi_softcap": dict(alibi_slopes=2.0 ** -np.arange(1, H + 1), softcap=2.0, window_size=(5, -1)),
        "bias_4d": dict(bias=rng.standard_normal((B, H, N, M)), causal=True, tau=0.8),
        "bias_broadcast": dict(bias=np.where(rng.random((1, H, 1, M)) > 0.2, rng.standard_normal((1, H, 1, M)),
                                             -np.inf), beta=1.0),
        "bias_2d_alibi": dict(bias=rng.standard_normal((N, M)), alibi_slopes=np.full((B, H), 0.3), nvm=True),
    }


# (N, M, q chunks (batch, heads, rows), key chunk): heads by 3 cut the groups of 2;
# rows and keys in uneven pieces cut the causal diagonal and the windows.
# Key chunks much longer than query chunks make some shifted blocks append queries; heads by 2
# keep whole groups.
CHUNKINGS = {
    "N<M": (13, 17, (1, 3, 4), 5),
    "N>M": (19, 11, (2, 1, 6), 4),
    "long_keys": (13, 17, (2, 2, 3), 8),
}


def _run(q, k, v, dout, opts, q_chunks, k_chunk, scheduler="sync", dlse=None, **kw):
    qd = da.from_array(q, chunks=q_chunks + (D,))
    kd = da.from_array(k, chunks=(1, 1, k_chunk, D))
    out, lse = enpd.attention(qd, kd, v, return_lse=True, backend="cpu", **opts, **kw)
    grads = enpd.attention_backward(dout, qd, kd, v, out, lse, dlse=dlse, backend="cpu", **opts, **kw)
    out, lse = da.compute(out, lse, scheduler=scheduler)
    return out, lse, enpd.compute_grads(grads, scheduler=scheduler)


def _check(dtype, opts, chunking, with_lse=False):
    N, M, q_chunks, k_chunk = chunking
    q, k, v, dout = _inputs(dtype, N, M)
    dlse = make_dlse(dtype, q) if with_lse else None
    out, lse, grads = _run(q, k, v, dout, opts, q_chunks, k_chunk, dlse=dlse)
    check_results(dtype, q, k, v, dout, opts, out, lse, grads, dlse=dlse,
                  rounding=_partials_rounding(q, k, v, dout, opts, dlse, q_chunks[2]) if dtype == np.float32 else None)


def _partials_rounding(q, k, v, dout, opts, dlse, rows):
    """The rounding allowance of ``dk`` and ``dv`` summed from float32 partials, one per query chunk and head.

    Each block returns its share of ``dk`` and ``dv`` rounded to float32, after
    a float32 accumulation of its own: the sum of the shares is then within
    about ``eps * sum_c |share_c|`` of the exact sum on top of the kernel's own
    error, more than one rounding of the result where the shares cancel. The
    shares are the oracle's gradients of each chunk's rows alone (``dk`` and
    ``dv`` are sums of terms of one row each), split by head too: finer than
    the blocks, so the allowance errs high, by at most the head count.
    Returns ``{"dk": a, "dv": a}``, ``a = 2 eps max_j sum_c |share_c[j]|``.
    """
    totals = {"dk": 0.0, "dv": 0.0}
    q64, k64, v64, dout64 = (a.astype(np.float64) for a in (q, k, v, dout))
    out, lse = reference.attention(q64, k64, v64, **opts)
    for h in range(q.shape[1]):
        for i0 in range(0, q.shape[2], rows):
            keep = np.zeros(q.shape[:3])
            keep[:, h, i0:i0 + rows] = 1.0
            share = reference.attention_backward(dout64 * keep[..., None], q64, k64, v64, out, lse,
                                                 dlse=None if dlse is None else dlse * keep, **opts)
            totals = {name: totals[name] + np.abs(getattr(share, name)) for name in totals}
    eps = float(np.finfo(np.float32).eps)
    return {name: 2 * eps * float(np.max(total)) for name, total in totals.items()}


@pytest.mark.parametrize("chunking", list(CHUNKINGS), ids=list(CHUNKINGS))
@pytest.mark.parametrize("case", list(_cases(1, 2)))
def test_float64_agrees_with_the_oracle(case, chunking):
    N, M = CHUNKINGS[chunking][:2]
    _check(np.float64, _cases(N, M)[case], CHUNKINGS[chunking])


@pytest.mark.parametrize("case", ["causal_window", "dynamic_window", "bias_broadcast", "kv_lengths_aligned"])
def test_float32_within_the_float32_rule(case):
    chunking = CHUNKINGS["N<M"]
    _check(np.float32, _cases(*chunking[:2])[case], chunking)


@pytest.mark.parametrize("with_lse", [False, True])
def test_rows_and_batches_with_nothing_kept(with_lse):
    """A batch with no keys, rows a mask empties, chunks a window removes: zeros, lse = log(beta)."""
    N, M = 13, 17
    mask = np.ones((N, M), dtype=bool)
    mask[:5] = False
    opts = dict(kv_lengths=[0, M], mask=mask, window_size=(1, 0), causal=True, beta=np.array([0.0, 1.0, 0.0, 2.0]))
    _check(np.float64, opts, (N, M, (1, 2, 4), 3), with_lse=with_lse)


@pytest.mark.parametrize("chunking", list(CHUNKINGS), ids=list(CHUNKINGS))
@pytest.mark.parametrize("case", ["plain", "kv_lengths_aligned", "mask_nvm_tau_beta", "dynamic_window",
                                  "alibi_softcap", "bias_broadcast"])
def test_lse_gradient_agrees_with_the_oracle(case, chunking):
    N, M = CHUNKINGS[chunking][:2]
    _check(np.float64, _cases(N, M)[case], CHUNKINGS[chunking], with_lse=True)


def test_lse_gradient_float32_and_chunked_dlse():
    chunking = CHUNKINGS["N<M"]
    opts = _cases(*chunking[:2])["mask_nvm_tau_beta"]
    q, k, v, dout = _inputs(np.float32, *chunking[:2])
    dlse = make_dlse(np.float32, q)
    out, lse, grads = _run(q, k, v, dout, opts, *chunking[2:], dlse=da.from_array(dlse, chunks=(2, 1, 5)))
    check_results(np.float32, q, k, v, dout, opts, out, lse, grads, dlse=dlse,
                  rounding=_partials_rounding(q, k, v, dout, opts, dlse, chunking[2][2]))


def test_no_dlse_is_zero_dlse_bit_for_bit():
    N, M, q_chunks, k_chunk = CHUNKINGS["N>M"]
    opts = _cases(N, M)["mask_nvm_tau_beta"]
    q, k, v, dout = _inputs(np.float32, N, M)
    none = _run(q, k, v, dout, opts, q_chunks, k_chunk)[2]
    zeros = _run(q, k, v, dout, opts, q_chunks, k_chunk, dlse=np.zeros(q.shape[:3], np.float32))[2]
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(none, field), getattr(zeros, field), err_msg=field)


@pytest.mark.parametrize("M, key_chunk", [(9, 1), (1, 1)])
def test_dynamic_window_over_single_key_chunks(M, key_chunk):
    """Chunks of one key (the block's own position needs a second key), and M = 1 (x = 0 everywhere)."""
    opts = dict(dynamic_window=enp.DynamicWindow(np.array([0.3, 0.5, 0.8, 1.0]), 3.0, 0.01), causal=True,
                alibi_slopes=np.full(H, 0.25))
    _check(np.float64, opts, (6, M, (1, 2, 4), key_chunk))


@pytest.mark.parametrize("beta", [0.0, np.zeros(2)])  # shared by the heads, and per head
def test_dbeta_of_overflowing_rows_in_different_chunks_is_an_infinity(beta):
    """exp(-lse) overflows in rows of both signs of delta, in different row and head chunks."""
    q = np.array([10.0, -13.0, 60.0, 10.0, -53.0, 36.0]).reshape(1, 2, 3, 1)
    k = np.array([130.0, 95.0]).reshape(1, 2, 1, 1)
    v = np.array([-0.7, -1.3]).reshape(1, 2, 1, 1)
    dout = np.array([-0.6, 0.04, -2.3, -0.2, -1.2, -0.7]).reshape(1, 2, 3, 1)
    qd = da.from_array(q, chunks=(1, 1, 1, 1))
    out, lse = enpd.attention(qd, k, v, scale=1.0, beta=beta, return_lse=True, backend="cpu")
    grads = enpd.compute_grads(enpd.attention_backward(dout, qd, k, v, out, lse, scale=1.0, beta=beta,
                                                       backend="cpu"), scheduler="sync")
    want = enp.attention_backward(dout, q, k, v, *enp.attention(q, k, v, scale=1.0, beta=beta, return_lse=True),
                                  scale=1.0, beta=beta, backend="reference")
    np.testing.assert_array_equal(grads.dbeta, want.dbeta)
    assert np.isneginf(grads.dbeta).any()


def test_pairs_that_keep_nothing_are_no_tasks():
    """Causal over 4 x 4 chunks of 8: 10 partial tasks, not 16; a window of 0 leaves the 4 diagonal ones."""
    q = da.zeros((1, 1, 32, 4), chunks=(1, 1, 8, 4))

    def partials(**opts):
        out = enpd.attention(q, q, q, backend="reference", **opts)
        return sum(1 for key in out.__dask_graph__() if key[0].startswith("enp-partial"))

    assert partials() == 16
    assert partials(causal=True) == 10
    assert partials(causal=True, window_size=(0, 0)) == 4
    assert partials(kv_lengths=[8]) == 4


def test_merge_tree_is_fixed_and_beta_is_added_once():
    """Five key chunks: a binary tree over them in order, the same bits on every run; beta once."""
    q, k, v, _ = _inputs(np.float64, 9, 25)
    qd, kd = da.from_array(q, chunks=(2, 4, 9, D)), da.from_array(k, chunks=(2, 2, 5, D))
    runs = [enpd.attention(qd, kd, v, beta=3.0, backend="cpu").compute(scheduler="threads") for _ in range(3)]
    for run in runs[1:]:
        np.testing.assert_array_equal(run, runs[0])
    want = reference.attention(q, k, v, beta=3.0)[0]
    np.testing.assert_allclose(runs[0], want, rtol=0, atol=1e-13)


def test_bad_options_raise_before_any_task():
    q = da.zeros((1, 2, 4, 3), chunks=2)
    with pytest.raises(ValueError, match="window_size"):
        enpd.attention(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="multiple"):
        enpd.attention(q, q[:, :1].repeat(3, axis=1), q[:, :1].repeat(3, axis=1))
    with pytest.raises(TypeError, match="float32, float64, bfloat16, float16"):
        enpd.attention(q.astype(np.longdouble), q, q)
    with pytest.raises(ValueError, match="threads_per_task"):
        enpd.attention(q, q, q, threads_per_task=0)
    with pytest.raises(ValueError, match="`lse` must have shape"):
        enpd.attention_backward(q, q, q, q, q, q, backend="reference")
    with pytest.raises(ValueError, match="`dlse` must have shape"):
        enpd.attention_backward(q, q, q, q, q, q[..., 0], dlse=q, backend="reference")


def test_nan_in_a_chunk_raises_when_computed():
    q = np.ones((1, 1, 4, 2))
    k = q.copy()
    k[0, 0, 3, 1] = np.nan
    out = enpd.attention(q, da.from_array(k, chunks=(1, 1, 2, 2)), q, backend="cpu")
    with pytest.raises(ValueError, match="`k` contains NaN"):
        out.compute(scheduler="sync")


def test_import_elastic_np_does_not_import_dask():
    code = "import sys, elastic_np; elastic_np.attention; assert 'dask' not in sys.modules, 'dask imported'"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(enp.__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def _counting_threads(attention, seen):
    """``attention`` that appends to ``seen`` the thread count its kernels get (`cpu.thread_count`)
    on the calling thread; small calls then run on one of them (`SERIAL_WORK`), larger ones on all."""

    def counted(*args, **kwargs):
        seen.append(cpu.thread_count())
        return attention(*args, **kwargs)

    return counted


def test_kernel_threads_follow_threads_per_task(monkeypatch):
    """Each block task sets its own thread's Numba count; the caller's count is left as it was."""
    import numba

    seen = []
    monkeypatch.setattr(dispatch, "attention", _counting_threads(dispatch.attention, seen))
    before = numba.get_num_threads()
    q, k, v, _ = _inputs(np.float32, 16, 16)
    qd = da.from_array(q, chunks=(1, 2, 8, D))
    for threads in (1, 2):
        seen.clear()
        enpd.attention(qd, k, v, threads_per_task=threads).compute(scheduler="threads")
        assert seen and set(seen) == {min(threads, numba.config.NUMBA_NUM_THREADS)}
    assert numba.get_num_threads() == before


# ---------------------------------------------------------------------------
# Schedulers: one LocalCluster of two worker processes for the module
# ---------------------------------------------------------------------------

#: Per worker; the K and V of `test_keys_larger_than_a_worker_memory_limit` exceed it.
WORKER_MEMORY = 600 * 2**20


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit=WORKER_MEMORY,
                                  dashboard_address=None, silence_logs=40) as cluster:
        with distributed.Client(cluster) as c:
            yield c


def _scheduler_case():
    N, M = 24, 29
    q, k, v, dout = _inputs(np.float32, N, M, seed=3)
    opts = dict(causal=True, window_size=(9, 2), alibi_slopes=np.full(H, 0.2), beta=0.5,
                dynamic_window=enp.DynamicWindow(0.6, 3.0, 0.01), bias=np.ones((1, H, 1, M)) * 0.1)
    return (q, k, v, dout, opts, (1, 3, 7), 6)


def _bits(result):
    out, lse, grads = result
    return [out, lse] + [np.asarray(getattr(grads, f)) for f in FIELDS if getattr(grads, f) is not None]


def test_same_bits_on_every_scheduler(client):
    case = _scheduler_case()
    want = _bits(_run(*case, scheduler="sync"))
    for got in (_run(*case, scheduler="threads"), _run(*case, scheduler="processes"), _run_on(client, *case)):
        for a, b in zip(_bits(got), want):
            np.testing.assert_array_equal(a, b)


def _run_on(client, q, k, v, dout, opts, q_chunks, k_chunk):
    qd = da.from_array(q, chunks=q_chunks + (D,))
    kd = da.from_array(k, chunks=(1, 1, k_chunk, D))
    out, lse = enpd.attention(qd, kd, v, return_lse=True, **opts)
    grads = enpd.attention_backward(dout, qd, kd, v, out, lse, **opts)
    out, lse = client.compute([out, lse], sync=True)
    return out, lse, enpd.compute_grads(grads)  # the client is the default scheduler


def _kernel_threads_in_worker():
    """In a worker: the thread count the CPU kernels see inside a block task."""
    seen = []
    original = dispatch.attention
    dispatch.attention = _counting_threads(original, seen)
    try:
        q = np.ones((1, 2, 64, 8), np.float32)
        spec = enpd._setup(q, q, q, dict(scale=None, causal=False, window_size=(-1, -1), kv_lengths=None,
                                         align="array", mask=None, nvm=False, tau=1.0, beta=0.0,
                                         dynamic_window=None, softcap=None, alibi_slopes=None, bias=None),
                           "cpu", 1).spec
        _blocks.forward_block(spec, (0, 1, 0, 2, 0, 64, 0, 64), q, q, q, None, None, 0)
    finally:
        dispatch.attention = original
    import numba

    return seen, numba.config.NUMBA_NUM_THREADS


def test_worker_kernels_run_on_one_thread(client):
    """A block task on each worker's task thread: its kernels see one thread, whatever Numba's default."""
    for worker in client.scheduler_info()["workers"]:
        seen, default = client.submit(_kernel_threads_in_worker, pure=False, workers=[worker]).result()
        assert seen and set(seen) == {1}, (seen, default)


def _reference_partial(k, v, q64):
    return reference.attention(q64, k.astype(np.float64), v.astype(np.float64))


def _peak_rss():
    """This process's peak resident memory in bytes: ``VmHWM`` (``ru_maxrss`` of a spawned
    worker also counts the parent's memory at the fork before its ``exec``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def test_keys_larger_than_a_worker_memory_limit(client):
    """K and V of 640 MiB, generated on the workers in key chunks, under a 600 MiB limit per worker."""
    M, chunk = 1_310_720, 65_536  # keys; float32, D = 64: K and V 320 MiB each
    rng = da.random.default_rng(0)
    k = rng.standard_normal((1, 1, M, 64), chunks=(1, 1, chunk, 64), dtype=np.float32)
    v = rng.standard_normal((1, 1, M, 64), chunks=(1, 1, chunk, 64), dtype=np.float32)
    assert k.nbytes + v.nbytes > WORKER_MEMORY
    q = np.random.default_rng(1).standard_normal((1, 1, 4, 64)).astype(np.float32)
    out, lse = enpd.attention(q, k, v, return_lse=True)
    out, lse = client.compute([out, lse], sync=True)
    if os.path.exists("/proc/self/status"):  # Linux: each worker's peak stayed below its limit
        peaks = client.run(_peak_rss)
        assert all(p < WORKER_MEMORY for p in peaks.values()), peaks
    # the oracle: float64 partials over each key chunk, computed where the chunk is made, merged
    q64 = q.astype(np.float64)
    parts = [dask.delayed(_reference_partial)(kc, vc, q64)
             for kc, vc in zip(k.to_delayed().ravel(), v.to_delayed().ravel())]
    want, want_lse = reference.merge_attention(*zip(*client.compute(parts, sync=True)))
    assert np.abs(out - want).max() <= 1e-5 and np.abs(lse - want_lse).max() <= 1e-5 * np.abs(want_lse).max()
