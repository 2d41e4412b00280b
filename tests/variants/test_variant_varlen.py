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


def windowed(b, h, q_idx, kv_idx, offsets, heads):
    return kv_idx > q_idx - 6


@pytest.mark.parametrize("backend, dtype", [("cpu", np.float64), ("cpu", np.float32), ("reference", np.float64)])
def test_a_paged_batchs_variant_gives_each_sequence_its_gathered_keys_bits(backend, dtype):
    """Pages of 4 keys, shuffled, the unused ones NaN: a decode, a chunk and a whole prompt, each the bits of
    `attention` with the variant on its own gathered keys (the queries the last before its used keys)."""
    rng = np.random.default_rng(1)
    used, n_q, page = np.array([9, 13, 6]), np.array([1, 5, 6]), 4
    table = rng.permutation(12).reshape(3, 4)
    k_pages, v_pages = (np.full((12, page, 1, 4), np.nan, dtype=dtype) for _ in range(2))
    gathered = []
    for s in range(3):
        k_s, v_s = (rng.standard_normal((used[s], 1, 4)).astype(dtype) for _ in range(2))
        for j in range(used[s]):
            k_pages[table[s, j // page], j % page], v_pages[table[s, j // page], j % page] = k_s[j], v_s[j]
        gathered.append((k_s, v_s))
    cu_q = np.concatenate([[0], np.cumsum(n_q)])
    q = rng.standard_normal((cu_q[-1], H, 4)).astype(dtype)
    offsets = rng.standard_normal((3, H)).astype(dtype)
    variant = dict(score_mod=per_sequence, mask_mod=windowed, captures=(offsets, np.array([1, 0])))
    out, lse = enp.varlen_attention(q, k_pages, v_pages, cu_q, None, block_table=table, seqused_k=used,
                                    causal=True, return_lse=True, backend=backend, **variant)
    for s, (k_s, v_s) in enumerate(gathered):
        rows = slice(cu_q[s], cu_q[s + 1])
        bias = np.broadcast_to(offsets[s, [1, 0]][:, None, None], (H, n_q[s], used[s]))
        in_window = np.arange(used[s])[None, :] > np.arange(n_q[s])[:, None] - 6
        want, want_lse = enp.attention(q[None, rows], k_s[None], v_s[None], causal=True, layout="bnhd",
                                       bias=bias, mask=in_window, return_lse=True, backend="reference")
        if dtype == np.float64:
            assert_matches_oracle("out", out[rows], want[0], dtype)
        else:  # (the float32 rule's cap: the bits are held to the unpaged call's below)
            np.testing.assert_allclose(out[rows], want[0], rtol=0, atol=1e-5)
        one = enp.varlen_attention(q[rows], k_s, v_s, [0, n_q[s]], [0, used[s]], causal=True, backend=backend,
                                   **{**variant, "captures": (offsets[s:s + 1], np.array([1, 0]))})
        assert np.array_equal(out[rows], one), s  # (b = 0 here: the offsets of sequence s alone)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def causal_per_sequence(b, h, q_idx, kv_idx, offsets, heads):
    return q_idx >= kv_idx + 4 * b  # each sequence its own rule: the first 4 b queries keep nothing


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_packed_batchs_block_mask_gives_its_mask_mods_result(backend, small_tiles):
    """One block mask made for (S, H, max_q, max_k), ``b`` the sequence, blocks of 8 x 5 on tiles of 8 x 5 (10
    keys in the backward): each sequence takes its own first blocks (a block full for the first sequence is partial
    for the third); forward and backward give the oracle's result with the ``mask_mod`` alone."""
    cu = np.array([0, 5, 12, 36])
    rng = np.random.default_rng(2)
    q, k, v, dout = (rng.standard_normal((36, H, 4)) for _ in range(4))
    captures = (rng.standard_normal((3, H)), np.arange(H))
    block_mask = enp.create_block_mask(causal_per_sequence, 3, None, 24, 24, captures=captures, block_size=(8, 5))
    results = []
    for variant, on in ((dict(mask_mod=causal_per_sequence), "reference"), (dict(block_mask=block_mask), backend)):
        out, lse = enp.varlen_attention(q, k, v, cu, cu, return_lse=True, backend=on, captures=captures,
                                        score_mod=per_sequence, **variant)
        grads = enp.varlen_attention_backward(dout, q, k, v, out, lse, cu, cu, backend=on, captures=captures,
                                              score_mod=per_sequence, **variant)
        results.append(dict(out=out, lse=lse, dq=grads.dq, dk=grads.dk, dv=grads.dv, dcaptures=grads.dcaptures[0]))
    for name, want in results[0].items():
        assert_matches_oracle(name, results[1][name], want, np.float64)
    assert np.isneginf(results[1]["lse"][12:20]).all() and np.isfinite(results[1]["lse"][20:]).all()


def test_a_packed_batchs_block_mask_must_cover_every_sequence():
    q = np.ones((20, H, 4))
    captures = (np.ones((3, H)), np.arange(H))
    for shape in ((3, None, 7, 8), (2, None, 8, 8), (3, 3, 8, 8)):
        block_mask = enp.create_block_mask(causal_per_sequence, *shape, captures=captures)
        with pytest.raises(ValueError, match="`block_mask` was made for"):
            enp.varlen_attention(q, q, q, CU, CU, block_mask=block_mask, captures=captures, backend="cpu")
