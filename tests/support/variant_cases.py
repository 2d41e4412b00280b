"""Shared cases of the user-variant tests: built-in modifiers and masks rewritten as ``score_mod`` and ``mask_mod``."""

import math

import numpy as np

B, H, HKV, N, M, D = 2, 4, 2, 37, 45, 8
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])


def inputs(dtype=np.float64, n=N, m=M, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, n, D))
    k, v = (rng.standard_normal((B, HKV, m, D)) for _ in range(2))
    return tuple(a.astype(np.float32).astype(dtype) for a in (q, k, v))


def softcap(score, b, h, q_idx, kv_idx):
    return 2.0 * math.tanh(score / 2.0)


def alibi(score, b, h, q_idx, kv_idx, slopes):
    return score - slopes[h] * abs(q_idx + (M - N) - kv_idx)


def add_bias(score, b, h, q_idx, kv_idx, bias):
    return score + bias[b, h, q_idx, kv_idx]


def causal(b, h, q_idx, kv_idx):
    return q_idx + (M - N) >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    off = kv_idx - q_idx - (M - N)
    return -5 <= off and off <= 3


def lengths(b, h, q_idx, kv_idx, kv_lengths):
    return kv_idx < kv_lengths[b]


BIAS = np.random.default_rng(3).standard_normal((B, H, N, M)).astype(np.float32).astype(np.float64)
KV_LENGTHS = np.array([45, 20])

# (user's variant, the built-in options it rewrites)
SCORE_CASES = {
    "softcap": (dict(score_mod=softcap), dict(softcap=2.0)),
    "alibi": (dict(score_mod=alibi, captures=(SLOPES,)), dict(alibi_slopes=SLOPES)),
    "bias": (dict(score_mod=add_bias, captures=(BIAS,)), dict(bias=BIAS)),
}
MASK_CASES = {
    "causal": (dict(mask_mod=causal), dict(causal=True)),
    "sliding": (dict(mask_mod=sliding), dict(window_size=(5, 3))),
    "kv_lengths": (dict(mask_mod=lengths, captures=(KV_LENGTHS,)), dict(kv_lengths=KV_LENGTHS)),
}
