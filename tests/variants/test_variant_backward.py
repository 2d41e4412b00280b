"""A user's ``score_mod`` in the backward: the built-ins rewritten give the built-ins' gradients, the captures'
gradients agree with finite differences of the oracle, the same bits on every thread count."""

import numba
import numpy as np
import pytest

import elastic_np as enp
from elastic_np.cpu._runtime import config
from elastic_np.testing import gradcheck
from oracle_checks import assert_matches_oracle
from variant_cases import BIAS, MASK_CASES, SCORE_CASES, SLOPES, B, H, M, N, inputs, rel_bias

GRADS = ("dq", "dk", "dv", "dtau", "dbeta")


def grads_of(backend, q, k, v, dout, variant, options):
    out, lse = enp.attention(q, k, v, return_lse=True, backend=backend, **variant, **options)
    return out, enp.attention_backward(dout, q, k, v, out, lse, backend=backend, **variant, **options)


def dout_like(q, seed=1):
    return np.random.default_rng(seed).standard_normal(q.shape).astype(q.dtype)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", sorted(SCORE_CASES))
def test_a_score_mod_rewriting_a_built_in_gives_its_gradients_in_float64(name, backend):
    variant, builtin = SCORE_CASES[name]
    q, k, v = inputs()
    dout = dout_like(q)
    options = dict(tau=np.array([0.7, 1.0, 1.3, 2.0]), beta=0.25)
    _, got = grads_of(backend, q, k, v, dout, variant, options)
    _, want = grads_of("reference", q, k, v, dout, builtin, options)
    for field in GRADS:
        assert_matches_oracle(field, getattr(got, field), getattr(want, field), np.float64)
    if name == "bias":  # the capture's gradient is the bias's
        assert_matches_oracle("dbias", got.dcaptures[1], want.dbias, np.float64)
    elif name == "alibi":
        assert got.dcaptures[0].shape == SLOPES.shape


@pytest.mark.parametrize("name", sorted(MASK_CASES))
def test_a_mask_mod_and_its_block_mask_give_the_built_in_masks_gradients(name, small_tiles):
    """On tiles of 8 queries (10 keys in the backward) and blocks of 4: a key tile's query tiles that the block
    mask empties at either end of its span are left out, the others kept."""
    variant, builtin = MASK_CASES[name]
    q, k, v = inputs()
    dout = dout_like(q)
    captures = variant.get("captures", ())
    block_mask = enp.create_block_mask(variant["mask_mod"], B, H, N, M, captures=captures, block_size=4)
    _, want = grads_of("reference", q, k, v, dout, builtin, {})
    _, got = grads_of("cpu", q, k, v, dout, {"block_mask": block_mask, "captures": captures}, {})
    for field in GRADS[:3]:  # (without the block mask: the same tiles' code, which the forward's tests cover)
        assert_matches_oracle(field, getattr(got, field), getattr(want, field), np.float64)


def test_a_captures_gradient_agrees_with_finite_differences_of_the_oracle():
    """(T5's buckets, a larger graph, are held to finite differences in test_derivative.py.)"""
    score_mod = rel_bias
    q, k, v = (a[:, :, :9] for a in inputs(n=N, m=N))  # 9 queries and keys: few entries to move one by one
    table = np.random.default_rng(5).standard_normal((H, N + N - 1))
    dout = dout_like(q)
    _, grads = grads_of("cpu", q, k, v, dout, dict(score_mod=score_mod, captures=(table,)), dict(causal=True))

    def loss(table):
        return enp.reference.attention(q, k, v, score_mod=score_mod, captures=(table,), causal=True)[0]

    gradcheck(loss, {"table": table}, {"table": grads.dcaptures[0]}, dout=dout, rtol=1e-6)
    _, ref = grads_of("reference", q, k, v, dout, dict(score_mod=score_mod, captures=(table,)), dict(causal=True))
    assert_matches_oracle("dtable", grads.dcaptures[0], ref.dcaptures[0], np.float64)


def test_the_captures_gradients_have_the_same_bits_on_every_thread_count(monkeypatch):
    q, k, v = inputs(n=160, m=300)
    table = np.random.default_rng(5).standard_normal((H, 160 + 300 - 1))
    dout = dout_like(q)
    monkeypatch.setattr(config, "SERIAL_WORK", 0)
    results = []
    before = numba.get_num_threads()
    try:
        for threads in (1, 2):  # rel_bias's table read at kv_idx - q_idx + N - 1, within this larger one
            numba.set_num_threads(threads)
            results.append(grads_of("cpu", q, k, v, dout, dict(score_mod=rel_bias, captures=(table,)), {})[1])
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(results[0].dcaptures[0], results[1].dcaptures[0])
    np.testing.assert_array_equal(results[0].dq, results[1].dq)


def test_float32_gradients_of_a_score_mod_hold_the_float32_rule_of_the_built_in():
    q, k, v = inputs(np.float32)
    dout = dout_like(q)
    q64, k64, v64, d64 = (a.astype(np.float64) for a in (q, k, v, dout))
    _, got = grads_of("cpu", q, k, v, dout, SCORE_CASES["softcap"][0], {})
    _, builtin = grads_of("cpu", q, k, v, dout, {}, dict(softcap=2.0))
    _, want = grads_of("reference", q64, k64, v64, d64, {}, dict(softcap=2.0))
    for field in GRADS[:3]:
        worst_builtin = np.abs(getattr(builtin, field) - getattr(want, field)).max()
        worst = np.abs(getattr(got, field) - getattr(want, field)).max()
        assert worst <= 2 * worst_builtin + 1e-6


def test_a_score_mod_the_derivative_cannot_follow_is_an_error_at_the_backward_naming_it():
    def branchy(score, b, h, q_idx, kv_idx):
        if score > 0:
            return score
        return 0.5 * score

    q, k, v = inputs()
    out, lse = enp.attention(q, k, v, score_mod=branchy, return_lse=True, backend="reference")  # the forward runs
    for backend in ("cpu", "reference"):
        with pytest.raises(TypeError, match="score_mod.*numpy.where"):
            enp.attention_backward(dout_like(q), q, k, v, out, lse, score_mod=branchy, backend=backend)


def test_a_bias_capture_matches_the_bias_options_gradient_under_every_option():
    q, k, v = inputs()
    dout = dout_like(q)
    options = dict(softcap=3.0, nvm=True, window_size=(20, 4), tau=0.9, beta=0.1)
    _, got = grads_of("cpu", q, k, v, dout, SCORE_CASES["bias"][0], options)
    _, want = grads_of("reference", q, k, v, dout, {}, dict(options, bias=BIAS))
    assert_matches_oracle("dbias", got.dcaptures[1], want.dbias, np.float64)
    for field in GRADS:
        assert_matches_oracle(field, getattr(got, field), getattr(want, field), np.float64)
