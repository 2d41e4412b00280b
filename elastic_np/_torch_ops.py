"""`elastic_np.torch.attention` as two ``torch.library`` operators, ``elastic_np::attention`` and its backward.

The operators' schemas are built from the option table (each option's
``schema``): ``q, k, v``, every option, ``backend``. Their fake
implementations give the shapes, so ``torch.compile`` keeps a call in its
graph; ``register_autograd`` hands the cotangents of ``out`` and ``lse`` to
``elastic_np::attention_backward``, whose seven results are the gradients of
``q``, ``k``, ``v``, ``tau``, ``beta``, ``sigma`` and ``bias`` (an empty
tensor where an option is absent).
"""

import numpy as np
import torch

from elastic_np import _adapter_common as common
from elastic_np import _dispatch, _spec
from elastic_np import _torch_arrays as arrays

#: The operators' option arguments in schema order, ``(name, schema type)``.
OPTION_ARGS = tuple((part.split()[1], part.split()[0]) for o in _spec.OPTIONS for part in o.schema.split(", "))
_NAMES = tuple(name for name, _ in OPTION_ARGS)
_OPTIONS = ", ".join(f"{kind} {name}" for name, kind in OPTION_ARGS)
_GRADS = ("dq", "dk", "dv") + tuple("d" + name for name in common.LEARNABLE)

FORWARD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}, str backend) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = (f"(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_OPTIONS}, "
                   f"str backend) -> ({', '.join(['Tensor'] * len(_GRADS))})")


def op_arguments(fixed, learnable, option_args=OPTION_ARGS):
    """The operators' option arguments from `common.split`'s ``(fixed, learnable)``: array options as tensors.

    ``option_args``: ``(name, schema type)`` of each, `OPTION_ARGS` or another operator's.
    """
    values = {**fixed, **learnable}
    args = []
    for name, kind in option_args:
        value = values[name]
        if kind == "Tensor[]?" and value is not None:  # one per sequence of a packed batch
            value = [x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x)) for x in value]
        elif kind == "Tensor?" and value is not None and not isinstance(value, torch.Tensor):
            value = torch.from_numpy(np.array(value))  # a Python float as float64, as the backends read it
        elif kind == "int[]":
            value = [int(x) for x in value]
        args.append(value)
    return args


def _options(args, device):
    """``(fixed, learnable)`` of the backend from the operator's option arguments (host arrays where read there)."""
    values = dict(zip(_NAMES, args))
    learnable = {name: values.pop(name) for name in common.LEARNABLE}
    values["window_size"] = tuple(values["window_size"])
    for name in _spec.TENSOR_OPTIONS:
        values[name] = arrays._host(values[name], name) if device is None else \
            arrays._option(values[name], name, device)
    return values, learnable


def _device(q):
    """None for tensors the kernels read on the host, the CUDA device for those the CUDA backend reads in place."""
    return q.device if q.device.type == arrays._cuda_bridge.device_type else None


@torch.library.custom_op("elastic_np::attention", mutates_args=(), schema=FORWARD_SCHEMA)
def _forward(q, k, v, *args):
    *options, backend = args
    device = _device(q)
    fixed, learnable = _options(options, device)
    fixed["backend"] = backend
    if device is None:
        host = {name: arrays._host(value, name) for name, value in learnable.items()}
        out, lse = _dispatch.attention(*(arrays._host(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))),
                                       return_lse=True, **common.numpy_options(fixed, host))
        out, lse = arrays.from_numpy(out).to(q.dtype), arrays.from_numpy(lse).to(arrays.lse_dtype(q.dtype))
    else:
        out, lse = arrays._cuda_forward(fixed, device, (q, k, v), learnable)
    return out.contiguous(), lse.contiguous()


@_forward.register_fake
def _forward_shapes(q, k, v, *args):
    layout = args[_NAMES.index("layout")]
    B, H, N = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhnd" else (q.shape[0], q.shape[2], q.shape[1])
    rows = (B, H, N, v.shape[3]) if layout == "bhnd" else (B, N, H, v.shape[3])
    return q.new_empty(rows), q.new_empty((B, H, N), dtype=arrays.lse_dtype(q.dtype))


@torch.library.custom_op("elastic_np::attention_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _backward(dout, dlse, q, k, v, out, lse, *args):
    *options, backend = args
    device = _device(q)
    fixed, learnable = _options(options, device)
    fixed["backend"] = backend
    if device is None:
        host = {name: arrays._host(value, name) for name, value in learnable.items()}
        grads = _dispatch.attention_backward(
            *(arrays._host(x, n) for x, n in ((dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"),
                                              (lse, "lse"))),
            dlse=arrays._host(dlse, "dlse"), **common.numpy_options(fixed, host))
        as_grad = arrays._as_grad
    else:
        grads = arrays._cuda_backward(fixed, device, (dout, q, k, v, out, lse), dlse, learnable)
        as_grad = arrays._cuda_grad
    likes = (q, k, v) + tuple(learnable[name] for name in common.LEARNABLE)
    return tuple(q.new_empty(0) if like is None else as_grad(getattr(grads, name), like).contiguous()
                 for name, like in zip(_GRADS, likes))


@_backward.register_fake
def _backward_shapes(dout, dlse, q, k, v, out, lse, *args):
    values = dict(zip(_NAMES, args))
    likes = (q, k, v) + tuple(values[name] for name in common.LEARNABLE)
    return tuple(q.new_empty(0) if like is None else like.new_empty(like.shape) for like in likes)


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    ctx.args = [None if i in tensors else a for i, a in enumerate(args)]
    ctx.tensor_at = tensors
    ctx.save_for_backward(q, k, v, *output, *(args[i] for i in tensors))


def _gradients(ctx, dout, dlse):
    q, k, v, out, lse, *saved = ctx.saved_tensors
    args = list(ctx.args)
    for i, tensor in zip(ctx.tensor_at, saved):
        args[i] = tensor
    dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
    dlse = None if dlse is None else dlse.to(lse.dtype)
    grads = dict(zip(("q", "k", "v", *common.LEARNABLE),
                     torch.ops.elastic_np.attention_backward(dout, dlse, q, k, v, out, lse, *args)))
    names = ("q", "k", "v", *_NAMES, "backend")
    return tuple(grads[name] if name in grads and need else None for name, need in zip(names, ctx.needs_input_grad))


_forward.register_autograd(_gradients, setup_context=_setup_context)


def attention(q, k, v, fixed, learnable):
    """``(out, lse)`` through ``elastic_np::attention``, from `common.split`'s options (``fixed`` with ``backend``)."""
    backend = fixed["backend"]
    args = op_arguments({n: x for n, x in fixed.items() if n != "backend"}, learnable)
    return torch.ops.elastic_np.attention(q, k, v, *args, backend)
