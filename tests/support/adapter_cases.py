"""Inputs of the framework adapters' tests: named cases in which every learnable input is present.

`make_case` serves the first derivatives (``test_torch_adapter``,
``test_jax_adapter`` and the CUDA tests that reuse the torch ones);
``double_backward_cases`` draws the second derivatives' cases with
`case_arrays` and `numpy_options` from here. `tensors` and `torch_call` run a
case through elastic_np.torch (``test_torch_adapter``, ``test_torch_cuda`` and
``tests/cuda/test_sim_torch.py``), and `weighted_loss` makes a loss of its
results (``test_torch_op``, ``test_torch_fast``); they import torch when called.
"""

import numpy as np

import elastic_np as enp

LEARNED = ("q", "k", "v", "tau", "beta", "sigma", "bias")
#: Causal, NVM, grouped-query heads, the gate, per-head tau and beta, a broadcast bias; and a sliding window,
#: kv_lengths, the soft-cap and ALiBi with scalar tau and beta, per-batch sigma, a full bias.
CASES = ("causal-nvm-gqa-window-bias", "sliding-kvlen-softcap-alibi")


def case_arrays(rng, shape, learn):
    """``q``, ``k``, ``v`` of ``shape = (B, H, Hkv, N, M, D, Dv)`` drawn from ``rng``, with the learned options ``learn``."""
    B, H, Hkv, N, M, D, Dv = shape
    return dict(q=rng.standard_normal((B, H, N, D)), k=rng.standard_normal((B, Hkv, M, D)),
                v=rng.standard_normal((B, Hkv, M, Dv)), **learn)


def make_case(name, dtype=np.float64, seed=0):
    """Inputs (NumPy) and fixed options of a named case; every learnable input is present."""
    rng = np.random.default_rng(seed)
    if name == CASES[0]:
        shape = B, H, Hkv, N, M, D, Dv = 1, 4, 2, 5, 5, 3, 2
        fixed = dict(causal=True, nvm=True, sharpness=4.0, threshold=0.0)
        learn = dict(tau=rng.uniform(0.5, 1.5, H), beta=rng.uniform(0.2, 1.0, H),
                     sigma=rng.uniform(0.4, 0.8, H), bias=rng.standard_normal((N, M)))
    elif name == CASES[1]:
        shape = B, H, Hkv, N, M, D, Dv = 2, 2, 2, 4, 6, 3, 3
        fixed = dict(window_size=(2, 1), kv_lengths=np.array([6, 5]), softcap=5.0,
                     alibi_slopes=np.array([0.5, 0.25]), sharpness=2.0, threshold=0.0)
        learn = dict(tau=np.array(0.8), beta=np.array(0.5), sigma=rng.uniform(0.4, 0.8, (B, H)),
                     bias=rng.standard_normal((B, H, N, M)))
    else:
        raise ValueError(name)
    arrays = case_arrays(rng, shape, learn)
    return {n: a.astype(dtype) for n, a in arrays.items()}, fixed


def numpy_options(arrays, fixed):
    """The keyword options of `elastic_np.attention` for a case."""
    fixed = dict(fixed)
    window = enp.DynamicWindow(arrays["sigma"], fixed.pop("sharpness"), fixed.pop("threshold"))
    return dict(tau=arrays["tau"], beta=arrays["beta"], bias=arrays["bias"], dynamic_window=window, **fixed)


def torch_call(arrays, fixed, **extra):
    """``out`` of elastic_np.torch.attention for tensors ``arrays``."""
    import elastic_np.torch as enpt

    fixed = dict(fixed)
    window = enpt.DynamicWindow(arrays["sigma"], fixed.pop("sharpness"), fixed.pop("threshold"))
    return enpt.attention(arrays["q"], arrays["k"], arrays["v"], tau=arrays["tau"],
                          beta=arrays["beta"], bias=arrays["bias"], dynamic_window=window,
                          **fixed, **extra)


def tensors(arrays, requires_grad=LEARNED):
    """The arrays of a case as torch tensors; those named in ``requires_grad`` require a gradient."""
    import torch

    return {n: torch.tensor(a, requires_grad=n in requires_grad) for n, a in arrays.items()}


def weighted_loss(out, lse, which, seed):
    """A loss of ``out``, of ``lse`` or of both (``which``), each weighted by random tensors drawn from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    parts = {"out": (out * torch.randn(out.shape, generator=gen).to(out.dtype)).sum(),
             "lse": (lse * torch.randn(lse.shape, generator=gen).to(lse.dtype)).sum()}
    return sum(parts[w] for w in which)
