"""Measurement helpers shared by ``elastic-np bench`` and the asv suite.

Everything a side-by-side comparison needs: seeded inputs, the FLOP count of
attention, a naive NumPy attention, PyTorch's ``scaled_dot_product_attention``
(when torch is installed), a best-of-N timer and the machine's matrix-multiply
peak.
"""

import time

import numpy as np


def make_inputs(B, H, N, M, D, *, Hkv=None, Dv=None, dtype=np.float32, seed=0):
    """Seeded standard-normal ``q, k, v`` of shapes ``(B, H, N, D)``, ``(B, Hkv, M, D)``, ``(B, Hkv, M, Dv)``."""
    rng = np.random.default_rng(seed)
    Hkv = H if Hkv is None else Hkv
    Dv = D if Dv is None else Dv
    q = rng.standard_normal((B, H, N, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, M, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, M, Dv)).astype(dtype)
    return q, k, v


def attention_flops(B, H, N, M, D, Dv=None, *, causal=False, backward=False):
    """FLOPs of attention by the FlashAttention convention.

    The forward is two matrix products, ``2 * B * H * N * M * (D + Dv)``; causal
    keeps the fraction of the ``N x M`` matrix on or below the bottom-right
    aligned diagonal; the backward is counted as 2.5 forwards (five products).
    """
    Dv = D if Dv is None else Dv
    entries = N * M
    if causal:
        offset = M - N
        # number of (i, j) with j <= i + offset, 0 <= j < M
        kept_per_row = np.clip(np.arange(N) + offset + 1, 0, M)
        entries = int(kept_per_row.sum())
    forward = 2.0 * B * H * entries * (D + Dv)
    return forward * (3.5 if backward else 1.0)


def naive_attention(q, k, v, *, causal=False, scale=None):
    """Plain NumPy attention in the input dtype, materialising the score matrix."""
    B, H, N, D = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    if Hkv != H:
        k = np.repeat(k, H // Hkv, axis=1)
        v = np.repeat(v, H // Hkv, axis=1)
    s = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    if causal:
        i = np.arange(N)[:, None] + (M - N)
        s = np.where(np.arange(M)[None, :] <= i, s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v


def torch_available():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def torch_sdpa(q, k, v, *, causal=False, backward=False, dout=None):
    """Run ``torch.nn.functional.scaled_dot_product_attention`` on NumPy inputs.

    Returns the output (and with ``backward=True`` the gradients ``dq, dk, dv``)
    as NumPy arrays. Causal alignment for ``N != M`` is torch's top-left one,
    so compare only ``N == M`` causal results with elastic_np.
    """
    import torch

    H, Hkv = q.shape[1], k.shape[1]
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v))
    if backward:
        for t in (tq, tk, tv):
            t.requires_grad_(True)
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, is_causal=causal, enable_gqa=H != Hkv
    )
    if not backward:
        return out.numpy()
    grad = torch.ones_like(out) if dout is None else torch.from_numpy(np.ascontiguousarray(dout))
    out.backward(grad)
    return out.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def best_time(fn, *, repeat=5, number=1, min_time=0.0):
    """Best wall time of ``fn()`` in seconds: the minimum over ``repeat`` runs of ``number`` calls."""
    best = np.inf
    spent = 0.0
    runs = 0
    while runs < repeat or spent < min_time:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        spent += elapsed
        runs += 1
        best = min(best, elapsed / number)
    return best


def matmul_peak_gflops(dtype=np.float32, n=2048, repeat=5):
    """GFLOP/s of ``np.dot`` on two ``n x n`` matrices: this machine's practical peak."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    np.dot(a, b)
    return 2.0 * n**3 / best_time(lambda: np.dot(a, b), repeat=repeat) / 1e9
