"""A user's ``score_mod`` and ``mask_mod`` against PyTorch's FlexAttention, whose semantics they follow: the same
functions written for both give FlexAttention's ``out`` and ``lse`` (forward: FlexAttention has no CPU backward)."""

import numpy as np
import pytest

import elastic_np as enp

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, HKV, N, M, D = 2, 4, 2, 37, 45, 8


def relative(score, b, h, q_idx, kv_idx, table, docs):
    return score + table[h, kv_idx - q_idx + N - 1]


def same_document_causal(b, h, q_idx, kv_idx, table, docs):
    return (q_idx + M - N >= kv_idx) & (docs[b, q_idx + M - N] == docs[b, kv_idx])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("with_block_mask", [False, True])
def test_a_score_mod_and_mask_mod_give_flex_attentions_result(backend, with_block_mask):
    """A relative bias table and a causal document mask (bottom-right: the indices are FlexAttention's, from 0),
    grouped-query heads, float64: within 1e-12 of ``flex_attention``."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, N, D))
    k, v = (rng.standard_normal((B, HKV, M, D)) for _ in range(2))
    table = rng.standard_normal((H, N + M - 1))
    docs = np.sort(rng.integers(0, 3, (B, M)), axis=1)
    captures = (table, docs)
    t_table, t_docs = torch.from_numpy(table), torch.from_numpy(docs)

    def t_relative(score, b, h, q_idx, kv_idx):
        return score + t_table[h, kv_idx - q_idx + N - 1]

    def t_mask(b, h, q_idx, kv_idx):
        return (q_idx + M - N >= kv_idx) & (t_docs[b, q_idx + M - N] == t_docs[b, kv_idx])

    t_block_mask = flex.create_block_mask(t_mask, B, H, N, M, device="cpu")
    want, want_lse = flex.flex_attention(*(torch.from_numpy(a) for a in (q, k, v)), score_mod=t_relative,
                                         block_mask=t_block_mask, enable_gqa=True, return_lse=True)
    masking = (dict(block_mask=enp.create_block_mask(same_document_causal, B, H, N, M, captures=captures))
               if with_block_mask else dict(mask_mod=same_document_causal))
    out, lse = enp.attention(q, k, v, score_mod=relative, captures=captures, return_lse=True, backend=backend,
                             **masking)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse.numpy(), rtol=0, atol=1e-12)
