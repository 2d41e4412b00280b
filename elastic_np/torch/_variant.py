"""`elastic_np.torch.attention` with a user's ``score_mod``, ``mask_mod`` or ``block_mask``: an autograd function.

The ``torch.library`` operator's schema cannot hold a Python function, so
these calls go through a `torch.autograd.Function` instead, on CPU tensors:
the forward and backward of `elastic_np.attention` on NumPy views of the
tensors (no copy). Gradients flow to ``q``, ``k``, ``v``, the learnable
options and the floating ``captures`` given as tensors that require them.
``torch.compile`` does not trace into it (a graph break).
"""

import numpy as np
import torch

import elastic_np as enp
from elastic_np._api import adapters as common
from elastic_np.torch import _arrays


def attention(q, k, v, variant, fixed, learnable, return_lse):
    """``out`` (and ``lse``) of the call; ``variant = (score_mod, mask_mod, block_mask, captures)``.

    ``fixed`` and ``learnable`` are the options as `elastic_np._api.adapters.split` gives them.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
        _arrays.check_on_cpu(x, name)
    score_mod, mask_mod, block_mask, captures = variant
    if not isinstance(captures, (tuple, list)):
        raise TypeError(f"`captures` must be a tuple of arrays or tensors, got {type(captures).__name__}")
    names = tuple(common.LEARNABLE)
    tensors = (q, k, v, *(learnable[n] for n in names), *captures)
    out, lse = _Variant.apply((score_mod, mask_mod, block_mask, fixed, names, len(captures)), *tensors)
    return (out, lse) if return_lse else out


def _host(value, name):
    """A tensor as a NumPy view (checked on the CPU), anything else as it is."""
    return _arrays._host(value, name) if isinstance(value, torch.Tensor) else value


class _Variant(torch.autograd.Function):
    """The attention of a user's variant; ``spec = (score_mod, mask_mod, block_mask, fixed, names, n_captures)``."""

    @staticmethod
    def forward(ctx, spec, *tensors):
        score_mod, mask_mod, block_mask, fixed, names, n_captures = spec
        q, k, v = tensors[:3]
        learnable = dict(zip(names, tensors[3 : 3 + len(names)]))
        captures = tensors[3 + len(names):]
        options = common.numpy_options(fixed, {n: _host(x, n) for n, x in learnable.items()})
        options["backend"] = common.kernel_backend(options.get("backend", "auto"))
        host_captures = tuple(_host(c, f"captures[{i}]") for i, c in enumerate(captures))
        call = dict(score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, captures=host_captures,
                    **options)
        out, lse = enp.attention(*(_arrays._host(x, n) for x, n in zip((q, k, v), "qkv")), return_lse=True, **call)
        out_t, lse_t = _arrays.from_numpy(np.ascontiguousarray(out)), torch.from_numpy(lse)
        ctx.call, ctx.names, ctx.n_captures = call, names, n_captures
        ctx.save_for_backward(q, k, v, out_t, lse_t)
        ctx.likes = (learnable, captures)
        return out_t, lse_t

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        learnable, captures = ctx.likes
        arrays = [_arrays._host(x, n) for x, n in zip((dout.contiguous(), q, k, v, out), ("dout", "q", "k", "v", "out"))]
        dlse = None if dlse is None else _arrays._host(dlse.to(lse.dtype).contiguous(), "dlse")
        grads = enp.attention_backward(*arrays, lse.numpy(), dlse=dlse, **ctx.call)
        option_grads = [_grad(common.grad_of(grads, n), learnable[n]) for n in ctx.names]
        dcaptures = grads.dcaptures or (None,) * ctx.n_captures
        capture_grads = [_grad(g, c) for g, c in zip(dcaptures, captures)]
        return (None, _grad(grads.dq, q), _grad(grads.dk, k), _grad(grads.dv, v), *option_grads, *capture_grads)


def _grad(grad, like):
    """``grad`` as a tensor like ``like`` where ``like`` is a tensor that requires it, else None."""
    if grad is None or not isinstance(like, torch.Tensor) or not like.requires_grad:
        return None
    return _arrays._as_grad(grad, like)
