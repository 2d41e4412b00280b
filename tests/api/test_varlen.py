"""Packed batches (``cu_seqlens``): the bits of sequence-by-sequence calls, forward and every gradient."""

import tracemalloc

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import DynamicWindow


def _dtype(name):
    """A dtype by name; bfloat16 (ml_dtypes') skips the test where ml_dtypes is missing."""
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)

LENGTHS_Q = [5, 0, 33, 1, 17]
LENGTHS_K = [9, 4, 33, 40, 0]


def _packed(dtype, Dv=8, seed=0):
    rng = np.random.default_rng(seed)
    H, Hkv, D = 4, 2, 8
    cu_q, cu_k = np.cumsum([0] + LENGTHS_Q), np.cumsum([0] + LENGTHS_K)
    q = rng.standard_normal((cu_q[-1], H, D)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], Hkv, D)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], Hkv, Dv)).astype(dtype)
    return q, k, v, cu_q, cu_k


def _option_sets(rng, S=len(LENGTHS_Q), H=4):
    return [
        {},
        {"causal": True, "tau": rng.uniform(0.5, 2.0, H), "beta": 0.5, "nvm": True},
        {"causal": True, "window_size": (6, 0), "softcap": 15.0, "alibi_slopes": rng.uniform(0, 0.3, (S, H))},
        {"dynamic_window": DynamicWindow(rng.uniform(0.3, 0.9, (S, H)), sharpness=3.0), "beta": rng.uniform(0, 1, H)},
        {"dynamic_window": DynamicWindow(0.6, sharpness=2.0), "causal": True},
    ]


def _one(a, lo, hi):
    return a[None, lo:hi]


def _sequence_options(options, s):
    per = dict(options)
    if options.get("alibi_slopes") is not None and np.ndim(options["alibi_slopes"]) == 2:
        per["alibi_slopes"] = options["alibi_slopes"][s:s + 1]
    window = options.get("dynamic_window")
    if window is not None and np.ndim(window.sigma) == 2:
        per["dynamic_window"] = DynamicWindow(window.sigma[s:s + 1], window.sharpness, window.threshold)
    return per


def _same(a, b, backend):
    """The CPU kernels: the same bits. The reference (NumPy's sums follow the arrays' strides): within 1e-13."""
    if backend == "cpu":
        return np.array_equal(a, b)
    return np.allclose(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_bits_of_calls_sequence_by_sequence(backend, dtype):
    q, k, v, cu_q, cu_k = _packed(dtype)
    for options in _option_sets(np.random.default_rng(1)):
        out, lse = enp.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, backend=backend, **options)
        dout = np.random.default_rng(2).standard_normal(out.shape).astype(out.dtype)
        dlse = np.random.default_rng(3).standard_normal(lse.shape).astype(lse.dtype)
        grads = enp.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, dlse=dlse, backend=backend,
                                              **options)
        dtau = dbeta = dsigma = 0.0
        dsigmas = []
        for s in range(len(LENGTHS_Q)):
            rows, keys = (cu_q[s], cu_q[s + 1]), (cu_k[s], cu_k[s + 1])
            per = _sequence_options(options, s)
            want, want_lse = enp.attention(_one(q, *rows), _one(k, *keys), _one(v, *keys), layout="bnhd",
                                           return_lse=True, backend=backend, **per)
            assert np.array_equal(out[slice(*rows)], want[0]) and np.array_equal(lse[slice(*rows)], want_lse[0].T)
            g = enp.attention_backward(_one(dout, *rows), _one(q, *rows), _one(k, *keys), _one(v, *keys), want,
                                       want_lse, dlse=dlse[slice(*rows)].T[None], layout="bnhd", backend=backend,
                                       **per)
            assert _same(grads.dq[slice(*rows)], g.dq[0], backend)
            assert _same(grads.dk[slice(*keys)], g.dk[0], backend) and _same(grads.dv[slice(*keys)], g.dv[0], backend)
            dtau, dbeta = dtau + g.dtau, dbeta + g.dbeta
            if g.dsigma is not None:
                dsigma = dsigma + g.dsigma
                dsigmas.append(g.dsigma)
        assert _same(grads.dtau, dtau, backend) and _same(grads.dbeta, dbeta, backend)
        window = options.get("dynamic_window")
        if window is None:
            assert grads.dsigma is None
        elif np.ndim(window.sigma) == 2:
            assert _same(grads.dsigma, np.concatenate(dsigmas), backend)
        else:
            assert _same(grads.dsigma, dsigma, backend)


def test_float64_kernels_within_1e_12_of_the_oracle():
    q, k, v, cu_q, cu_k = _packed(np.float64)
    options = _option_sets(np.random.default_rng(4))[2]
    out = enp.varlen_attention(q, k, v, cu_q, cu_k, backend="cpu", **options)
    want = enp.varlen_attention(q, k, v, cu_q, cu_k, backend="reference", **options)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_seqused_k_reads_only_each_sequences_used_keys():
    q, k, v, cu_q, cu_k = _packed(np.float64)
    used = np.array([3, 0, 20, 40, 0])
    poisoned = k.copy()
    for s, n in enumerate(used):  # NaN past the used keys: never read
        poisoned[cu_k[s] + n:cu_k[s + 1]] = np.nan
    out = enp.varlen_attention(q, poisoned, v, cu_q, cu_k, seqused_k=used, causal=True, backend="cpu")
    for s, n in enumerate(used):
        keys = slice(cu_k[s], cu_k[s] + n)
        want = enp.attention(q[None, cu_q[s]:cu_q[s + 1]], k[None, keys], v[None, keys], causal=True,
                             layout="bnhd", backend="cpu")
        np.testing.assert_array_equal(out[cu_q[s]:cu_q[s + 1]], want[0])


def test_bad_packed_arguments_name_themselves():
    q, k, v, cu_q, cu_k = _packed(np.float32)
    with pytest.raises(ValueError, match="`cu_seqlens_q` must rise from 0 to the packed length 56"):
        enp.varlen_attention(q, k, v, cu_q[:-1], cu_k)
    with pytest.raises(ValueError, match="as many sequences"):
        enp.varlen_attention(q, k, v, cu_q, [0, k.shape[0]])
    with pytest.raises(ValueError, match="`max_q`=10 is below the longest sequence, 33"):
        enp.varlen_attention(q, k, v, cu_q, cu_k, max_q=10)
    with pytest.raises(ValueError, match="`seqused_k`"):
        enp.varlen_attention(q, k, v, cu_q, cu_k, seqused_k=[9, 4, 33, 41, 0])
    with pytest.raises(ValueError, match="`block_table`"):
        enp.varlen_attention(q, k, v, cu_q, cu_k, block_table=np.zeros((5, 2), np.int32))
    with pytest.raises(ValueError, match="`bias` as a list of one array per sequence.*diagonal blocks"):
        enp.varlen_attention(q, k, v, cu_q, cu_k, bias=np.zeros((56, 86)))
    with pytest.raises(ValueError, match="`mask` must hold one array per sequence, 5, got 2"):
        enp.varlen_attention(q, k, v, cu_q, cu_k, mask=[np.ones((5, 9), bool)] * 2)
    biases = [np.zeros((1, n, m)) for n, m in zip(LENGTHS_Q, LENGTHS_K)]
    biases[2] = np.zeros((4, 33, 9))
    with pytest.raises(ValueError, match="`bias\\[2\\]` of shape \\(4, 33, 9\\) is not broadcastable to "
                                         "sequence 2's \\(H, N_s, M_s\\) = \\(4, 33, 33\\)"):
        enp.varlen_attention(q, k, v, cu_q, cu_k, bias=biases)
    with pytest.raises(ValueError, match="does not take `kv_lengths`.*`seqused_k`"):
        enp.varlen_attention(q, k, v, cu_q, cu_k, kv_lengths=[1] * 5)
    with pytest.raises(ValueError, match="\\(total, heads, dim\\)"):
        enp.varlen_attention(q[None], k, v, cu_q, cu_k)
    with pytest.raises(TypeError, match="causal="):
        enp.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)


@pytest.mark.parametrize("block_size", [16, 4])
def test_a_paged_cache_gives_the_bits_of_its_gathered_keys(block_size):
    rng = np.random.default_rng(5)
    H, Hkv, D = 4, 2, 8
    used = np.array([37, 1, 0, 16])
    lengths_q = np.array([3, 1, 0, 5])  # decoding steps and a chunk of a prefill
    blocks = -(-used // block_size)
    order = rng.permutation(int(blocks.sum()) + 3)  # pages in any order, and pages no one uses
    table = np.zeros((4, blocks.max()), np.int32)
    taken = 0
    for s, n in enumerate(blocks):
        table[s, :n] = order[taken:taken + n]
        taken += n
    k_pages, v_pages = (rng.standard_normal((order.size, block_size, Hkv, D)) for _ in range(2))
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)])
    q = rng.standard_normal((cu_q[-1], H, D))
    options = {"causal": True, "beta": 0.5, "softcap": 20.0}
    out, lse = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used,
                                    return_lse=True, backend="cpu", **options)
    for s in range(4):
        k_s, v_s = (a[table[s, :blocks[s]]].reshape(-1, Hkv, D)[:used[s]] for a in (k_pages, v_pages))
        rows = slice(cu_q[s], cu_q[s + 1])
        want, want_lse = enp.attention(q[None, rows], k_s[None], v_s[None], layout="bnhd", return_lse=True,
                                       backend="cpu", **options)
        assert np.array_equal(out[rows], want[0]) and np.array_equal(lse[rows], want_lse[0].T)


def _paged_cache(rng, used, block_size, dtype, Hkv=2, D=16, spare=3):
    """Pages in shuffled order (and ``spare`` pages no sequence uses), the table, the gathered caches."""
    blocks = -(-np.asarray(used) // block_size)
    order = rng.permutation(int(blocks.sum()) + spare)
    table = np.zeros((len(used), max(blocks.max(), 1)), np.int64)
    taken = 0
    for s, n in enumerate(blocks):
        table[s, :n] = order[taken:taken + n]
        taken += n
    pages = [rng.standard_normal((order.size, block_size, Hkv, D)).astype(np.float32).astype(dtype) for _ in "kv"]
    gathered = [[a[table[s, :blocks[s]]].reshape(-1, Hkv, D)[None, :used[s]] for a in pages]
                for s in range(len(used))]
    return pages, table, gathered


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("queries", [1, 16], ids=["1 query", "16 queries"])
def test_paged_decoding_reads_the_pages_in_place(dtype, block_size, queries):
    """The decode kernel over the pages: the gathered keys' bits, and no copy of them in the peak memory."""
    dtype = _dtype(dtype)
    rng = np.random.default_rng(7)
    used = np.array([700, queries, queries + 1, 128])  # two sequences of no more keys than queries
    (k_pages, v_pages), table, gathered = _paged_cache(rng, used, block_size, dtype)
    H, D = 8, 16
    q = rng.standard_normal((4 * queries, H, D)).astype(np.float32).astype(dtype)
    cu_q = np.arange(5) * queries
    for options in ({"causal": True, "beta": 0.5, "tau": 0.8}, {"causal": True, "window_size": (100, 0),
                                                                 "alibi_slopes": rng.uniform(0, 0.2, H)}):
        out, lse = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used,
                                        return_lse=True, backend="cpu", **options)
        for s, (k_s, v_s) in enumerate(gathered):
            rows = slice(cu_q[s], cu_q[s + 1])
            want, want_lse = enp.attention(q[None, rows], k_s, v_s, layout="bnhd", return_lse=True, backend="cpu",
                                           **options)
            assert np.array_equal(out[rows].view(np.uint8), want[0].view(np.uint8)), (s, options)
            assert np.array_equal(lse[rows], want_lse[0].T)
    big = np.array([8192])
    (k_pages, v_pages), table, _ = _paged_cache(rng, big, block_size, dtype, Hkv=8, D=64, spare=0)
    q = rng.standard_normal((queries, 32, 64)).astype(np.float32).astype(dtype)
    tracemalloc.start()
    enp.varlen_attention(q, k_pages, v_pages, [0, queries], None, block_table=table, seqused_k=big, backend="cpu")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < k_pages.nbytes / 4, (peak, k_pages.nbytes)  # gathering k and v would take 2 * nbytes


def test_a_nan_in_a_used_page_is_an_error_one_in_a_spare_page_is_not():
    rng = np.random.default_rng(8)
    used = np.array([300, 20])
    (k_pages, v_pages), table, _ = _paged_cache(rng, used, 16, np.float32)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    spare = sorted(set(range(k_pages.shape[0])) - set(table[0, :19].tolist()) - set(table[1, :2].tolist()))
    k_pages[spare[0]] = np.nan
    v_pages[table[1, 1], 4:] = np.inf  # past the 20 keys sequence 1 uses
    before = [a.copy() for a in (q, k_pages, v_pages, table)]
    enp.varlen_attention(q, k_pages, v_pages, [0, 1, 2], None, block_table=table, seqused_k=used, backend="cpu")
    for a, b in zip(before, (q, k_pages, v_pages, table)):
        assert np.array_equal(a, b, equal_nan=True)
    for where in ((table[0, 3], 5, 1, 2), (table[0, 0], 0, 0, 0)):  # read by the split, and outside the window
        bad = k_pages.copy()
        bad[where] = np.inf
        with pytest.raises(ValueError, match="`k` contains NaN or inf"):
            enp.varlen_attention(q, bad, v_pages, [0, 1, 2], None, block_table=table, seqused_k=used,
                                 window_size=(50, 0), causal=True, backend="cpu")


def test_a_page_named_twice_in_a_sequence_is_an_error():
    k = np.zeros((3, 4, 1, 8))
    q = np.zeros((2, 1, 8))
    with pytest.raises(ValueError, match="`block_table` row 1 names page 2 twice"):
        enp.varlen_attention(q, k, k, [0, 1, 2], None, block_table=[[0, 1], [2, 2]], seqused_k=[8, 8])
    enp.varlen_attention(q, k, k, [0, 1, 2], None, block_table=[[0, 1], [2, 2]], seqused_k=[8, 4])  # unused: fine


def test_a_paged_cache_checks_its_table():
    k = np.zeros((3, 4, 1, 8))
    q = np.zeros((2, 1, 8))
    with pytest.raises(ValueError, match="needs `seqused_k`"):
        enp.varlen_attention(q, k, k, [0, 2], None, block_table=[[0, 1]])
    with pytest.raises(ValueError, match="a page outside the 3"):
        enp.varlen_attention(q, k, k, [0, 2], None, block_table=[[0, 7]], seqused_k=[6])
    with pytest.raises(ValueError, match="\\(num_blocks, block_size, heads, dim\\)"):
        enp.varlen_attention(q, k[0], k[0], [0, 2], None, block_table=[[0]], seqused_k=[2])


def _per_sequence_bias_and_mask(rng, H=4):
    """A bias and a mask per sequence, in shapes of their own (broadcast over heads or rows)."""
    shapes = [(H, 5, 9), (1, 0, 4), (33, 33), (H, 1, 1), (1, 17, 1)]
    bias = [rng.standard_normal(shape) for shape in shapes]
    bias[2][3, :5] = -np.inf  # entries removed
    mask = [rng.random((n, m)) > 0.25 for n, m in zip(LENGTHS_Q, LENGTHS_K)]
    return bias, mask


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_bias_and_a_mask_per_sequence(backend):
    q, k, v, cu_q, cu_k = _packed(np.float64)
    rng = np.random.default_rng(6)
    bias, mask = _per_sequence_bias_and_mask(rng)
    options = {"causal": True, "beta": 0.3, "softcap": 10.0}
    before = [b.copy() for b in bias], [m.copy() for m in mask]
    out, lse = enp.varlen_attention(q, k, v, cu_q, cu_k, bias=bias, mask=mask, return_lse=True, backend=backend,
                                    **options)
    dout = rng.standard_normal(out.shape)
    grads = enp.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, bias=bias, mask=mask,
                                          backend=backend, **options)
    assert all(np.array_equal(a, b) for a, b in zip(bias + mask, before[0] + before[1]))  # nothing mutated
    assert [g.shape for g in grads.dbias] == [b.shape for b in bias]
    for s in range(len(LENGTHS_Q)):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        want, want_lse = enp.attention(q[None, rows], k[None, keys], v[None, keys], bias=bias[s], mask=mask[s],
                                       layout="bnhd", return_lse=True, backend=backend, **options)
        assert np.array_equal(out[rows], want[0]) and np.array_equal(lse[rows], want_lse[0].T)
        g = enp.attention_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], want, want_lse,
                                   bias=bias[s], mask=mask[s], layout="bnhd", backend=backend, **options)
        assert _same(grads.dq[rows], g.dq[0], backend) and _same(grads.dk[keys], g.dk[0], backend)
        assert _same(grads.dbias[s], g.dbias, backend)


def test_a_bias_per_sequence_over_a_paged_cache_spans_its_used_keys():
    rng = np.random.default_rng(7)
    k_pages, v_pages = (rng.standard_normal((5, 4, 2, 8)) for _ in range(2))
    table, used = np.array([[3, 1], [0, 4]]), np.array([6, 3])
    q = rng.standard_normal((3, 4, 8))
    bias = [rng.standard_normal((4, 2, 6)), rng.standard_normal((1, 1, 3))]
    out = enp.varlen_attention(q, k_pages, v_pages, [0, 2, 3], None, block_table=table, seqused_k=used, bias=bias,
                               causal=True, backend="cpu")
    k0, v0 = (a[[3, 1]].reshape(8, 2, 8)[None, :6] for a in (k_pages, v_pages))
    want = enp.attention(q[None, :2], k0, v0, bias=bias[0], causal=True, layout="bnhd", backend="cpu")
    assert np.array_equal(out[:2], want[0])
    with pytest.raises(ValueError, match="`bias\\[1\\]` of shape \\(1, 1, 4\\).*\\(4, 1, 3\\)"):
        enp.varlen_attention(q, k_pages, v_pages, [0, 2, 3], None, block_table=table, seqused_k=used,
                             bias=[bias[0], np.zeros((1, 1, 4))])


def _paged_option_sets(rng, S, H):
    """Every option a paged cache takes (no `mask` or `bias`: those go sequence by sequence)."""
    return [
        {},
        {"causal": True, "tau": rng.uniform(0.5, 2.0, H), "beta": rng.uniform(0, 1, H), "softcap": 5.0},
        {"causal": True, "window_size": (20, 0), "alibi_slopes": rng.uniform(0, 0.3, (S, H))},
        {"window_size": (30, 2), "alibi_slopes": rng.uniform(0, 0.3, H), "scale": 0.4},
        {"nvm": True, "causal": True, "beta": 0.5},
        {"dynamic_window": DynamicWindow(rng.uniform(0.2, 0.9, (S, H)), sharpness=3.0, threshold=0.05)},
        {"dynamic_window": DynamicWindow(rng.uniform(0.3, 0.9, (S, 1)), sharpness=2.0), "causal": True},
    ]


@pytest.fixture
def calls_of_forward(monkeypatch):
    """Small decode splits (of 16 keys or more) and tiles (12 or 24 keys); the batch size of each decode kernel's
    launch (`cpu._decode.decode._launcher`'s, a call in full or a paged plan's)."""
    from elastic_np import cpu
    from elastic_np._api import paged_plans

    monkeypatch.setattr(cpu._runtime.config, "DECODE_MIN_SPLIT_KEYS", 16)
    monkeypatch.setattr(cpu._runtime.config, "DECODE_BLOCK_K", 24)
    monkeypatch.setattr(cpu._runtime.config, "SERIAL_WORK", 0)
    paged_plans.PLANS.clear()  # their launches made before the count
    calls = []
    launcher = cpu._decode.decode._launcher

    def counted(problem, *args, **kwargs):
        launch = launcher(problem, *args, **kwargs)

        def counted_launch(*launch_args, **launch_kwargs):
            calls.append(problem.shape[0])
            return launch(*launch_args, **launch_kwargs)

        counted_launch.calls, counted_launch.runs, counted_launch.kind = launch.calls, launch.runs, launch.kind
        return counted_launch

    monkeypatch.setattr(cpu._decode.decode, "_launcher", counted)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("queries", [1, 3, 16], ids=["1 query", "3 queries", "16 queries (key-major)"])
def test_one_call_over_every_sequence_keeps_each_sequences_bits(dtype, block_size, queries, calls_of_forward,
                                                                monkeypatch):
    """Sequences of different lengths and split counts in one decode call: each its own call's bits, any thread count."""
    from elastic_np import cpu

    dtype = _dtype(dtype)
    rng = np.random.default_rng(9)
    used = np.array([queries, queries + 1, 40, 100, 300, 17])  # the shortest: as many keys as queries, one more
    H, Hkv = 8, 2
    assert [cpu._decode.plan.splits(1, Hkv, n) for n in used] == [1, 1, 2, 6, 16, 1]
    (k_pages, v_pages), table, gathered = _paged_cache(rng, used, block_size, dtype, Hkv=Hkv)
    q = rng.standard_normal((used.size * queries, H, 16)).astype(np.float32).astype(dtype)
    cu_q = np.arange(used.size + 1) * queries
    for options in _paged_option_sets(rng, used.size, H):
        wants = []
        for s, (k_s, v_s) in enumerate(gathered):
            rows = slice(cu_q[s], cu_q[s + 1])
            want, want_lse = enp.attention(q[None, rows], k_s, v_s, layout="bnhd", return_lse=True, backend="cpu",
                                           **_sequence_options(options, s))
            wants.append((want[0], want_lse[0].T))
        for threads in (1, 2, 3):
            monkeypatch.setattr(cpu._runtime.threads, "thread_count", lambda: threads)
            del calls_of_forward[:]
            out, lse = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used,
                                            return_lse=True, backend="cpu", **options)
            assert calls_of_forward == [used.size]  # one call, over every sequence
            for s, (want, want_lse) in enumerate(wants):
                rows = slice(cu_q[s], cu_q[s + 1])
                assert np.array_equal(out[rows].view(np.uint8), want.view(np.uint8)), (s, options, threads)
                assert np.array_equal(lse[rows], want_lse), (s, options, threads)


def test_sequences_one_call_cannot_hold_go_one_by_one(calls_of_forward):
    """A bias per sequence: a decode call per sequence; different numbers of queries: a call per count."""
    rng = np.random.default_rng(10)
    used = np.array([50, 2, 33])
    (k_pages, v_pages), table, gathered = _paged_cache(rng, used, 16, np.float32)
    for lengths_q, bias in (([1, 2, 1], None), ([1, 1, 1], [rng.standard_normal((1, 1, n)) for n in used])):
        cu_q = np.concatenate([[0], np.cumsum(lengths_q)])
        q = rng.standard_normal((cu_q[-1], 4, 16)).astype(np.float32)
        del calls_of_forward[:]
        out = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used, bias=bias,
                                   causal=True, backend="cpu")
        assert calls_of_forward == ([1, 1, 1] if bias is not None else [2, 1])
        for s, (k_s, v_s) in enumerate(gathered):
            rows = slice(cu_q[s], cu_q[s + 1])
            want = enp.attention(q[None, rows], k_s, v_s, layout="bnhd", causal=True, backend="cpu",
                                 bias=None if bias is None else bias[s])
            assert np.array_equal(out[rows], want[0])


def test_bad_options_of_a_paged_batch_raise_as_the_sequences_calls_do():
    """What the batched problem rejects, the first sequence's own call reports (its batch of 1 in the message)."""
    k = np.zeros((3, 4, 1, 8))
    q = np.zeros((2, 4, 8))
    paged = dict(block_table=[[0], [1]], seqused_k=[4, 3], backend="cpu")
    bad_q = q.copy()
    bad_q[1, 0, 0] = np.nan
    with pytest.raises(ValueError, match="`q` contains NaN or inf"):
        enp.varlen_attention(bad_q, k, k, [0, 1, 2], None, **paged)
    with pytest.raises(ValueError, match="`alibi_slopes` must have shape \\(H,\\) = \\(4,\\) or \\(B, H\\) = \\(1, 4\\)"):
        enp.varlen_attention(q, k, k, [0, 1, 2], None, alibi_slopes=np.zeros(5), **paged)
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal(q.shape), rng.standard_normal(k.shape), rng.standard_normal(k.shape)
    slopes = np.full((1, 4), 0.1)  # one row for every sequence: each call broadcasts it, the batch of 2 cannot
    out = enp.varlen_attention(q, k, v, [0, 1, 2], None, alibi_slopes=slopes, **paged)
    for s, n in enumerate([4, 3]):
        want = enp.attention(q[None, s:s + 1], k[None, s, :n], v[None, s, :n], alibi_slopes=slopes, layout="bnhd",
                             backend="cpu")
        assert np.array_equal(out[s:s + 1], want[0])
