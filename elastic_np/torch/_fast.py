"""The short way of `elastic_np.torch.attention` for an eager call on CPU tensors with scalar options.

Such a call (eager; CPU tensors ``q``, ``k``, ``v`` of one dtype, plain or
parameters; every option a Python scalar) needs nothing of the adapter but
the tensors' NumPy views and the options as `elastic_np.attention` takes
them. `attention` derives the latter once per option set (`_Call`, kept
by the options' values with their types) and looks the call up in
`elastic_np.attention`'s own plans (`elastic_np._api.plans`), so that a
repeated call runs its plan directly; a call that records a gradient runs
the same in `_Trained`, whose backward is `elastic_np.attention_backward`
with the same keywords. Any other call, and any call that the full path
would reject, is left to it (`attention` returns None): the errors are the
full path's.
"""

import math

import numpy as np
import torch

from elastic_np._api import adapters as common
from elastic_np._api import dispatch, plans
from elastic_np._contract import _spec
from elastic_np._contract._problem import Kept
from elastic_np.torch import _arrays as arrays
from elastic_np.torch import _ops

#: The dtypes taken; bfloat16 goes through `arrays.to_numpy` and `arrays.from_numpy`.
_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16))
#: The tensor types taken (a parameter is a plain tensor to the kernels).
_KINDS = frozenset((torch.Tensor, torch.nn.Parameter))
#: The types of option values a call is keyed by (a tuple, window_size's, when it holds ints).
_SCALARS = frozenset((type(None), bool, int, float, str))


class _Call:
    """What a call derives from its options alone: `elastic_np.attention`'s keywords and their plan key part.

    ``fixed`` and ``learnable`` are `common.split`'s (``fixed`` with
    ``backend``), for the backward operator of a second derivative.
    """

    __slots__ = ("fixed", "learnable", "kwargs", "backward_kwargs", "options_key", "backward_key")

    def __init__(self, backend, options):
        self.fixed, self.learnable = common.split(_spec.complete(options, "attention"))
        self.fixed["backend"] = common.kernel_backend(backend)
        self.backward_kwargs = common.numpy_options(self.fixed, self.learnable)
        self.kwargs = {**self.backward_kwargs, "return_lse": True}
        floats = tuple(self.kwargs[name] for name in plans.FLOATS)
        self.options_key = plans.options_key(tuple(self.kwargs[name] for name in plans.KEYED), floats,
                                             self.kwargs["window_size"])
        # `elastic_np.attention_backward`'s: "backward" where the forward has return_lse
        self.backward_key = plans.options_key(
            tuple("backward" if name == "return_lse" else self.kwargs[name] for name in plans.KEYED), floats,
            self.kwargs["window_size"])


#: `_Call`s of the latest option sets, by `_key`.
_CALLS = Kept(64)


def _key(backend, options):
    """The key of a call's options (with their types), or None where the short way does not take them."""
    if type(backend) is not str or backend == "cuda":
        return None
    values = tuple(options.values())
    types = tuple(map(type, values))
    for value, kind in zip(values, types):
        if kind is float:
            if value == 0 and math.copysign(1.0, value) < 0:  # -0.0 == 0.0: not keyed
                return None
        elif kind is tuple:
            if any(type(part) is not int for part in value):
                return None
        elif kind not in _SCALARS:
            return None
    return backend, tuple(options), values, types


def attention(q, k, v, dropout_p, backend, options):
    """``(out, lse)`` of `elastic_np.torch.attention` the short way, or None for a call it leaves to the full path.

    The same bits as the full path (`_ops._host_forward`, `_ops._host_backward`):
    the same NumPy calls on the same views.
    """
    if not _takes(q, k, v, dropout_p):
        return None
    key = _key(backend, options)
    if key is None:
        return None
    call = _CALLS.get(key)
    if call is None:
        call = _CALLS.get_or_make(key, lambda: _Call(backend, options))
    if q.requires_grad or k.requires_grad or v.requires_grad:
        if torch.is_grad_enabled():
            return _Trained.apply(q, k, v, call)
        q, k, v = q.detach(), k.detach(), v.detach()
    return _forward(call, q, k, v)


def _takes(q, k, v, dropout_p):
    """Whether the short way takes these tensors: eager, plain CPU tensors (or parameters) of one kernel dtype."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # first: nothing else for torch.compile to trace
        return False
    if not (_plain(q) and _plain(k) and _plain(v)) or arrays._cuda_bridge.device_type == "cpu":
        return False  # (a test's bridge takes CPU tensors for CUDA tensors)
    dtype = q.dtype
    if k.dtype is not dtype or v.dtype is not dtype or dtype not in _DTYPES:
        return False
    if type(dropout_p) not in (float, int) or dropout_p != 0:
        return False
    return torch._C._functorch.peek_interpreter_stack() is None  # torch.func's tensors are wrapped


def _plain(x):
    """A plain CPU tensor or parameter, not a negative view."""
    return type(x) in _KINDS and x.is_cpu and not x.is_neg()


def _forward(call, q, k, v):
    """``(out, lse)`` of detached CPU tensors: through the plan of their layout where there is one."""
    dtype = q.dtype
    half = dtype is torch.bfloat16
    if half:
        q, k, v = arrays.to_numpy(q), arrays.to_numpy(k), arrays.to_numpy(v)
    else:
        q, k, v = q.numpy(), k.numpy(), v.numpy()
    plan = None if call.options_key is None else plans.lookup(plans.with_arrays(q, k, v, call.options_key), k, v)
    if plan is None:
        out, lse = dispatch.attention(q, k, v, **call.kwargs)
    else:
        out, lse = plan.run_checked(q, k, v)
    if half:
        out, lse = arrays.from_numpy(out), arrays.from_numpy(lse)
    else:
        out, lse = torch.from_numpy(out), torch.from_numpy(lse)
    if out.dtype is not dtype:
        out = out.to(dtype)
    lse_dtype = arrays.lse_dtype(dtype)
    if lse.dtype is not lse_dtype:
        lse = lse.to(lse_dtype)
    return out.contiguous(), lse.contiguous()


def _numpy(x):
    """A CPU tensor as a NumPy view (`arrays._host` for the tensors autograd hands over, known to be on the CPU)."""
    x = x.detach()
    return arrays.to_numpy(x.resolve_neg() if x.is_neg() else x)


class _Trained(torch.autograd.Function):
    """A call of `attention` that records a gradient: `_forward`, and `elastic_np.attention_backward`.

    A backward that records its own graph (``create_graph=True``) calls
    ``elastic_np::attention_backward``, whose derivative is the double
    backward. An unused ``out`` or ``lse`` gets no cotangent (None), as
    through the operator.
    """

    @staticmethod
    def forward(ctx, q, k, v, call):
        out, lse = _forward(call, q.detach(), k.detach(), v.detach())
        ctx.set_materialize_grads(False)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call
        dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
        dlse = None if dlse is None else dlse.to(lse.dtype)
        if torch.is_grad_enabled():  # create_graph: the operator, differentiable
            args = _ops.op_arguments({n: x for n, x in call.fixed.items() if n != "backend"}, call.learnable)
            grads = torch.ops.elastic_np.attention_backward(dout, dlse, q, k, v, out, lse, *args,
                                                            call.fixed["backend"])[:3]
        else:
            given = tuple(map(_numpy, (dout, q, k, v, out, lse)))
            result = _backward(call, given, None if dlse is None else _numpy(dlse))
            grads = [_grad(g, like) for g, like in zip((result.dq, result.dk, result.dv), (q, k, v))]
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None)


def _backward(call, given, dlse):
    """`elastic_np.attention_backward` of the NumPy views ``given = (dout, q, k, v, out, lse)`` and ``dlse``: the
    plan of their layout where `elastic_np.attention_backward` would find one (looked up by ``call``'s key part,
    made once), else the call itself."""
    plan = None if call.backward_key is None else plans.PLANS.get(plans.with_arrays(*given[1:4], call.backward_key))
    if plan is not None:
        return plan.backward(*given, dlse)
    return dispatch.attention_backward(*given, dlse=dlse, **call.backward_kwargs)


#: The NumPy dtypes of the tensors whose gradients are handed over as they are (`_grad`).
_AS_THEY_ARE = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


def _grad(grad, like):
    """A NumPy gradient as a contiguous tensor of ``like``'s dtype and shape: over its memory when it is one
    already (C-contiguous, of that shape and dtype), else `arrays._as_grad`'s."""
    dtype = _AS_THEY_ARE.get(like.dtype)  # (NumPy's float64 equals None: not compared with it)
    if (dtype is not None and type(grad) is np.ndarray and grad.dtype == dtype and grad.flags.c_contiguous
            and grad.shape == like.shape):
        return torch.from_numpy(grad)
    return arrays._as_grad(grad, like).contiguous()
