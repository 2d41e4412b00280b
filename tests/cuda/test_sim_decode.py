"""The CUDA decode kernel (split-KV, stacked GQA rows) on the simulator, held to the float64 oracle.

``small_tiles`` shrinks its geometry so that a (B, Hkv) pair of these
shapes runs several key splits of several K/V tiles each, a partial last
tile, and, for the larger groups, several chunks of stacked rows per kv head.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference
from elastic_np._contract import _problem
from elastic_np.testing import _tolerances
from elastic_np.cuda._runtime import config as _cuda_config
from oracle_checks import assert_matches_oracle, make_inputs

pytestmark = pytest.mark.usefixtures("small_tiles")


def make(dtype, B, H, Hkv, N, M, D=6, Dv=5, seed=0):
    return make_inputs(dtype, B, H, Hkv, N, M, D, Dv, seed)


def options(name, B, H, N, M):
    """Decode option sets: every option alone, and combined; ragged caches hold 0 and 1 keys."""
    rng = np.random.default_rng(len(name))
    lengths = [M, 0, 1, M - 5][:B]
    mask = rng.random((B, 1, N, M)) < 0.7
    mask[0, 0, -1] = False  # a row that keeps nothing: lse = -inf with beta = 0
    padding = rng.standard_normal((B, 1, 1, M))
    padding[..., M - 7 :] = -np.inf
    return {
        "plain": {},
        "causal (bottom-right)": dict(causal=True),
        "causal, aligned to kv_lengths": dict(causal=True, kv_lengths=lengths, align="kv_lengths"),
        "window": dict(window_size=(9, 2)),
        "causal window": dict(causal=True, window_size=(11, 0)),
        "kv_lengths 0 and 1, beta": dict(kv_lengths=lengths, beta=np.linspace(0.0, 1.0, H)),
        "mask": dict(mask=mask),
        "nvm, tau, beta": dict(nvm=True, tau=np.linspace(0.5, 2.0, H), beta=0.3),
        "dynamic window": dict(
            dynamic_window=enp.DynamicWindow(rng.uniform(0.2, 0.8, (B, H)), sharpness=3.0, threshold=0.1),
            kv_lengths=lengths, align="kv_lengths",
        ),
        "softcap": dict(softcap=1.1, scale=1.5),
        "alibi": dict(alibi_slopes=rng.uniform(0.0, 0.3, (B, H)), causal=True),
        "full bias": dict(bias=rng.standard_normal((B, H, N, M))),
        "padding bias": dict(bias=padding, beta=0.5),
        "everything": dict(
            causal=True, window_size=(20, -1), kv_lengths=lengths, align="kv_lengths", mask=mask, nvm=True,
            tau=np.linspace(0.5, 2.0, H), beta=np.linspace(0.0, 1.0, H), softcap=1.3,
            alibi_slopes=rng.uniform(0.0, 0.2, H), bias=padding,
            dynamic_window=enp.DynamicWindow(0.6, sharpness=3.0, threshold=0.05),
        ),
    }[name]


NAMES = [
    "plain", "causal (bottom-right)", "causal, aligned to kv_lengths", "window", "causal window",
    "kv_lengths 0 and 1, beta", "mask", "nvm, tau, beta", "dynamic window", "softcap", "alibi", "full bias",
    "padding bias", "everything",
]


def check_forward(q, k, v, dout, opts):
    """``out`` and ``lse`` against the oracle (float32: against naive float32 evaluations)."""
    dtype = q.dtype
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cuda", **opts)
    wide = [a.astype(np.float64) for a in (q, k, v)]
    want_out, want_lse = reference.attention(*wide, **opts)
    naive = {}
    if dtype == np.float32:
        orderings = _tolerances.naive_orderings(q, k, v, dout, opts, np.float32)
        naive = {name: [n[name] for n in orderings] for name in ("out", "lse")}
    assert_matches_oracle("out", out, want_out, dtype, naive.get("out"))
    assert_matches_oracle("lse", lse, want_lse, dtype, naive.get("lse"))
    return out, lse


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_options_match_reference(decode_runs, dtype, name):
    B, H, Hkv, N, M = 3, 4, 1, 2, 37
    q, k, v, dout = make(dtype, B, H, Hkv, N, M, seed=1)
    check_forward(q, k, v, dout, options(name, B, H, N, M))
    assert decode_runs and decode_runs[-1] > 1  # split-KV ran


@pytest.mark.parametrize("N", [1, 2, 7, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_queries_and_groups_match_reference(decode_runs, N, group):
    """Every N and GQA ratio; ragged caches with 0 and 1 keys; the larger groups take several row chunks."""
    B, Hkv, M = 2, 2, 29
    H = group * Hkv
    q, k, v, dout = make(np.float64, B, H, Hkv, N, M, seed=N * group)
    opts = dict(causal=True, kv_lengths=[M, 1] if N % 2 else [0, M - 3], beta=np.linspace(0.0, 0.6, H),
                alibi_slopes=np.linspace(0.0, 0.2, H))
    check_forward(q, k, v, dout, opts)
    assert len(decode_runs) == 1


@pytest.mark.parametrize("N, group", [(1, 8), (7, 4), (16, 1)])
def test_float32_queries_and_groups(decode_runs, N, group):
    B, Hkv, M = 2, 1, 33
    H = group * Hkv
    q, k, v, dout = make(np.float32, B, H, Hkv, N, M, seed=5)
    check_forward(q, k, v, dout, dict(kv_lengths=[M, 1], window_size=(12, 3), softcap=2.0, nvm=True))
    assert len(decode_runs) == 1


def test_geometry_of_these_tests():
    """The fixture's tiles give several splits, row chunks, and several tiles per split."""
    from elastic_np.cuda._launch import plan as _plan

    rows_blk, tpr = _plan.decode_geometry(4 * 2, 6, 5, 8)
    assert (rows_blk, tpr) == (8, 2)  # block_k = 4 keys
    assert _plan.decode_splits(3, 37) == 4  # 37 keys in 4 splits of 2 or 3 tiles
    rows_blk, tpr = _plan.decode_geometry(8 * 16, 6, 5, 8)
    assert rows_blk * tpr <= _cuda_config.DECODE_THREADS and -(-128 // rows_blk) > 1


def test_splits_depend_on_the_shape_only(monkeypatch):
    from elastic_np.cuda._launch import plan as _plan

    monkeypatch.setattr(_cuda_config, "DECODE_MIN_BLOCKS", 256)
    monkeypatch.setattr(_cuda_config, "DECODE_MIN_SPLIT_KEYS", 256)
    assert _plan.decode_splits(8, 8192) == 32  # the bench's decode shape: 8 (batch, kv head) pairs
    assert _plan.decode_splits(256, 8192) == 1
    assert _plan.decode_splits(8, 600) == 2  # no split under 256 keys
    assert _plan.decode_splits(8, 100) == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bit_identical_across_runs(decode_runs, dtype):
    B, H, Hkv, N, M = 2, 4, 2, 3, 40
    q, k, v, _ = make(dtype, B, H, Hkv, N, M, seed=2)
    opts = options("everything", B, H, N, M)
    first = enp.attention(q, k, v, return_lse=True, backend="cuda", **opts)
    again = enp.attention(q, k, v, return_lse=True, backend="cuda", **opts)
    assert decode_runs[0] > 1
    for a, b in zip(first, again):
        assert a.dtype == dtype and a.tobytes() == b.tobytes()


def test_wide_value_head_takes_several_passes(monkeypatch, decode_runs):
    """One lane per row: 8 output columns per pass, so Dv = 21 takes three passes over the keys."""
    from elastic_np.cuda._launch import plan as _plan

    monkeypatch.setattr(_cuda_config, "DECODE_LANES", 1)
    assert _plan.decode_geometry(8, 6, 21, 8)[1] == 1
    q, k, v, dout = make(np.float64, 2, 4, 2, 4, 30, Dv=21, seed=3)
    check_forward(q, k, v, dout, dict(causal=True, softcap=1.5, beta=0.2, kv_lengths=[30, 11]))
    assert decode_runs[0] > 1


def test_one_split_and_many_agree(monkeypatch, decode_runs):
    """With and without split-KV: the same results to rounding, both held to the oracle."""
    q, k, v, dout = make(np.float64, 1, 8, 2, 3, 40, seed=4)
    opts = dict(causal=True, beta=0.4, nvm=True, tau=0.8)
    split = check_forward(q, k, v, dout, opts)
    monkeypatch.setattr(_cuda_config, "DECODE_MIN_BLOCKS", 1)
    whole = check_forward(q, k, v, dout, opts)
    assert decode_runs[0] > 1 and decode_runs[1] == 1
    np.testing.assert_allclose(split[0], whole[0], rtol=0, atol=1e-13)


def test_empty_caches(decode_runs):
    """No key anywhere: out = 0 and lse = log(beta), -inf where beta = 0."""
    q, k, v, dout = make(np.float64, 2, 2, 1, 3, 9, seed=5)
    out, lse = check_forward(q, k, v, dout, dict(kv_lengths=[0, 0], beta=np.array([0.0, 0.5])))
    assert (out == 0).all() and np.isneginf(lse[:, 0]).all()


def test_decode_shape_takes_the_decode_kernel():
    from elastic_np.cuda._launch import plan as _plan

    q, k, v, _ = make(np.float32, 1, 32, 8, 1, 16)
    assert _plan.takes_decode(_problem.prepare(q, k, v))
    q = np.zeros((1, 32, 17, 6), dtype=np.float32)
    assert not _plan.takes_decode(_problem.prepare(q, k, v))  # 17 queries: the flash forward


def test_option_arrays_are_copied_once_per_distinct_values(monkeypatch):
    """Repeated calls reuse the device copies of the option arrays; other values get their own, still right."""
    from elastic_np.cuda._launch import options as _options
    from elastic_np.cuda._runtime import gpu as _host

    monkeypatch.setattr(_options, "_plans", type(_options._plans)())
    monkeypatch.setattr(_cuda_config, "PLAN_CACHE_SIZE", 2)
    copies = []
    to_device = _host.cuda_module().to_device
    monkeypatch.setattr(_host.cuda_module(), "to_device", lambda a, *args, **kw: copies.append(1) or to_device(a))
    B, H, Hkv, N, M = 2, 4, 2, 1, 40
    q, k, v, dout = make(np.float32, B, H, Hkv, N, M, seed=6)
    first, _ = check_forward(q, k, v, dout, dict(causal=True, tau=0.7))
    made = len(copies)
    again = enp.attention(q, k, v, causal=True, tau=0.7, backend="cuda")
    assert len(copies) == made + 3 and len(_options._plans) == 1  # q, k, v only
    np.testing.assert_array_equal(first, again)
    for tau in (0.9, 1.3):  # new values: new copies, the oldest set dropped past PLAN_CACHE_SIZE
        check_forward(q, k, v, dout, dict(causal=True, tau=tau))
    assert len(_options._plans) == 2
    monkeypatch.setattr(_cuda_config, "PLAN_MAX_BYTES", 0)  # too large to keep: copied per call, not kept
    check_forward(q, k, v, dout, dict(causal=True, tau=0.7))
    assert len(_options._plans) == 2


def test_a_bias_is_copied_per_call_and_never_kept(monkeypatch):
    from elastic_np.cuda._launch import options as _options

    monkeypatch.setattr(_options, "_plans", type(_options._plans)())
    B, H, Hkv, N, M = 1, 4, 2, 1, 24
    q, k, v, dout = make(np.float64, B, H, Hkv, N, M, seed=7)
    bias = np.random.default_rng(7).standard_normal((B, H, N, M))
    check_forward(q, k, v, dout, dict(bias=bias))
    check_forward(q, k, v, dout, dict(bias=2.0 * bias))
    assert len(_options._plans) == 0
