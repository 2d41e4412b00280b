"""What a call derives from its options and shapes alone is looked up by ``plan_key``: same bits, same checks."""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np._api import plans
from elastic_np._contract import _problem, _spec
from elastic_np.cpu._decode import plan as _decode_plan
from elastic_np.cpu._prefill import plan as _plan


def _arrays(N, M, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 4, N, 16)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, M, 16)).astype(dtype) for _ in range(2))
    return q, k, v


def _forget():
    plans.PLANS.clear()
    plans.FAMILIES.clear()
    _problem._FIELDS.clear()
    _plan._KEPT.clear()
    _decode_plan._PLANS.clear()


@pytest.mark.parametrize("N, M", [(1, 70), (16, 70), (40, 33)])
@pytest.mark.parametrize("options", [{}, {"causal": True, "tau": 0.7, "beta": 0.5, "nvm": True},
                                     {"softcap": 20.0, "window_size": (5, 3), "scale": 0.3}])
def test_a_looked_up_call_has_the_bits_of_a_fresh_one(N, M, options):
    q, k, v = _arrays(N, M)
    _forget()
    fresh = enp.attention(q, k, v, return_lse=True, backend="cpu", **options)
    fresh_grads = enp.attention_backward(np.ones_like(fresh[0]), q, k, v, *fresh, backend="cpu", **options)
    for _ in range(2):  # the second and third calls look their plan up
        again = enp.attention(q, k, v, return_lse=True, backend="cpu", **options)
        grads = enp.attention_backward(np.ones_like(again[0]), q, k, v, *again, backend="cpu", **options)
        for a, b in zip((*fresh, fresh_grads.dq, fresh_grads.dk, fresh_grads.dv, fresh_grads.dtau),
                        (*again, grads.dq, grads.dk, grads.dv, grads.dtau)):
            np.testing.assert_array_equal(a, b)
    assert _problem._FIELDS  # it was kept


def test_the_kept_fields_are_never_written():
    q, k, v = _arrays(1, 50)
    _forget()
    options = {"tau": 0.5, "beta": 1.5, "causal": True}
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **options)
    (kept,) = _problem._FIELDS.values()
    before = {name: np.copy(value) for name, value in kept.items() if isinstance(value, np.ndarray)}
    enp.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="cpu", **options)
    enp.attention_double_backward(q, k, v, np.ones_like(out), q, k, v, out, lse, backend="cpu", **options)
    enp.attention(q, k, v, backend="reference", **options)
    for name, value in before.items():
        np.testing.assert_array_equal(kept[name], value, err_msg=name)


def test_the_key_tells_types_and_the_sign_of_zero_apart():
    options = _spec.complete({}, "attention")
    assert _spec.fields_key({**options, "causal": True}) != _spec.fields_key({**options, "causal": 1})
    assert _spec.fields_key({**options, "tau": 1.0}) != _spec.fields_key({**options, "tau": 1})
    assert _spec.fields_key({**options, "beta": 0.0}) is not None
    assert _spec.fields_key({**options, "beta": -0.0}) is None
    assert _spec.fields_key({**options, "tau": np.float32(0.5)}) is None  # Python's scalars, NumPy's arrays
    assert _spec.fields_key({**options, "window_size": (3, True)}) is None
    # small arrays of the options whose fields copy them: by dtype, shape and values
    ones = _spec.fields_key({**options, "tau": np.ones(4)})
    assert ones == _spec.fields_key({**options, "tau": np.ones(4)}) != _spec.fields_key({**options, "tau": np.ones(3)})
    assert ones != _spec.fields_key({**options, "tau": np.ones(4, np.float32)})
    assert ones != _spec.fields_key({**options, "tau": np.array([1.0, 1.0, 1.0, 2.0])})
    assert _spec.fields_key({**options, "mask": np.ones((1, 1, 1, 1), bool)}) is None  # a view of it is kept
    assert _spec.fields_key({**options, "bias": np.ones((1, 1, 1, 1))}) is None
    assert _spec.fields_key({**options, "tau": np.ones(2000)}) is None
    assert _spec.fields_key({**options, "tau": np.array([1.0, 2.0], dtype=object)}) is None


def test_a_kept_plan_weakens_no_check():
    q, k, v = _arrays(1, 40)
    enp.attention(q, k, v, causal=True, backend="cpu")
    with pytest.raises(TypeError, match="causal"):
        enp.attention(q, k, v, causal=1, backend="cpu")
    bad = q.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="`q` contains NaN"):
        enp.attention(bad, k, v, causal=True, backend="cpu")
    bad = k.copy()
    bad[1, 1, 7, 3] = np.inf
    with pytest.raises(ValueError, match="`k` contains NaN or inf"):
        enp.attention(q, bad, v, causal=True, backend="cpu")
    with pytest.raises(TypeError, match="`k`"):
        enp.attention(q, k.astype(np.float64), v, causal=True, backend="cpu")
    with pytest.raises(ValueError, match="`tau` = 1e-300"):
        enp.attention(q, k, v, causal=True, tau=1e-300, backend="cpu")
    with pytest.raises(ValueError, match="does not take `precision`"):
        enp.attention(q, k, v, causal=True, precision="tf32", backend="cpu")


def test_an_array_changed_in_place_between_calls_is_read_anew():
    q, k, v = _arrays(1, 40)
    _forget()
    tau, lengths = np.array([0.5, 1.0, 2.0, 0.7]), np.array([40, 17])
    for _ in range(2):
        ours = enp.attention(q, k, v, tau=tau, kv_lengths=lengths, backend="cpu")
        exact = enp.attention(q, k, v, tau=tau, kv_lengths=lengths, backend="reference")
        np.testing.assert_allclose(ours, exact, rtol=1e-5, atol=1e-6)
        tau[2], lengths[1] = 0.25, 9  # the next call's values
    assert len(_decode_plan._PLANS) == 2


def test_a_mask_or_bias_is_not_kept_and_still_right():
    q, k, v = _arrays(1, 40)
    _forget()
    mask = np.ones((1, 1, 1, 40), bool)
    for _ in range(2):
        ours = enp.attention(q, k, v, mask=mask, backend="cpu")
        exact = enp.attention(q, k, v, mask=mask, backend="reference")
        np.testing.assert_allclose(ours, exact, rtol=1e-5, atol=1e-6)
        mask[..., 20:] = False
    assert not _problem._FIELDS and not _decode_plan._PLANS


def test_each_shape_has_its_own_plan_and_the_kept_ones_are_bounded():
    _forget()
    for M in range(1, 100):  # a decode loop: one key more each step
        q, k, v = _arrays(1, M, seed=M)
        ours = enp.attention(q, k, v, backend="cpu")
        exact = enp.attention(q, k, v, backend="reference")
        np.testing.assert_allclose(ours, exact, rtol=1e-5, atol=1e-6)
    assert 0 < len(_problem._FIELDS) <= _problem._FIELDS_KEPT
    assert 0 < len(_decode_plan._PLANS) <= 64


def test_kept_scratch_is_per_thread_and_shape_and_keeps_the_bits():
    import threading

    from elastic_np.cpu._runtime import scratch as _scratch

    mine = _scratch.scratch("probe", (2, 3), np.float32, np.zeros)
    assert _scratch.scratch("probe", (2, 3), np.float32) is mine
    assert _scratch.scratch("probe", (2, 4), np.float32) is not mine
    assert _scratch.scratch("other", (2, 3), np.float32) is not mine
    theirs = []
    worker = threading.Thread(target=lambda: theirs.append(_scratch.scratch("probe", (2, 3), np.float32)))
    worker.start()
    worker.join()
    assert theirs[0] is not mine
    assert _scratch.scratch("big", (_scratch.KEPT_BYTES + 1,), np.uint8) is not _scratch.scratch(
        "big", (_scratch.KEPT_BYTES + 1,), np.uint8)
    # backward calls of two query counts in turn, and from two threads at once: the bits of the first call
    cases = [_arrays(N, 30, np.float64, seed=N) for N in (5, 9)]
    first = []
    for q, k, v in cases:
        out, lse = enp.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
        first.append(enp.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True, backend="cpu"))
    results = {}

    def run(index):
        q, k, v = cases[index % 2]
        for _ in range(20):
            out, lse = enp.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
            grads = enp.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True, backend="cpu")
            results.setdefault(index, []).append(grads)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for index, runs in results.items():
        for grads in runs:
            for name in ("dq", "dk", "dv", "dtau", "dbeta"):
                np.testing.assert_array_equal(getattr(grads, name), getattr(first[index % 2], name))
    assert len(results) == 4
