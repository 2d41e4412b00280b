"""Plans: `elastic_np.plan` and the plans `attention` keeps give the bits and the errors of a call in full."""

import gc
import threading
import weakref

import numpy as np
import pytest

import elastic_np as enp
from elastic_np._api import paged_plans, plans
from elastic_np._contract._problem import AttentionProblem
from elastic_np.cpu._runtime import config, numba_private

ml_dtypes = pytest.importorskip("ml_dtypes")

# (H, Hkv, N, M, D, options): the decode kernel (1 and 16 queries), the prefill, every kind of option a call is keyed by
CASES = [
    (8, 2, 1, 64, 16, {}),
    (8, 8, 16, 16, 8, {"causal": True}),
    (4, 2, 40, 33, 8, {"causal": True, "window_size": (5, 0), "scale": 0.3}),
    (4, 4, 3, 70, 8, {"tau": 0.7, "beta": 0.5, "softcap": 20.0, "nvm": True, "align": "kv_lengths"}),
    (2, 1, 2, 9, 8, {"precision": None, "layout": "bnhd"}),
]
DTYPES = [np.float32, np.float64, ml_dtypes.bfloat16, np.float16]


def arrays(H, Hkv, N, M, D, dtype, layout="bhnd", seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(2, H, N, D), (2, Hkv, M, D), (2, Hkv, M, D)]
    if layout == "bnhd":
        shapes = [(B, n, h, d) for B, h, n, d in shapes]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


@pytest.fixture(autouse=True)
def no_kept_plans():
    cleared()
    yield
    cleared()


def cleared():
    """Every plan and everything the backends keep by a problem's ``plan_key``: nothing a plan derived is reused."""
    from elastic_np._contract import _problem
    from elastic_np.cpu._decode import plan as decode_plan
    from elastic_np.cpu._prefill import plan as prefill_plan

    for kept in (plans.PLANS, plans.FAMILIES, paged_plans.PLANS, _problem._FIELDS, prefill_plan._KEPT,
                 decode_plan._PLANS):
        kept.clear()


def in_full(q, k, v, **options):
    """`attention` validated and run in full: the plans it keeps, and what they derived, cleared first."""
    cleared()
    return enp.attention(q, k, v, **options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_a_plan_runs_the_bits_of_a_call(case, dtype):
    H, Hkv, N, M, D, options = case
    q, k, v = arrays(H, Hkv, N, M, D, dtype, options.get("layout", "bhnd"))
    made = enp.plan(q.shape, k.shape, v.shape, dtype=dtype, return_lse=True, backend="cpu", **options)
    for seed in range(2):
        q, k, v = arrays(H, Hkv, N, M, D, dtype, options.get("layout", "bhnd"), seed)
        out, lse = made.run(q, k, v)
        want, want_lse = in_full(q, k, v, return_lse=True, backend="cpu", **options)
        assert out.shape == want.shape and out.dtype == want.dtype and out.strides == want.strides
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(lse, want_lse)


@pytest.mark.parametrize("case", CASES)
def test_attention_runs_a_layout_it_has_met_through_its_plan_with_the_same_bits(case, monkeypatch):
    from elastic_np._api import dispatch

    H, Hkv, N, M, D, options = case
    layout = options.get("layout", "bhnd")
    validated = []
    monkeypatch.setattr(dispatch, "validated", lambda *a, run=dispatch.validated: validated.append(1) or run(*a))
    enp.attention(*arrays(H, Hkv, N, M, D, np.float32, layout), backend="cpu", **options)
    q, k, v = arrays(H, Hkv, N, M, D, np.float32, layout, seed=1)
    got = enp.attention(q, k, v, backend="cpu", **options)
    assert len(validated) == 1 and len(plans.PLANS) == 1  # the second call was looked up
    np.testing.assert_array_equal(got, in_full(q, k, v, backend="cpu", **options))


def test_the_call_key_tells_apart_what_the_call_does():
    q, k, v = arrays(4, 2, 1, 20, 8, np.float32)
    key = lambda *a, **o: plans.key(*a, **o)  # noqa: E731
    base = (None, False, None, "array", None, False, 1.0, 0.0, None, None, None, None, None, "bhnd", False, "cpu")
    floats = (None, 1.0, 0.0, None)
    one = key(q, k, v, base, floats, (-1, -1))
    assert one is not None and one == key(q.copy(), k.copy(), v.copy(), base, floats, (-1, -1))
    changed = base[:1] + (1,) + base[2:]  # causal=1 is not causal=True: it is an error
    assert key(q, k, v, changed, floats, (-1, -1)) != key(q, k, v, base[:1] + (True,) + base[2:], floats, (-1, -1))
    assert key(q, k, v, base, (-0.0, 1.0, 0.0, None), (-1, -1)) is None  # a negative zero scale
    assert key(q, k, v, base, floats, (-1.0, -1)) is None and key(q, k, v, base, floats, [-1, -1]) is None
    assert key(q, k, v, base[:4] + (np.ones((1, 1, 1, 20), bool),) + base[5:], floats, (-1, -1)) is None
    assert key(q.tolist(), k, v, base, floats, (-1, -1)) is None
    assert key(q.astype(">f4"), k, v, base, floats, (-1, -1)) != one
    assert key(np.asfortranarray(q), k, v, base, floats, (-1, -1)) != one


def test_a_kept_plan_raises_what_a_call_in_full_raises():
    q, k, v = arrays(8, 2, 1, 64, 16, np.float32)
    enp.attention(q, k, v, backend="cpu", causal=True)
    with pytest.raises(TypeError, match="causal"):
        enp.attention(q, k, v, backend="cpu", causal=1)
    for name, at in (("q", 0), ("k", 1), ("v", 2)):
        bad = [q, k, v]
        bad[at] = bad[at].copy()
        bad[at][0, 1, 0, 3] = np.nan
        with pytest.raises(ValueError, match=f"`{name}` contains NaN or inf"):
            enp.attention(*bad, backend="cpu", causal=True)
    assert len(plans.PLANS) == 1


@pytest.mark.parametrize("N, M, layout", [(1, 40, "bhnd"), (3, 40, "bnhd"), (1, 0, "bhnd"), (16, 40, "bhnd"),
                                          (40, 40, "bhnd")])
def test_a_plan_finds_every_bad_query(N, M, layout):
    """The stacked-rows decode kernel checks ``q`` through its raw products (`_check_unread_cache`); the others,
    and a cache of no keys, in Python: every NaN and inf, wherever it lies, is the error a call in full gives."""
    q, k, v = arrays(4, 2, N, M, 8, np.float32, layout)
    made = enp.plan(q.shape, k.shape, backend="cpu", layout=layout)
    made.run(q, k, v)
    zero_entry = k.copy()
    zero_entry[..., 5] = 0.0  # inf q . k there: a NaN product, not an inf one
    for bad in (np.nan, np.inf, -np.inf):
        for at in ((0, 0, 0, 0), (1, 3, N - 1, 5), (1, 2, N // 2, 3)):  # (b, h, i, d)
            for keys in (k, zero_entry):
                q_bad = q.copy()
                (q_bad.swapaxes(1, 2) if layout == "bnhd" else q_bad)[at] = bad
                with pytest.raises(ValueError, match="`q` contains NaN or inf"):
                    made.run(q_bad, keys, v)
    if M:
        k_bad = k.copy()
        k_bad[0, 0, 0, 0] = np.nan
        with pytest.raises(ValueError, match="`q` contains NaN or inf"):  # q's before the keys', as a call in full
            made.run(q_bad, k_bad, v)


def test_a_plan_checks_the_arrays_that_change():
    made = enp.plan((1, 4, 1, 8), (1, 2, 30, 8), backend="cpu")
    q, k, v = arrays(4, 2, 1, 30, 8, np.float32)
    with pytest.raises(ValueError, match=r"`k` has shape \(2, 2, 30, 8\); this plan runs \(1, 2, 30, 8\)"):
        made.run(q[:1], k, v[:1])
    with pytest.raises(TypeError, match="`v` has dtype float64; this plan runs float32"):
        made.run(q[:1], k[:1], v[:1].astype(np.float64))
    q = q[:1].copy()
    q[0, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="`q` contains NaN or inf"):
        made.run(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="query heads H=3"):
        enp.plan((1, 3, 1, 8), (1, 2, 30, 8), backend="cpu")
    with pytest.raises(TypeError, match="`q_shape` must be a tuple of ints"):
        enp.plan((1, 4.0, 1, 8), (1, 2, 30, 8), backend="cpu")
    with pytest.raises(TypeError, match="unexpected keyword argument 'is_causal'"):
        enp.plan((1, 4, 1, 8), (1, 2, 30, 8), is_causal=True)
    with pytest.raises(ValueError, match="reference"):
        enp.plan((1, 4, 1, 8), (1, 2, 30, 8), backend="reference")


def test_a_plan_reads_any_memory_layout_of_its_shapes():
    made = enp.plan((2, 4, 3, 8), (2, 2, 30, 8), backend="cpu", causal=True, align="kv_lengths")
    q, k, v = arrays(4, 2, 3, 30, 8, np.float32)
    want = in_full(q, k, v, backend="cpu", causal=True, align="kv_lengths")
    strided = [np.asfortranarray(a) for a in (q, k, v)]
    bnhd = [np.ascontiguousarray(a.swapaxes(1, 2)).swapaxes(1, 2) for a in (q, k, v)]
    read_only = [a.copy() for a in (q, k, v)]
    for a in read_only:
        a.flags.writeable = False
    for given in (strided, bnhd, read_only):
        np.testing.assert_array_equal(made.run(*given), want)


def test_a_plan_keeps_no_array_of_a_call():
    q, k, v = arrays(8, 2, 1, 64, 16, np.float32)
    gone = [weakref.ref(a) for a in (q, k, v)]
    enp.attention(q, k, v, backend="cpu")
    del q, k, v
    gc.collect()
    assert plans.PLANS and all(ref() is None for ref in gone)


def test_threads_running_one_plan_get_the_bits_of_calls_one_by_one():
    made = enp.plan((1, 8, 1, 16), (1, 2, 200, 16), backend="cpu", return_lse=True)
    inputs = [arrays(8, 2, 1, 200, 16, np.float32, seed=s) for s in range(8)]
    inputs = [[a[:1] for a in arrays_] for arrays_ in inputs]
    want = [in_full(*a, backend="cpu", return_lse=True) for a in inputs]
    got = [None] * len(inputs)

    def work(at):
        for _ in range(50):
            got[at] = made.run(*inputs[at])

    threads = [threading.Thread(target=work, args=(at,)) for at in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (out, lse), (want_out, want_lse) in zip(got, want):
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(lse, want_lse)


def test_a_kept_plan_chooses_its_kernel_on_every_call(monkeypatch):
    from elastic_np.cpu._prefill import forward as prefill

    q, k, v = arrays(8, 2, 1, 64, 16, np.float32)
    want = enp.attention(q, k, v, backend="cpu")
    ran = []
    monkeypatch.setattr(prefill, "forward", lambda problem, run=prefill.forward: ran.append(1) or run(problem))
    monkeypatch.setattr(config, "DECODE_MAX_QUERIES", 0)
    got = enp.attention(q, k, v, backend="cpu")
    assert ran and len(plans.PLANS) == 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # the prefill's rounding, not the decode's


def test_a_plan_says_what_it_runs():
    made = enp.plan((1, 4, 1, 8), (1, 2, 30, 8), dtype=np.float64, backend="cpu", causal=True)
    assert repr(made) == "Plan(q (1, 4, 1, 8), k (1, 2, 30, 8), v (1, 2, 30, 8), float64, causal=True, backend='cpu')"
    assert made.shapes == ((1, 4, 1, 8), (1, 2, 30, 8), (1, 2, 30, 8)) and made.dtype == np.float64


def backward_in_full(*arrays, **options):
    cleared()
    return enp.attention_backward(*arrays, **options)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_a_backward_of_a_layout_met_before_is_looked_up_with_the_same_bits(case, dtype, monkeypatch):
    from elastic_np._api import dispatch

    H, Hkv, N, M, D, options = case
    layout = options.get("layout", "bhnd")
    calls = []
    for seed in range(3):
        q, k, v = arrays(H, Hkv, N, M, D, dtype, layout, seed)
        out, lse = in_full(q, k, v, return_lse=True, backend="cpu", **options)
        rng = np.random.default_rng(seed)
        dout = rng.standard_normal(out.shape).astype(dtype)
        dlse = None if seed < 2 else rng.standard_normal(lse.shape).astype(lse.dtype)  # a first dlse at the end
        calls.append(((dout, q, k, v, out, lse), dlse, backward_in_full(dout, q, k, v, out, lse, dlse=dlse,
                                                                        backend="cpu", **options)))
    cleared()
    validated = []
    monkeypatch.setattr(dispatch, "validated", lambda *a, run=dispatch.validated: validated.append(1) or run(*a))
    for given, dlse, want in calls:
        got = enp.attention_backward(*given, dlse=dlse, backend="cpu", **options)
        for name in ("dq", "dk", "dv", "dtau", "dbeta"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert got.dq.strides == want.dq.strides
    assert len(validated) == 1  # the first call in full, the others looked up


def test_a_backward_looked_up_raises_what_a_call_in_full_raises():
    q, k, v = arrays(8, 2, 1, 64, 16, np.float32)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu")
    dout = np.ones_like(out)

    def looked_up(*args):
        """The backward of ``args`` through the plan of a backward of the same layout (made anew: the calls in
        full clear the plans)."""
        enp.attention_backward(dout, q, k, v, out, lse, backend="cpu")
        assert any(isinstance(plan, plans.BackwardPlan) for plan in plans.PLANS.values())
        return enp.attention_backward(*args, backend="cpu")

    bad = dout.copy()
    bad[0, 0, 0, 0] = np.nan
    inf_out, nan_lse, inf_lse = out.copy(), lse.copy(), lse.copy()
    inf_out[0, 1, 0, 3], nan_lse[0, 2, 0], inf_lse[0, 3, 0] = np.inf, np.nan, np.inf
    nan_q, inf_k, nan_v = q.copy(), k.copy(), v.copy()
    nan_q[1, 3, 0, 5], inf_k[1, 1, 63, 2], nan_v[0, 0, 7, 15] = np.nan, -np.inf, np.nan
    for args, match in (((dout, nan_q, k, v, out, lse), "`q` contains NaN or inf"),
                        ((dout, q, inf_k, v, out, lse), "`k` contains NaN or inf"),
                        ((dout, q, k, nan_v, out, lse), "`v` contains NaN or inf"),
                        ((bad, q, k, v, out, lse), "`dout` contains NaN"),
                        ((dout, q, k, v, inf_out, lse), "`out` contains NaN or inf"),
                        ((dout, q, k, v, out, nan_lse), "`lse` contains NaN or inf"),
                        ((dout, q, k, v, out, inf_lse), "`lse` contains NaN or inf"),
                        ((dout, q, k, v, out, lse[..., :0]), "`lse`"),
                        ((dout, q, k, v, out, lse.astype(np.float64)), "`lse` has dtype float64"),
                        ((dout, q, k, v, out.astype(np.float64), lse), "`out`")):
        with pytest.raises((ValueError, TypeError), match=match):
            looked_up(*args)
        with pytest.raises((ValueError, TypeError), match=match):
            backward_in_full(*args, backend="cpu")
    # an lse of -inf (a row without a key) passes, and a strided dout is read, as in full
    empty_row = lse.copy()
    empty_row[0, 4, 0] = -np.inf
    strided = np.asfortranarray(np.random.default_rng(2).standard_normal(dout.shape).astype(np.float32))
    for args in ((dout, q, k, v, out, empty_row), (strided, q, k, v, out, lse)):
        looked_up_grads, full = looked_up(*args), backward_in_full(*args, backend="cpu")
        for name in ("dq", "dk", "dv", "dtau", "dbeta"):
            np.testing.assert_array_equal(getattr(looked_up_grads, name), getattr(full, name))


# (H, Hkv, N, D, options): the options whose fields depend on the number of keys, around their edges
GROWING = [
    (8, 2, 1, 16, {}),
    (4, 2, 3, 8, {"causal": True, "window_size": (5, 0)}),
    (4, 4, 2, 8, {"causal": True, "window_size": (0, 3), "align": "kv_lengths", "tau": 0.5, "beta": 1.0}),
    (4, 2, 16, 8, {"causal": True, "layout": "bnhd", "softcap": 5.0, "nvm": True, "scale": -0.5}),
    (2, 1, 20, 8, {"causal": True}),  # the prefill
]


@pytest.mark.parametrize("case", GROWING)
def test_a_growing_cache_runs_through_the_plans_of_its_earlier_lengths_with_the_same_bits(case, monkeypatch):
    from elastic_np._api import dispatch

    H, Hkv, N, D, options = case
    layout = options.get("layout", "bhnd")
    lengths = [0, 1, 2, 3, 5, 8, 9, 17, 40, 129, 300]
    calls = []
    for M in lengths:
        q, k, v = arrays(H, Hkv, N, M, D, np.float32, layout, seed=M)
        calls.append(((q, k, v), in_full(q, k, v, return_lse=True, backend="cpu", **options)))
    cleared()
    validated = []
    monkeypatch.setattr(dispatch, "validated", lambda *a, run=dispatch.validated: validated.append(1) or run(*a))
    for given, (want, want_lse) in calls:
        out, lse = enp.attention(*given, return_lse=True, backend="cpu", **options)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(lse, want_lse)
    assert len(validated) == 1  # the first length in full, every other from the plan before it


def test_a_growing_cache_raises_what_a_call_in_full_raises():
    q, k, v = arrays(8, 2, 1, 30, 16, np.float32)
    enp.attention(q, k, v, backend="cpu", window_size=(4, 0))
    _, k, v = arrays(8, 2, 1, 31, 16, np.float32)
    for bad, match in (((q, k, v[:, :, :30]), "`v` heads and length"),
                       ((q, k, v.astype(np.float64)), "share one dtype")):
        with pytest.raises((ValueError, TypeError), match=match):
            enp.attention(*bad, backend="cpu", window_size=(4, 0))
    k = k.copy()
    k[0, 1, 30, 0] = np.inf
    with pytest.raises(ValueError, match="`k` contains NaN or inf"):
        enp.attention(q, k, v, backend="cpu", window_size=(4, 0))


def test_the_plans_of_a_growing_cache_hold_no_chain_of_earlier_ones():
    """Counted against what the process held before (objects other tests left, which are not the plans')."""
    cleared()
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) in (plans.Plan, AttentionProblem)}

    def new_objects(kind):
        return [o for o in gc.get_objects() if type(o) is kind and id(o) not in before]

    q = arrays(8, 2, 1, 1, 16, np.float32)[0]
    for M in range(1, 150):
        k = np.ones((2, 2, M, 16), np.float32)
        for _ in range(2):  # two layers a step: the second runs the plan the first made
            enp.attention(q, k, k, backend="cpu")
    gc.collect()
    kept = len(plans.PLANS) + len(plans.FAMILIES)
    assert len(new_objects(plans.Plan)) <= kept
    assert len(new_objects(AttentionProblem)) <= kept
    cleared()
    gc.collect()
    assert not new_objects(plans.Plan) and not new_objects(AttentionProblem)


@pytest.mark.skipif(not numba_private.enabled("direct_calls"), reason="calls go through the dispatchers")
def test_a_growing_cache_called_once_a_length_finds_its_kernels_entry_points_from_its_second_length(monkeypatch):
    """One layer a step: every length's plan runs once, and the family's launchers share their entry points."""
    from numba.core.registry import CPUDispatcher

    from elastic_np.cpu._decode import decode

    launchers = []
    make = decode._launcher
    monkeypatch.setattr(decode, "_launcher", lambda *a, **kw: launchers.append(make(*a, **kw)) or launchers[-1])
    q = arrays(8, 2, 1, 1, 16, np.float32)[0]
    keys = [arrays(8, 2, 1, M, 16, np.float32, seed=M)[1] for M in range(20, 26)]
    wants = [in_full(q, k, k, backend="cpu") for k in keys]
    cleared()
    launchers.clear()
    for k, want in zip(keys, wants):
        np.testing.assert_array_equal(enp.attention(q, k, k, backend="cpu"), want)
    # the decode kernel's entry point (a split a kv head: the kernel finishes the rows, no merge runs)
    direct = [not isinstance(launch.calls[0], CPUDispatcher) for launch in launchers]
    assert direct[-3:] == [True] * 3, direct


def test_a_plan_that_calls_its_kernels_directly_reads_unaligned_and_read_only_arrays_of_its_key():
    q, k, v = arrays(8, 2, 1, 64, 16, np.float32)
    want = in_full(q, k, v, backend="cpu")
    for _ in range(3):  # from the plan's second run on, its kernels' entry points (of aligned, writeable arrays)
        enp.attention(q, k, v, backend="cpu")
    unaligned = np.frombuffer(bytearray(k.nbytes + 1), dtype=np.float32, count=k.size, offset=1).reshape(k.shape)
    unaligned[...] = k
    read_only = v.copy()
    read_only.flags.writeable = False
    assert not unaligned.flags.aligned and unaligned.strides == k.strides
    np.testing.assert_array_equal(enp.attention(q, unaligned, read_only, backend="cpu"), want)


def test_a_forward_never_finds_a_backward_plan():
    q, k, v = arrays(8, 2, 1, 64, 16, np.float32)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu")
    enp.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="cpu")
    with pytest.raises(TypeError, match="return_lse"):
        enp.attention(q, k, v, return_lse="backward", backend="cpu")


def test_a_plan_follows_the_config_set_at_run_time(monkeypatch):
    q, k, v = arrays(2, 1, 1, 4096, 16, np.float32)
    q, k, v = q[:1], k[:1], v[:1]
    for _ in range(3):
        enp.attention(q, k, v, backend="cpu")
    monkeypatch.setattr(config, "DECODE_MIN_TASKS", 1)  # one key split instead of several: other bits
    got = enp.attention(q, k, v, backend="cpu")
    want = in_full(q, k, v, backend="cpu")
    np.testing.assert_array_equal(got, want)
