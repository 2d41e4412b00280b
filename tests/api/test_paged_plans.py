"""A paged decoding step repeated with the same layout runs through its plan: the bits and the errors of a call in full."""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np._api import dispatch, paged_plans


def step(seed=0, dtype=np.float32, B=4, H=8, Hkv=2, D=16, block=16, N=1):
    rng = np.random.default_rng(seed)
    used = np.array([100, 37, 64, 90][:B])
    k, v = (rng.standard_normal((64, block, Hkv, D)).astype(dtype) for _ in range(2))
    table = rng.permutation(64)[:B * 8].astype(np.int32).reshape(B, 8)
    q = rng.standard_normal((B * N, H, D)).astype(dtype)
    return q, k, v, np.arange(0, B * N + 1, N, dtype=np.int32), table, used


def in_full(q, k, v, cu, table, used, **options):
    paged_plans.PLANS.clear()
    return enp.varlen_attention(q, k, v, cu, None, block_table=table, seqused_k=used, backend="cpu", **options)


@pytest.mark.parametrize("options", [{}, {"causal": True, "tau": 0.5, "beta": 1.0}, {"softcap": 10.0, "scale": 0.2},
                                     {"window_size": (20, 0), "causal": True}])
@pytest.mark.parametrize("dtype, N", [(np.float32, 1), (np.float64, 2), ("bfloat16", 1)])
def test_a_step_repeated_is_looked_up_with_the_bits_of_a_call_in_full(options, dtype, N, monkeypatch):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    calls = [step(seed, dtype, N=N) for seed in range(3)]
    layout = calls[0][3:]
    calls = [(q, k, v, *layout) for q, k, v, *_ in calls]  # one step's table and lengths, new arrays each layer
    want = [in_full(*call, return_lse=True, **options) for call in calls]
    paged_plans.PLANS.clear()
    validated = []
    monkeypatch.setattr(dispatch, "validated", lambda *a, run=dispatch.validated: validated.append(1) or run(*a))
    for call, (want_out, want_lse) in zip(calls, want):
        out, lse = enp.varlen_attention(*call[:4], None, block_table=call[4], seqused_k=call[5], return_lse=True,
                                        backend="cpu", **options)
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(lse, want_lse)
    assert len(validated) == 1 and len(paged_plans.PLANS) == 1


def test_a_looked_up_step_raises_what_a_call_in_full_raises():
    q, k, v, cu, table, used = step()
    enp.varlen_attention(q, k, v, cu, None, block_table=table, seqused_k=used, backend="cpu")
    bad_q = q.copy()
    bad_q[2, 1, 3] = np.nan
    read_page = table[1, 0]
    bad_k = k.copy()
    bad_k[read_page, 5, 1, 0] = np.inf
    for args, match in (((bad_q, k, v), "`q` contains NaN or inf"), ((q, bad_k, v), "`k` contains NaN or inf")):
        for full in (False, True):
            if full:
                paged_plans.PLANS.clear()
            with pytest.raises(ValueError, match=match):
                enp.varlen_attention(*args, cu, None, block_table=table, seqused_k=used, backend="cpu")
    unread = k.copy()
    unread[np.setdiff1d(np.arange(64), table)[0]] = np.nan  # a page no sequence reads: never read, never checked
    np.testing.assert_array_equal(enp.varlen_attention(q, unread, v, cu, None, block_table=table, seqused_k=used,
                                                       backend="cpu"), in_full(q, k, v, cu, table, used))


def test_a_table_changed_in_place_is_checked_again():
    q, k, v, cu, table, used = step()
    enp.varlen_attention(q, k, v, cu, None, block_table=table, seqused_k=used, backend="cpu")
    table[2, 1] = table[2, 0]  # a page named twice: an error, not the plan of the table it was
    with pytest.raises(ValueError, match="names page .* twice"):
        enp.varlen_attention(q, k, v, cu, None, block_table=table, seqused_k=used, backend="cpu")
    used = used.copy()
    used[0] = 8 * 16 + 1  # more keys than its pages hold
    table[2, 1] += 1
    with pytest.raises(ValueError, match="seqused_k"):
        enp.varlen_attention(q, k, v, cu, None, block_table=table, seqused_k=used, backend="cpu")


def test_what_is_not_looked_up():
    q, k, v, cu, table, used = step()
    key = lambda **o: paged_plans.key(q, k, v, cu, None, None, None, table, used, False, "cpu",  # noqa: E731
                                      {**enp._contract._spec.DEFAULTS, **o})
    assert key() is not None
    assert paged_plans.key(q, k, v, cu, cu, None, None, table, used, False, "cpu", dict(enp._contract._spec.DEFAULTS)) is None
    assert paged_plans.key(q, k, v, cu.tolist(), None, None, None, table, used, False, "cpu",
                           dict(enp._contract._spec.DEFAULTS)) is None
    assert paged_plans.key(q, np.asfortranarray(k), v, cu, None, None, None, table, used, False, "cpu",
                           dict(enp._contract._spec.DEFAULTS)) is None
    assert key(tau=np.ones(8)) is None and key(causal=1) != key(causal=True)
    assert paged_plans.key(q, k, v, cu, None, None, None, table, used, "yes", "cpu",
                           dict(enp._contract._spec.DEFAULTS)) is None
