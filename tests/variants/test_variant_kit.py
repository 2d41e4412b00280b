"""A user's variant in the conformance kit and in `warmup`: the CPU kernels through the kit's variant case, and a
variant's kernels compiled ahead of its calls."""

import gc

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cpu
from elastic_np.cpu._prefill import backward, forward
from elastic_np._api import compile_report
from elastic_np.testing import _cases, backend_functions, check_attention

from variant_cases import H, inputs, rel_bias


def test_the_cpu_kernels_pass_the_kits_block_mask_case_in_float32():
    """One case (score_mod with a learnable table, a block mask): each compiles kernels of its own."""
    fn, backward = backend_functions("cpu")
    needs = {c.name: c.requires for c in _cases.CASES}["score_mod, block_mask"]
    report = check_attention(fn, backward=backward, options=needs, dtypes=[np.float32])
    assert report, str(report)
    assert {r.case for r in report.rows} == {"plain", "plain, N=20", "score_mod, block_mask"}  # plain needs nothing
    assert {r.quantity for r in report.rows if r.case == "score_mod, block_mask"} == {
        "out", "lse", "dq", "dk", "dv", "dcaptures[0]"}


def test_after_a_variant_warmup_its_calls_compile_nothing():
    table = np.random.default_rng(1).standard_normal((H, 200))
    report = enp.warmup(dtypes=["float64"], backend="cpu", score_mod=rel_bias, captures=(table,))
    assert ("float64", "variant") in report.seconds
    q, k, v = inputs(np.float64)
    with compile_report.watch() as seen:
        out, lse = enp.attention(q, k, v, score_mod=rel_bias, captures=(table,), causal=True, return_lse=True)
        grads = enp.attention_backward(np.ones_like(out), q, k, v, out, lse, score_mod=rel_bias,
                                       captures=(table,), causal=True)
    assert not seen.compiled
    assert grads.dcaptures[0].shape == table.shape


def test_a_variant_warmup_checks_the_variant_and_the_backend(monkeypatch):
    with pytest.raises(TypeError, match="`score_mod` must be a function"):
        enp.warmup(dtypes=["float64"], backend="cpu", score_mod="softcap")
    with pytest.raises(ValueError, match="`captures` are given without"):
        enp.warmup(dtypes=["float64"], backend="cpu", captures=(np.ones(3),))
    monkeypatch.setattr(cpu, "takes_variants", False)
    with pytest.raises(ValueError, match="backend 'cpu' does not take a user's `score_mod`"):
        enp.warmup(dtypes=["float64"], backend="cpu", score_mod=rel_bias, captures=(np.ones((H, 99)),))


def test_a_variants_kernels_stay_out_of_numbas_cache():
    """A signature holding a function is never saved: once the function is gone, saving the cache's index again
    (any later compile of the kernel) would fail, and another process could not load it."""
    q, k, v = inputs(np.float64, n=5, m=7)

    def gone(score, b, h, q_idx, kv_idx):
        return 0.5 * score

    out, lse = enp.attention(q, k, v, score_mod=gone, return_lse=True)
    enp.attention_backward(np.ones_like(out), q, k, v, out, lse, score_mod=gone)
    del gone
    gc.collect()

    def other(score, b, h, q_idx, kv_idx):
        return score + 1.0

    out, lse = enp.attention(q, k, v, score_mod=other, return_lse=True)
    enp.attention_backward(np.ones_like(out), q, k, v, out, lse, score_mod=other)
    np.testing.assert_allclose(out, enp.attention(q, k, v, backend="reference", score_mod=other))
    for kernel in (forward._forward_kernel, backward._backward_kernel):
        index = kernel._cache._cache_file._load_index()  # Numba's on-disk index: {(signature, target, stamps): file}
        assert not any("Dispatcher" in str(key[0]) for key in index), kernel
