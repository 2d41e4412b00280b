"""A server's mixed step over a paged cache: decodes and prefill chunks in one `varlen_attention` call (issue 69).

Every sequence reads its pages in place: the decodes of a query count in one
decode call, each prefill chunk through the prefill kernel over its pages
(`elastic_np.cpu.paged_forward`). Each sequence gets the bits of `attention`
on its gathered keys, whatever the pages' order, size and the spare pages'
contents.
"""

import tracemalloc

import numpy as np
import pytest

import elastic_np as enp
from elastic_np._contract._types import DynamicWindow

DTYPES = ["float32", "float64", "float16", "bfloat16"]


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _step(rng, lengths_q, used, block_size, dtype, H=4, Hkv=2, D=16):
    """``(q, cu_q, k_pages, v_pages, table, gathered)``: pages in shuffled order, the spare ones all NaN."""
    blocks = -(-np.asarray(used) // block_size)
    order = rng.permutation(int(blocks.sum()) + 4)
    table = np.full((len(used), max(blocks.max(), 1)), order.size - 1, np.int64)  # unread entries: a spare page
    taken = 0
    for s, n in enumerate(blocks):
        table[s, :n] = order[taken:taken + n]
        taken += n
    pages = [rng.standard_normal((order.size, block_size, Hkv, D)).astype(np.float32).astype(dtype) for _ in "kv"]
    for a in pages:
        a[order[taken:]] = np.nan
    gathered = [[a[table[s, :blocks[s]]].reshape(-1, Hkv, D)[None, :used[s]] for a in pages]
                for s in range(len(used))]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)])
    q = rng.standard_normal((cu_q[-1], H, D)).astype(np.float32).astype(dtype)
    return q, cu_q, *pages, table, gathered


def _option_sets(rng, S, H):
    return [
        {"causal": True},
        {"causal": True, "tau": rng.uniform(0.5, 2.0, H), "beta": rng.uniform(0, 1, H), "softcap": 5.0},
        {"causal": True, "window_size": (90, 0), "alibi_slopes": rng.uniform(0, 0.3, (S, H))},
        {"window_size": (300, 7), "scale": 0.4},
        {"nvm": True, "causal": True, "beta": 0.5},
        {"dynamic_window": DynamicWindow(rng.uniform(0.2, 0.9, (S, H)), sharpness=3.0, threshold=0.05),
         "causal": True},
    ]


def _sequence(options, s, S):
    per = dict(options)
    if np.ndim(per.get("alibi_slopes")) == 2:
        per["alibi_slopes"] = per["alibi_slopes"][s:s + 1]
    window = per.get("dynamic_window")
    if window is not None and np.ndim(window.sigma) == 2:
        per["dynamic_window"] = DynamicWindow(window.sigma[s:s + 1], sharpness=window.sharpness,
                                              threshold=window.threshold)
    return per


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 128])
def test_a_mixed_step_gives_each_sequence_the_bits_of_its_gathered_keys(dtype, block_size):
    dtype = _dtype(dtype)
    rng = np.random.default_rng(12)
    lengths_q = [1, 700, 1, 0, 37, 1, 3, 3, 129]
    used = [2000, 900, 2, 5, 37, 1, 300, 40, 129]  # chunks over no prefix (37, 129), a decode over its own key
    q, cu_q, k_pages, v_pages, table, gathered = _step(rng, lengths_q, used, block_size, dtype)
    S, H = len(used), q.shape[1]
    for options in _option_sets(rng, S, H):
        out, lse = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used,
                                        return_lse=True, backend="cpu", **options)
        for s, (k_s, v_s) in enumerate(gathered):
            rows = slice(cu_q[s], cu_q[s + 1])
            want, want_lse = enp.attention(q[None, rows], k_s, v_s, layout="bnhd", return_lse=True, backend="cpu",
                                           kv_lengths=[used[s]], align="kv_lengths", **_sequence(options, s, S))
            assert np.array_equal(out[rows].view(np.uint8), want[0].view(np.uint8)), (s, options)
            assert np.array_equal(lse[rows], want_lse[0].T), (s, options)


def test_a_float64_mixed_step_is_within_1e_12_of_the_oracle():
    rng = np.random.default_rng(13)
    lengths_q, used = [1, 300, 2, 64], [1500, 700, 90, 64]
    q, cu_q, k_pages, v_pages, table, gathered = _step(rng, lengths_q, used, 16, np.float64)
    for options in _option_sets(rng, len(used), q.shape[1]):
        out = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used,
                                   backend="cpu", **options)
        for s, (k_s, v_s) in enumerate(gathered):
            rows = slice(cu_q[s], cu_q[s + 1])
            want = enp.attention(q[None, rows], k_s, v_s, layout="bnhd", backend="reference",
                                 **_sequence(options, s, len(used)))
            np.testing.assert_allclose(out[rows], want[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_chunk_reads_its_pages_in_place(dtype, monkeypatch):
    """No copy of the sequence's keys in the peak memory (the output, twice, is a quarter of them here).

    Without the AMX tiles: their kernel transposes the values into a copy of its own (a chunk it takes:
    tests/cpu/test_amx_pages.py).
    """
    from elastic_np import cpu

    monkeypatch.setattr(cpu._runtime.config, "AMX", False)
    dtype = _dtype(dtype)
    rng = np.random.default_rng(14)
    used, chunk = [4096], 256
    q, cu_q, k_pages, v_pages, table, _ = _step(rng, [chunk], used, 16, dtype, H=8, Hkv=4, D=64)
    enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used, causal=True,
                         backend="cpu")
    tracemalloc.start()
    enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used, causal=True,
                         backend="cpu")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    gathered_bytes = 2 * used[0] * k_pages[0, 0].nbytes  # the sequence's keys and values
    assert peak < gathered_bytes / 4, (peak, gathered_bytes)


def test_a_nan_in_a_prefill_chunks_used_page_is_an_error():
    rng = np.random.default_rng(15)
    q, cu_q, k_pages, v_pages, table, _ = _step(rng, [40, 1], [200, 50], 16, np.float32)
    for name in "kv":
        pages = {"k": k_pages.copy(), "v": v_pages.copy()}
        pages[name][table[0, 12], 7, 1, 3] = np.inf  # key 199 of sequence 0: the last one it uses
        with pytest.raises(ValueError, match=f"`{name}` contains NaN or inf"):
            enp.varlen_attention(q, pages["k"], pages["v"], cu_q, None, block_table=table, seqused_k=[200, 50],
                                 backend="cpu")
    pages = k_pages.copy()
    pages[table[0, 12], 8:] = np.nan  # past the used keys of its page: never read
    enp.varlen_attention(q, pages, v_pages, cu_q, None, block_table=table, seqused_k=[200, 50], backend="cpu")


def test_the_decodes_of_a_mixed_step_share_one_call_per_query_count(monkeypatch):
    from elastic_np import cpu

    launches = []
    launcher = cpu._decode.decode._launcher

    def counted(problem, *args, **kwargs):
        launch = launcher(problem, *args, **kwargs)

        def counted_launch(*launch_args):
            launches.append((problem.shape[0], problem.shape[3]))
            return launch(*launch_args)

        counted_launch.calls, counted_launch.runs, counted_launch.kind = launch.calls, launch.runs, launch.kind
        return counted_launch

    monkeypatch.setattr(cpu._decode.decode, "_launcher", counted)
    rng = np.random.default_rng(16)
    lengths_q, used = [1, 60, 2, 1, 2, 1, 5], [100, 80, 30, 3, 64, 17, 5]
    q, cu_q, k_pages, v_pages, table, _ = _step(rng, lengths_q, used, 16, np.float32)
    enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used, causal=True,
                         backend="cpu")
    # (sequences, queries) of each decode launch: the three of 1 query, the two of 2, the one of 5
    assert sorted(launches) == [(1, 5), (2, 2), (3, 1)]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("lengths_q, used", [([3, 40], [200, 39]), ([1, 1], [0, 5]), ([0, 17], [4, 16])])
def test_a_chunk_of_more_queries_than_its_sequences_keys_is_an_error(backend, lengths_q, used):
    """With pages, a sequence's queries are its newest tokens, whose keys are in its pages: at most seqused_k."""
    rng = np.random.default_rng(17)
    q, cu_q, k_pages, v_pages, table, _ = _step(rng, lengths_q, np.maximum(used, lengths_q), 16, np.float32)
    before = [a.copy() for a in (q, k_pages, v_pages, table)]
    s = int(np.flatnonzero(np.greater(lengths_q, used))[0])
    with pytest.raises(ValueError, match=rf"sequence {s} has {lengths_q[s]} queries \(`cu_seqlens_q`\) and "
                                         rf"{used[s]} keys \(`seqused_k`\)"):
        enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used, backend=backend)
    for a, b in zip(before, (q, k_pages, v_pages, table)):
        assert np.array_equal(a, b, equal_nan=True)  # the spare pages are NaN
