"""Bad user variants: each a clear error naming what is wrong, on the CPU kernels and the reference; nothing mutated."""

import math

import numpy as np
import pytest

import elastic_np as enp
from variant_cases import B, H, M, N, inputs, rel_bias, rule_mask, softcap

BACKENDS = ["cpu", "reference"]


def forward(backend, **variant):
    q, k, v = inputs()
    return enp.attention(q, k, v, backend=backend, **variant)


def returns_tuple(score, b, h, q_idx, kv_idx):
    return score, score


def misbehaves(score, b, h, q_idx, kv_idx, how):
    """Raises (``how[0] == 1``) or gives NaN (``how[0] == 2``) at key 3: one function, one compile."""
    if kv_idx == 3 and how[0] == 1:
        raise ValueError("this score_mod refuses")
    return score if kv_idx != 3 or how[0] != 2 else math.nan


def float_mask(b, h, q_idx, kv_idx):
    return 1.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_score_mod_returning_no_number_is_a_type_error_naming_it(backend):
    with pytest.raises(TypeError, match="score_mod"):
        forward(backend, score_mod=returns_tuple)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_score_mod_that_raises_raises_its_error(backend):
    with pytest.raises(ValueError, match="this score_mod refuses"):
        forward(backend, score_mod=misbehaves, captures=(np.array([1]),))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_score_mod_giving_nan_to_a_kept_entry_is_an_error(backend):
    with pytest.raises(ValueError, match="score_mod.*NaN"):
        forward(backend, score_mod=misbehaves, captures=(np.array([2]),))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mask_mod_returning_no_bool_is_a_type_error_naming_it(backend):
    with pytest.raises(TypeError, match="mask_mod.*bool"):
        forward(backend, mask_mod=float_mask)
    with pytest.raises(TypeError, match="mask_mod.*bool"):
        enp.create_block_mask(float_mask, 1, 1, 4, 4)


@pytest.mark.parametrize(
    "captures,error,match",
    [
        ((np.ones(3, dtype=np.complex128),), TypeError, r"captures\[0\]. has dtype complex128"),
        ((np.ones(3), np.ones(3, dtype=np.float16)), TypeError, r"captures\[1\]. has dtype float16"),
        ((np.float64(2.0),), ValueError, r"captures\[0\]. is a scalar"),
        ((np.array([1.0, np.nan]),), ValueError, r"captures\[0\]. contains NaN"),
        ((np.ones(3, dtype=">f8"),), TypeError, "byte order"),  # (checked before the dtype)
        (np.ones(3), TypeError, "must be a tuple of arrays"),
        ((np.array(["a"]),), TypeError, r"captures\[0\]. has dtype"),
    ],
)
def test_bad_captures_are_an_error_naming_the_entry(captures, error, match):
    with pytest.raises(error, match=match):
        forward("cpu", score_mod=softcap, captures=captures)


def test_captures_without_a_function_and_functions_that_are_not_functions_are_errors():
    with pytest.raises(ValueError, match="captures.*without"):
        forward("cpu", captures=(np.ones(2),))
    with pytest.raises(TypeError, match="score_mod.*function"):
        forward("cpu", score_mod=3.0)
    with pytest.raises(TypeError, match="block_mask.*BlockMask"):
        forward("cpu", block_mask=np.ones((1, 1, 1, 1), dtype=np.int8))


def test_a_block_mask_of_another_shape_function_or_captures_is_an_error_naming_it():
    causal = (np.array([0]),)
    other_shape = enp.create_block_mask(rule_mask, B, H, N + 1, M, captures=causal)
    with pytest.raises(ValueError, match="block_mask.*made for"):
        forward("cpu", block_mask=other_shape, captures=causal)

    def other(b, h, q_idx, kv_idx, rule):
        return True

    block_mask = enp.create_block_mask(rule_mask, B, H, N, M, captures=causal)
    with pytest.raises(ValueError, match="mask_mod.*not the function"):
        forward("cpu", block_mask=block_mask, mask_mod=other, captures=causal)
    with pytest.raises(ValueError, match="block_mask. was made with 1 .captures. and this call passes 2"):
        forward("cpu", block_mask=block_mask, captures=(*causal, np.ones(2)))


def test_the_cuda_backend_refuses_a_variant_naming_it_and_auto_runs_it_on_the_cpu():
    with pytest.raises(ValueError, match="backend 'cuda' does not take `score_mod`"):
        forward("cuda", score_mod=softcap)
    np.testing.assert_array_equal(forward("auto", score_mod=softcap), forward("cpu", score_mod=softcap))


def test_nothing_is_mutated_and_the_double_backward_refuses_a_variant():
    q, k, v = inputs()
    table = np.random.default_rng(0).standard_normal((H, N + M - 1))
    given = [a.copy() for a in (q, k, v, table)]

    rel = rel_bias
    out, lse = enp.attention(q, k, v, score_mod=rel, captures=(table,), return_lse=True, backend="cpu")
    dout = np.ones_like(out)
    enp.attention_backward(dout, q, k, v, out, lse, score_mod=rel, captures=(table,), backend="cpu")
    for before, after in zip(given, (q, k, v, table)):
        np.testing.assert_array_equal(before, after)
    with pytest.raises(TypeError, match="score_mod"):
        enp.attention_double_backward(None, None, None, dout, q, k, v, out, lse, score_mod=rel, captures=(table,))
