"""A user's variant over a packed batch: ``b`` is the sequence, the indices count within it; the gradients of the
captures summed over the sequences."""

import numpy as np
import pytest

import elastic_np as enp
from oracle_checks import assert_matches_oracle

CU = np.array([0, 5, 12, 20])
H = 2


def per_sequence(score, b, h, q_idx, kv_idx, offsets, heads):
    return score + offsets[b, heads[h]]


def causal_within(b, h, q_idx, kv_idx, offsets, heads):
    return q_idx >= kv_idx


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_packed_batchs_score_mod_sees_each_sequence_as_b_and_gives_the_per_sequence_bias_result(backend):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((20, H, 4)) for _ in range(3))
    dout = rng.standard_normal((20, H, 4))
    offsets = rng.standard_normal((3, H)).astype(np.float32)  # a float32 capture, and an integer one
    lengths = np.diff(CU)
    bias = [np.broadcast_to(offsets[s][:, None, None], (H, n, n)).astype(np.float64) for s, n in enumerate(lengths)]
    variant = dict(score_mod=per_sequence, mask_mod=causal_within, captures=(offsets, np.arange(H)))
    out, lse = enp.varlen_attention(q, k, v, CU, CU, return_lse=True, backend=backend, **variant)
    want, want_lse = enp.varlen_attention(q, k, v, CU, CU, bias=bias, causal=True, return_lse=True,
                                          backend="reference")
    assert_matches_oracle("out", out, want, np.float64)
    grads = enp.varlen_attention_backward(dout, q, k, v, out, lse, CU, CU, backend=backend, **variant)
    want_grads = enp.varlen_attention_backward(dout, q, k, v, want, want_lse, CU, CU, bias=bias, causal=True,
                                               backend="reference")
    for name in ("dq", "dk", "dv"):
        assert_matches_oracle(name, getattr(grads, name), getattr(want_grads, name), np.float64)
    expected = np.stack([d.sum(axis=(1, 2)) for d in want_grads.dbias])
    assert grads.dcaptures[0].dtype == np.float32 and grads.dcaptures[1] is None  # in the capture's dtype; none
    np.testing.assert_allclose(grads.dcaptures[0], expected, rtol=1e-6, atol=1e-6)
    assert "dcaptures=(<shape=(3, 2) dtype=float32>, None)" in repr(grads)


def test_a_paged_batch_refuses_a_variant_naming_it():
    q = np.ones((2, 1, 4))
    pages = np.ones((2, 4, 1, 4))
    with pytest.raises(ValueError, match="block_table. does not take .score_mod."):
        enp.varlen_attention(q, pages, pages, [0, 1, 2], None, block_table=[[0], [1]], seqused_k=[2, 3],
                             score_mod=per_sequence, captures=(np.ones((2, 1)), np.zeros(1, dtype=np.int64)))
