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


def alibi_and_bias(score, b, h, q_idx, kv_idx, slopes, bias):
    """ALiBi and an additive bias, as the contract adds them: with zero slopes the bias alone, with a zero
    bias ALiBi alone (one function for both cases: one compile)."""
    return score - slopes[h] * abs(q_idx + (M - N) - kv_idx) + bias[b, h, q_idx, kv_idx]


def rule_mask(b, h, q_idx, kv_idx, rule):
    """One ``mask_mod`` for every mask of the tests (one compile): ``rule[0]`` says which, the rest its numbers.

    0: causal, bottom-right aligned; 1: the window ``(rule[1], rule[2])`` so aligned; 2: ``kv_idx < rule[1 + b]``
    (``kv_lengths``); 3: the same document, ``rule[1 + i]`` the document of position ``i`` (N = M).
    """
    off = kv_idx - q_idx - (M - N)
    kind = rule[0]
    if kind == 0:
        return off <= 0
    if kind == 1:
        return -rule[1] <= off and off <= rule[2]
    if kind == 2:
        return kv_idx < rule[1 + b]
    return rule[1 + q_idx] == rule[1 + kv_idx]


def rel_bias(score, b, h, q_idx, kv_idx, table):
    """A relative-position bias, read at ``kv_idx - q_idx + N - 1`` (a table of ``N + M - 1`` columns, or wider)."""
    return score + table[h, kv_idx - q_idx + N - 1]


BIAS = np.random.default_rng(3).standard_normal((B, H, N, M)).astype(np.float32).astype(np.float64)
KV_LENGTHS = np.array([45, 20])

# (user's variant, the built-in options it rewrites)
SCORE_CASES = {
    "softcap": (dict(score_mod=softcap), dict(softcap=2.0)),
    "alibi": (dict(score_mod=alibi_and_bias, captures=(SLOPES, np.zeros_like(BIAS))), dict(alibi_slopes=SLOPES)),
    "bias": (dict(score_mod=alibi_and_bias, captures=(np.zeros_like(SLOPES), BIAS)), dict(bias=BIAS)),
}
CAUSAL, SLIDING = np.array([0]), np.array([1, 5, 3])
LENGTHS = np.concatenate([[2], KV_LENGTHS])
MASK_CASES = {
    "causal": (dict(mask_mod=rule_mask, captures=(CAUSAL,)), dict(causal=True)),
    "sliding": (dict(mask_mod=rule_mask, captures=(SLIDING,)), dict(window_size=(5, 3))),
    "kv_lengths": (dict(mask_mod=rule_mask, captures=(LENGTHS,)), dict(kv_lengths=KV_LENGTHS)),
}
