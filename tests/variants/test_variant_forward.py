"""A user's ``score_mod``, ``mask_mod`` and block mask in the forward: the built-ins rewritten give the built-ins'
results (float64 within 1e-12, float32 within the float32 rule), on the CPU kernels and the reference."""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np._contract import _problem
from elastic_np._variants.variant import make_variant
from elastic_np.reference import _attention
from elastic_np.testing import _tolerances
from oracle_checks import assert_matches_oracle
from variant_cases import BIAS, MASK_CASES, SCORE_CASES, B, H, M, N, inputs, rule_mask, softcap


def naive_float32(q, k, v, options, variant):
    """The reference's formula evaluated in float32, with the variant: the float32 rule's naive error."""
    p = _problem.prepare(q, k, v, dtypes=("float32",), **options)
    made = make_variant(**variant)
    return _attention._forward(p if made is None else p.with_variant(made))


def check_forward(dtype, variant, builtin, backend="cpu", **more):
    q, k, v = inputs(dtype)
    got = enp.attention(q, k, v, backend=backend, **variant, **more)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    want = enp.reference.attention(q64, k64, v64, **builtin, **more)[0]
    if dtype == np.float64:
        assert_matches_oracle("out", got, want, dtype)
    else:
        bias = {"bias": builtin["bias"].astype(np.float32)} if "bias" in builtin else {}
        naive = naive_float32(q, k, v, {**builtin, **bias, **more}, {})
        allowed, _ = _tolerances.float32_allowed(want, [naive])
        assert np.abs(got - want).max() <= allowed


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", sorted(SCORE_CASES))
def test_a_built_in_modifier_written_as_score_mod_gives_the_built_ins_result_in_float64(name, backend):
    variant, builtin = SCORE_CASES[name]
    check_forward(np.float64, variant, builtin, backend)


@pytest.mark.parametrize("name", ["softcap", "bias"])
def test_a_built_in_modifier_written_as_score_mod_holds_the_float32_rule(name):
    variant, builtin = SCORE_CASES[name]
    check_forward(np.float32, variant, builtin)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", sorted(MASK_CASES))
def test_a_built_in_mask_written_as_mask_mod_gives_the_built_ins_result(name, backend):
    variant, builtin = MASK_CASES[name]
    check_forward(np.float64, variant, builtin, backend)
    check_forward(np.float64, variant, builtin, backend, tau=0.7, beta=0.3, nvm=True)


@pytest.mark.parametrize("name", ["causal", "kv_lengths"])
def test_a_mask_mod_with_its_block_mask_gives_the_built_ins_result_at_every_block_size(name):
    variant, builtin = MASK_CASES[name]
    captures = variant.get("captures", ())
    for size in (8, (16, 4), 128):
        block_mask = enp.create_block_mask(variant["mask_mod"], B, H, N, M, captures=captures, block_size=size)
        check_forward(np.float64, {"block_mask": block_mask, "captures": captures}, builtin)


def test_a_score_mod_follows_the_built_in_modifiers_and_nvm_tests_its_result():
    """score_mod after the soft-cap and the bias; NVM removes what score_mod makes negative."""
    q, k, v = inputs()
    options = dict(softcap=1.5, bias=BIAS - 0.3, nvm=True, tau=np.array([0.5, 1.0, 2.0, 0.8]), beta=0.2)
    got = enp.attention(q, k, v, score_mod=softcap, backend="cpu", **options)
    want = enp.attention(q, k, v, score_mod=softcap, backend="reference", **options)
    assert_matches_oracle("out", got, want, np.float64)
    without = enp.attention(q, k, v, backend="reference", **options)
    assert np.abs(want - without).max() > 1e-3


def test_a_score_mod_returning_minus_inf_removes_the_entry_and_a_minus_inf_bias_stays_removed():
    def drop_odd(score, b, h, q_idx, kv_idx):
        return np.where(kv_idx % 2 == 1, -np.inf, score * 0.0 + 1.0)  # would revive a removed entry

    q, k, v = inputs()
    bias = np.where(np.arange(M) % 4 == 0, -np.inf, 0.0)
    got, lse = enp.attention(q, k, v, score_mod=drop_odd, bias=bias, return_lse=True, backend="cpu")
    want, want_lse = enp.attention(q, k, v, score_mod=drop_odd, bias=bias, return_lse=True, backend="reference")
    assert_matches_oracle("out", got, want, np.float64)
    kept = (np.arange(M) % 2 == 0) & (np.arange(M) % 4 != 0)
    np.testing.assert_allclose(want, np.broadcast_to(v[:, :, kept].mean(axis=2)[:, :, None].repeat(2, 1), want.shape),
                               rtol=1e-12)


def test_a_document_mask_with_a_block_mask_skips_blocks_and_equals_a_dense_boolean_mask():
    n = 300  # (N = M: rule_mask's documents)
    docs = np.repeat(np.arange(6), 50)
    rule = np.concatenate([[3], docs])
    block_mask = enp.create_block_mask(rule_mask, None, None, n, n, captures=(rule,), block_size=32)
    assert 0.5 < block_mask.sparsity < 1.0
    q, k, v = inputs(n=n, m=n)
    dense = docs[:, None] == docs[None, :]
    got = enp.attention(q, k, v, block_mask=block_mask, captures=(rule,), backend="cpu")
    want = enp.attention(q, k, v, mask=dense, backend="cpu")
    np.testing.assert_array_equal(got, want)


def test_bfloat16_takes_a_score_mod():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = inputs(np.float32)
    want = enp.attention(q, k, v, softcap=2.0, backend="cpu")
    half = [a.astype(ml_dtypes.bfloat16) for a in (q, k, v)]
    got = enp.attention(*half, score_mod=softcap, backend="cpu")
    assert got.dtype == half[0].dtype
    assert np.abs(got.astype(np.float32) - want).max() < 0.05


def test_the_block_mask_reports_its_blocks():
    block_mask = enp.create_block_mask(rule_mask, None, 2, N, M, captures=(np.array([0]),), block_size=16)
    assert block_mask.shape == (1, 2, N, M) and block_mask.block_size == (16, 16)
    assert block_mask.states.shape == (1, 2, 3, 3)
    assert not block_mask.states.flags.writeable
    assert "BlockMask(" in repr(block_mask)
