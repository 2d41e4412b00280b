"""The float64 oracle's test problems: seeded ``q, k, v`` away from NVM's jump, and the option cases.

`make_qkv` draws the inputs of ``SHAPE``; `CASES` holds the option sets the
oracle's forward, backward (``test_reference_attention``) and double backward
(``test_double_backward``) are held to finite differences with.
"""

import numpy as np

import elastic_np as enp
from elastic_np import reference as ref
from elastic_np._contract import _problem

SHAPE = dict(B=2, H=4, Hkv=2, N=5, M=7, D=3, Dv=2)


def make_qkv(seed, B=2, H=4, Hkv=2, N=5, M=7, D=3, Dv=2, nvm_margin=None, options=None):
    """Seeded q, k, v; with ``nvm_margin``, redrawn until every final score is that far from 0.

    The final score is the one NVM tests: after the soft-cap, ALiBi and the
    bias of ``options``.
    """
    rng = np.random.default_rng(seed)
    while True:
        q = rng.standard_normal((B, H, N, D))
        k = rng.standard_normal((B, Hkv, M, D))
        v = rng.standard_normal((B, Hkv, M, Dv))
        if nvm_margin is None:
            return q, k, v
        s = ref.scores(_problem.prepare(q, k, v, **(options or {})))[0]
        if np.abs(s[np.isfinite(s)]).min() > nvm_margin:
            return q, k, v


def threshold_in_gap(sigma, N, M, sharpness=1.0):
    """A bell threshold midway in the widest gap between the window's values, far from every f."""
    problem = _problem.prepare(*make_qkv(0, B=1, H=1, Hkv=1, N=N, M=M),
                                   dynamic_window=enp.DynamicWindow(sigma, sharpness))
    f = np.unique(ref.window_gate(problem)[1])
    gaps = np.diff(f)
    i = np.argmax(gaps[: len(gaps) - 1]) if len(gaps) > 1 else 0  # keep the peak in the band
    return float((f[i] + f[i + 1]) / 2)


def sigma_threshold_case():
    sigma = np.array([[0.4, 0.7, 1.1, 0.5], [0.9, 0.3, 0.6, 0.8]])
    return enp.DynamicWindow(sigma, sharpness=2.0, threshold=threshold_in_gap(0.5, 5, 7, 2.0))


_rng = np.random.default_rng(11)
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])
BIAS_FULL = _rng.standard_normal((2, 4, 5, 7))
BIAS_KEYS = np.where(_rng.random((2, 1, 1, 7)) < 0.25, -np.inf, _rng.standard_normal((2, 1, 1, 7)))

CASES = {
    "plain": {},
    "scale": {"scale": 0.3},
    "causal": {"causal": True},
    "window": {"window_size": (2, 1)},
    "window_left_only": {"window_size": (1, -1)},
    "kv_lengths": {"kv_lengths": np.array([7, 4])},
    "mask": {"mask": np.random.default_rng(9).random((5, 7)) < 0.7},
    "nvm": {"nvm": True},
    "tau_beta_scalar": {"tau": 0.6, "beta": 0.8},
    "tau_beta_per_head": {"tau": np.array([0.5, 1.0, 1.7, 2.2]), "beta": np.array([0.0, 0.3, 1.0, 4.0])},
    "dynamic_window": {"dynamic_window": enp.DynamicWindow(0.6, sharpness=3.0)},
    "dynamic_window_threshold": {"dynamic_window": sigma_threshold_case()},
    "combined": {
        "causal": True, "window_size": (3, -1), "nvm": True, "kv_lengths": np.array([6, 7]),
        "mask": np.random.default_rng(10).random((2, 1, 5, 7)) < 0.85,
        "tau": np.array([0.5, 1.0, 1.7, 2.2]), "beta": np.array([0.1, 0.3, 1.0, 4.0]),
        "dynamic_window": enp.DynamicWindow(np.array([0.5, 0.8, 1.2, 2.0]), sharpness=1.5),
    },
    "softcap": {"softcap": 0.8},
    "alibi": {"alibi_slopes": SLOPES},
    "alibi_per_batch": {"alibi_slopes": np.stack([SLOPES, SLOPES[::-1]])},
    "bias": {"bias": BIAS_FULL},
    "bias_rows_keys": {"bias": _rng.standard_normal((5, 7))},
    "bias_neg_inf": {"bias": BIAS_KEYS, "beta": 0.3},
    "modifiers_combined": {
        "softcap": 1.5, "alibi_slopes": SLOPES, "bias": BIAS_FULL[:, :, :, :],
        "causal": True, "window_size": (4, -1), "nvm": True,
        "tau": np.array([0.5, 1.0, 1.7, 2.2]), "beta": np.array([0.1, 0.3, 1.0, 4.0]),
    },
    "modifiers_gate": {
        "softcap": 2.0, "bias": BIAS_KEYS, "dynamic_window": enp.DynamicWindow(0.7, sharpness=2.0),
        "nvm": True, "tau": 0.8,
    },
}
