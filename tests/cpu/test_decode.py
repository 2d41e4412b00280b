"""The CPU decode kernel (few queries against a long cache) against the float64 oracle.

`elastic_np.cpu.forward` hands every problem with ``1 <= N <= 16`` queries
(and at most 128 stacked rows per kv head) to `elastic_np.cpu._decode.decode`. The
`decode_tiles` fixture shrinks its key tiles and splits so that small caches
cross several of both, and runs each case through both of its kernels; the
backward of these cases runs the prefill kernels.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np.cpu._decode import decode as _decode, plan as _decode_plan
from elastic_np import cpu, reference
from elastic_np._api import plans
from elastic_np._contract import _problem
from oracle_checks import assert_matches_oracle as assert_close, check_case, decode_cases

DTYPES = [np.float64, np.float32]


def test_takes_decode_shapes():
    def problem(H, Hkv, N):
        q = np.zeros((1, H, N, 4))
        kv = np.zeros((1, Hkv, 9, 4))
        return _problem.prepare(q, kv, kv)

    assert _decode_plan.takes(problem(8, 2, 1)) and _decode_plan.takes(problem(8, 2, 16))
    assert not _decode_plan.takes(problem(8, 2, 17))
    assert not _decode_plan.takes(problem(64, 1, 4))  # 256 stacked rows
    assert not _decode_plan.takes(problem(8, 2, 0))


@pytest.mark.parametrize(
    "N, kernel", [(1, "_decode_kernel"), (15, "_decode_kernel"), (16, "_decode_heads_kernel")]
)
def test_kernel_follows_the_query_count(monkeypatch, N, kernel):
    """Fewer than `DECODE_KEY_MAJOR_QUERIES` queries stack their rows; that many run key-major."""
    called = []
    for kept in ("PLANS", "FAMILIES"):  # no launch of an earlier call's plan, which holds the kernels it found
        monkeypatch.setattr(plans, kept, _problem.Kept(64))
    for name in ("_decode_kernel", "_decode_heads_kernel"):  # a launch's first run calls them as found here
        dispatcher = getattr(_decode, name)
        monkeypatch.setattr(_decode, name, lambda *a, _f=dispatcher: called.append(_f.py_func.__name__) or _f(*a))
    q = np.ones((1, 4, N, 8), np.float32)
    kv = np.ones((1, 2, 40, 8), np.float32)
    out = enp.attention(q, kv, kv, causal=True, backend="cpu")
    assert called == [kernel]
    np.testing.assert_allclose(out, 1.0)


def test_splits_follow_the_shape():
    assert _decode_plan.splits(1, 8, 8192) == 4
    assert _decode_plan.splits(1, 8, 100) == 1
    assert _decode_plan.splits(4, 8, 4096) == 1
    assert _decode_plan.splits(0, 8, 4096) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 2, 7, 16])
@pytest.mark.parametrize("case", list(decode_cases(2, 8, 1, 23)))
def test_options(decode_tiles, dtype, N, case):
    check_case(dtype, decode_cases(2, 8, N, 23)[case], B=2, H=8, Hkv=2, N=N, M=23, D=8, Dv=6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, Hkv", [(4, 4), (8, 2), (8, 1), (16, 2)])
@pytest.mark.parametrize("N", [1, 7, 16])
def test_group_sizes(decode_tiles, dtype, H, Hkv, N):
    check_case(dtype, decode_cases(2, H, N, 29)["everything"], B=2, H=H, Hkv=Hkv, N=N, M=29, D=5, Dv=3)


def _forward_against_oracle(dtype, opts, seed=0, **shape):
    rng = np.random.default_rng(seed)
    B, H, Hkv, N, M, D = (shape[n] for n in ("B", "H", "Hkv", "N", "M", "D"))
    q = rng.standard_normal((B, H, N, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, M, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, M, D)).astype(dtype)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
    ref_out, ref_lse = reference.attention(q, k, v, **opts)
    if dtype == np.float64:
        assert_close("out", out, ref_out, dtype)
        assert_close("lse", lse, ref_lse, dtype)
    else:  # a float32 sum over up to 10,000 keys: the float32 rule's bound of 1e-5
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        assert np.abs(out - ref_out).max(initial=0) <= 1e-5
        finite = np.isfinite(ref_lse)
        assert np.abs(lse[finite] - ref_lse[finite]).max(initial=0) <= 1e-5 * max(1, np.abs(ref_lse[finite]).max(initial=0))
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 513, 10_000])
@pytest.mark.parametrize("N", [1, 16])
def test_long_and_short_caches(dtype, M, N):
    lengths = np.array([M, 0, 1, max(M - 3, 0)])
    for opts in ({}, dict(causal=True, kv_lengths=lengths, beta=0.3), dict(window_size=(300, 0), causal=True)):
        _forward_against_oracle(dtype, opts, B=4, H=8, Hkv=1, N=N, M=M, D=16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [2, 16])  # the two kernels
def test_same_bits_for_every_thread_count(monkeypatch, dtype, N):
    """The splits depend on the shape only: 1, 2 and 4 threads give the same bits."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 8, N, 32)).astype(dtype)
    k = rng.standard_normal((1, 2, 3000, 32)).astype(dtype)
    v = rng.standard_normal((1, 2, 3000, 16)).astype(dtype)
    opts = dict(causal=True, nvm=True, beta=0.5, softcap=2.0)
    assert _decode_plan.splits(1, 2, 3000) > 1
    monkeypatch.setattr(cpu._runtime.config, "SERIAL_WORK", 0)
    results = []
    for threads in (1, 2, 4):
        monkeypatch.setattr(cpu._runtime.threads, "thread_count", lambda threads=threads: threads)
        results.append(enp.attention(q, k, v, return_lse=True, backend="cpu", **opts))
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 16, 40])  # the two decode kernels and the prefill kernels
def test_non_finite_cache_values(dtype, N):
    """NaN or inf in a key or value a query may keep is an error; in the padding it is never read."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, N, 8)).astype(dtype)
    k = rng.standard_normal((2, 2, 50, 8)).astype(dtype)
    v = rng.standard_normal((2, 2, 50, 8)).astype(dtype)
    lengths = np.array([50, 30])
    for name, b, j, value in (("k", 0, 7, np.nan), ("v", 1, 29, np.inf), ("k", 1, 0, -np.inf)):
        bad = {"k": k.copy(), "v": v.copy()}
        bad[name][b, 1, j, 3] = value
        for opts in (dict(kv_lengths=lengths), dict(kv_lengths=lengths, window_size=(2, 0), causal=True)):
            for backend in ("cpu", "reference"):
                with pytest.raises(ValueError, match=f"`{name}` contains NaN or inf"):
                    enp.attention(q, bad["k"], bad["v"], backend=backend, **opts)
    # the padding of batch entry 1 (keys 30 and on) may hold anything
    padded_k, padded_v = k.copy(), v.copy()
    padded_k[1, :, 30:] = np.nan
    padded_v[1, :, 35] = np.inf
    opts = dict(kv_lengths=lengths, causal=True)
    out, lse = enp.attention(q, padded_k, padded_v, return_lse=True, backend="cpu", **opts)
    ref_out, ref_lse = enp.attention(q, k, v, return_lse=True, backend="reference", **opts)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref_out, atol=1e-5 if dtype == np.float32 else 1e-12)
    dout = np.ones_like(out)
    grads = enp.attention_backward(dout, q, padded_k, padded_v, out, lse, backend="cpu", **opts)
    assert np.isfinite(grads.dk).all() and np.isfinite(grads.dv).all()
    assert not grads.dk[1, :, 30:].any() and not grads.dv[1, :, 30:].any()


def test_overflowing_products_are_not_reported_as_bad_values():
    """A product that overflows float32 is not a NaN or inf input: no ValueError names `k`, and the result is
    the oracle's (logits of 2e38, beside which the log of the 6 keys' sum vanishes: each key's weight is 1)."""
    q = np.full((1, 1, 1, 4), 1e19, np.float32)
    k = np.full((1, 1, 6, 4), 1e19, np.float32)
    v = np.arange(24, dtype=np.float32).reshape(1, 1, 6, 4)
    with np.errstate(all="ignore"):
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu")
        want_out, want_lse = reference.attention(q, k, v)
    assert out.dtype == lse.dtype == np.float32 and np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, want_out, rtol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_unmodified_and_non_contiguous(dtype):
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 3, 8, 4)).astype(dtype)[:, :, ::4]  # N = 2, strided
    k = np.asfortranarray(rng.standard_normal((2, 3, 40, 4)).astype(dtype))
    v = rng.standard_normal((2, 3, 4, 40)).astype(dtype).transpose(0, 1, 3, 2)
    before = [a.copy() for a in (q, k, v)]
    out = enp.attention(q, k, v, causal=True, backend="cpu")
    for a, b in zip((q, k, v), before):
        np.testing.assert_array_equal(a, b)
    ref = reference.attention(q, k, v, causal=True)[0]
    np.testing.assert_allclose(out, ref, atol=1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_batches_heads_and_values(dtype):
    for B, Hkv, M, Dv in ((0, 2, 9, 4), (2, 2, 0, 4), (2, 2, 9, 0)):
        q = np.ones((B, 4, 3, 5), dtype)
        k = np.ones((B, Hkv, M, 5), dtype)
        v = np.ones((B, Hkv, M, Dv), dtype)
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", beta=0.5)
        ref_out, ref_lse = reference.attention(q, k, v, beta=0.5)
        assert out.shape == ref_out.shape and out.dtype == dtype
        np.testing.assert_allclose(out, ref_out, atol=1e-6)
        np.testing.assert_allclose(lse, ref_lse, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_max_of_every_range(dtype):
    """`_decode._row_max` (eight running maxima): any range, any length, ``-inf`` entries, empty."""
    from numba import njit

    @njit(fastmath={"nnan", "nsz", "arcp", "contract", "reassoc"})
    def row_max(z, lo, hi):
        return _decode._row_max(z, lo, hi)

    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 9, 16, 23, 128):
        z = rng.standard_normal(n).astype(dtype)
        z[rng.random(n) < 0.3] = -np.inf
        for lo in range(0, n + 1, max(1, n // 5)):
            for hi in range(lo, n + 1, max(1, n // 7)):
                want = z[lo:hi].max() if hi > lo else -np.inf
                got = row_max(z, lo, hi)
                assert got == want, (n, lo, hi)


def test_a_launch_types_its_arguments_for_the_entry_points_only_when_it_runs_again(monkeypatch):
    # the typing costs some 400 us: an unplanned call, whose launch runs once, must not pay it
    typed = []
    run = _decode.direct_call
    monkeypatch.setattr(_decode, "direct_call", lambda d, args: typed.append(d) or run(d, args))
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 4, 1, 8)), rng.standard_normal((1, 2, 20, 8))
    tau = np.array([1.0, 0.5, 2.0, 1.5])  # an array option: not planned
    first = enp.attention(q, k, k, tau=tau, backend="cpu")
    assert np.array_equal(enp.attention(q, k, k, tau=tau, backend="cpu"), first) and typed == []
    step = enp.plan(q.shape, k.shape, dtype=q.dtype, tau=tau, backend="cpu")
    runs = [step.run(q, k, k) for _ in range(3)]
    # one split a kv head: the kernel finishes the rows, and no merge runs
    assert typed == [_decode._decode_kernel, _decode._all_read] and all(np.array_equal(r, first) for r in runs)
    typed.clear()
    k = rng.standard_normal((1, 2, 2 * cpu._runtime.config.DECODE_MIN_SPLIT_KEYS, 8))  # two splits: their merge too
    first = enp.attention(q, k, k, tau=tau, backend="cpu")
    step = enp.plan(q.shape, k.shape, dtype=q.dtype, tau=tau, backend="cpu")
    runs = [step.run(q, k, k) for _ in range(3)]
    assert typed == [_decode._decode_kernel, _decode._all_read, _decode._merge_kernel]
    assert all(np.array_equal(r, first) for r in runs)
