"""elastic_np.torch.attention with a user's score_mod, mask_mod and block mask: gradcheck of q, k, v and a capture,
the NumPy entry points' values, and a bias table trained."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import elastic_np as enp  # noqa: E402
import elastic_np.torch as enpt  # noqa: E402

N = 7


def relative(score, b, h, q_idx, kv_idx, table):
    return 8.0 * math.tanh((score + table[h, kv_idx - q_idx + N - 1]) / 8.0)


def causal(b, h, q_idx, kv_idx, table):  # takes the call's captures, as score_mod does
    return q_idx >= kv_idx


def tensors(seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, N, 4, generator=generator, dtype=dtype, requires_grad=True) for _ in range(3))
    table = (0.5 * torch.randn(2, 2 * N - 1, generator=generator, dtype=dtype)).requires_grad_(True)
    return q, k, v, table


def test_gradcheck_of_q_k_v_and_the_captured_table():
    q, k, v, table = tensors()

    def call(q, k, v, table):
        return enpt.attention(q, k, v, score_mod=relative, mask_mod=causal, captures=(table,), tau=0.8, beta=0.3)

    assert torch.autograd.gradcheck(call, (q, k, v, table), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_the_values_and_gradients_are_the_numpy_entry_points():
    q, k, v, table = tensors(1)
    block_mask = enp.create_block_mask(causal, None, None, N, N, captures=(table.detach().numpy(),), block_size=4)
    out, lse = enpt.attention(q, k, v, score_mod=relative, block_mask=block_mask, captures=(table,), return_lse=True)
    (out.square().sum() + lse.sum()).backward()
    arrays = [x.detach().numpy() for x in (q, k, v, table)]
    call = dict(score_mod=relative, block_mask=block_mask, captures=(arrays[3],))
    want, want_lse = enp.attention(*arrays[:3], return_lse=True, **call)
    np.testing.assert_array_equal(out.detach().numpy(), want)
    grads = enp.attention_backward(2 * want, *arrays[:3], want, want_lse, dlse=np.ones_like(want_lse), **call)
    for got, expected in ((q.grad, grads.dq), (k.grad, grads.dk), (v.grad, grads.dv), (table.grad, grads.dcaptures[0])):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-14)


def test_a_bias_table_trains_and_float32_and_bfloat16_run():
    q, k, v, table = tensors(2, torch.float32)
    target = torch.zeros(1, 2, N, 4)
    optimizer = torch.optim.SGD([table], lr=0.5)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = (enpt.attention(q.detach(), k.detach(), v.detach(), score_mod=relative, captures=(table,))
                - target).square().sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    out = enpt.attention(*(x.detach().bfloat16() for x in (q, k, v)), score_mod=relative, captures=(table.detach(),))
    assert out.dtype == torch.bfloat16
