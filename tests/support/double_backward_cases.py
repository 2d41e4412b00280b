"""Inputs for the adapters' second derivatives (``test_torch_double_backward``, ``test_jax_adapter``).

Finite differences of the backward need every entry to keep its side of
NVM's jump (a final score of 0) and of the dynamic window's threshold: the
inputs are drawn again until no final score lies near 0, and the threshold
is one no bell value comes near (`elastic_np.testing`'s rule).
"""

import numpy as np

from adapter_cases import LEARNED, case_arrays, numpy_options  # noqa: F401 (LEARNED for the tests)
from elastic_np import reference
from elastic_np._contract._problem import prepare
from elastic_np.testing._cases import _window_threshold

#: Causal, NVM, grouped-query heads, the gate with a threshold, per-head tau and beta, a broadcast bias; and a
#: sliding window, NVM, the soft-cap, kv_lengths and ALiBi with scalar tau and beta, per-batch sigma, a full bias.
CASES = ("causal-nvm-gqa-gate-bias", "window-nvm-softcap-kvlen")


def _draw(name, rng):
    if name == CASES[0]:
        shape = B, H, Hkv, N, M, D, Dv = 1, 4, 2, 5, 6, 3, 2
        sigma = rng.uniform(0.4, 0.8, H)
        fixed = dict(causal=True, nvm=True, sharpness=4.0, threshold=_window_threshold(sigma, N, M))
        learn = dict(tau=rng.uniform(0.6, 1.4, H), beta=rng.uniform(0.2, 1.0, H), sigma=sigma,
                     bias=rng.standard_normal((N, M)))
    elif name == CASES[1]:
        shape = B, H, Hkv, N, M, D, Dv = 2, 2, 1, 4, 6, 3, 3
        fixed = dict(window_size=(2, 1), nvm=True, softcap=5.0, kv_lengths=np.array([6, 5]),
                     alibi_slopes=np.array([0.5, 0.25]), sharpness=2.0, threshold=0.0)
        learn = dict(tau=np.array(0.8), beta=np.array(0.5), sigma=rng.uniform(0.4, 0.8, (B, H)),
                     bias=rng.standard_normal((B, H, N, M)))
    else:
        raise ValueError(name)
    return case_arrays(rng, shape, learn), fixed


def make_case(name, seed=0, margin=1e-3):
    """Float64 inputs (NumPy, by name) and fixed options of a named case; every learnable input is present.

    No final score lies within ``margin`` (relative to the largest) of 0.
    """
    for attempt in range(100):
        arrays, fixed = _draw(name, np.random.default_rng([seed, attempt]))
        s = np.abs(reference.scores(prepare(arrays["q"], arrays["k"], arrays["v"],
                                            **numpy_options(arrays, fixed)))[0])
        if np.min(s) > margin * np.max(s):
            return arrays, fixed
    raise RuntimeError(f"no inputs away from the NVM jump for {name!r}")  # pragma: no cover
