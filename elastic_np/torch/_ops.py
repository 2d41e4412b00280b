"""`elastic_np.torch.attention` as ``torch.library`` operators: ``elastic_np::attention`` and its two derivatives.

The operators' schemas are built from the option table (each option's
``schema``): ``q, k, v``, every option, ``backend``. Their fake
implementations give the shapes, so ``torch.compile`` keeps a call in its
graph; ``register_autograd`` hands the cotangents of ``out`` and ``lse`` to
``elastic_np::attention_backward``, whose seven results are the gradients of
``q``, ``k``, ``v``, ``tau``, ``beta``, ``sigma`` and ``bias`` (an empty
tensor where an option is absent).

The backward is differentiable in turn: its ``register_autograd`` hands the
cotangents of those seven to ``elastic_np::attention_double_backward``
(`elastic_np.attention_double_backward`), whose results are the gradients of
``dout``, ``dlse``, ``q``, ``k``, ``v`` and the learnable options. ``out``
and ``lse`` get none: the double backward is the total derivative, through
``q``, ``k``, ``v`` and the options, of which they are the forward's
functions. The double backward has no derivative of its own (a third
derivative raises, naming it).
"""

import numpy as np
import torch

from elastic_np._api import adapters as common
from elastic_np._api import dispatch
from elastic_np._contract import _spec, _validation
from elastic_np.torch import _arrays as arrays
from elastic_np._contract._errors import BackendUnavailableError

#: The operators' option arguments in schema order, ``(name, schema type)``.
OPTION_ARGS = tuple((part.split()[1], part.split()[0]) for o in _spec.OPTIONS for part in o.schema.split(", "))
_NAMES = tuple(name for name, _ in OPTION_ARGS)
_OPTIONS = ", ".join(f"{kind} {name}" for name, kind in OPTION_ARGS)
_GRADS = ("dq", "dk", "dv") + tuple("d" + name for name in common.LEARNABLE)
#: The cotangents of the backward's results, the double backward's first arguments.
_COTANGENTS = tuple("d" + name for name in _GRADS)

FORWARD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}, str backend) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = (f"(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_OPTIONS}, "
                   f"str backend) -> ({', '.join(['Tensor'] * len(_GRADS))})")
DOUBLE_BACKWARD_SCHEMA = (f"({', '.join(f'Tensor? {name}' for name in _COTANGENTS)}, Tensor dout, Tensor? dlse, "
                          f"Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_OPTIONS}, str backend) -> "
                          f"({', '.join(['Tensor'] * (2 + len(_GRADS)))})")


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
        elif kind == "int[]":  # window_size, the only one: checked as the NumPy entry points check it
            value = list(_spec.window_pair(value))
        elif kind == "bool":  # the schema would take 1 for True
            value = _validation.boolean(value, name)
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
        return _host_forward(q, k, v, fixed, learnable)
    out, lse = arrays._cuda_forward(fixed, device, (q, k, v), learnable)
    return out.contiguous(), lse.contiguous()


def _host_forward(q, k, v, fixed, learnable):
    """The forward of CPU tensors (``fixed`` with ``backend``): ``(out, lse)``."""
    fixed = {**fixed, **{name: arrays._host(fixed[name], name) for name in _spec.TENSOR_OPTIONS}}
    host = {name: arrays._host(value, name) for name, value in learnable.items()}
    out, lse = dispatch.attention(*(arrays._host(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))),
                                   return_lse=True, **common.numpy_options(fixed, host))
    out, lse = arrays.from_numpy(out).to(q.dtype), arrays.from_numpy(lse).to(arrays.lse_dtype(q.dtype))
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
        grads = _host_backward(dout, dlse, q, k, v, out, lse, fixed, learnable)
        as_grad = arrays._as_grad
    else:
        grads = arrays._cuda_backward(fixed, device, (dout, q, k, v, out, lse), dlse, learnable)
        as_grad = arrays._cuda_grad
    likes = (q, k, v) + tuple(learnable[name] for name in common.LEARNABLE)
    return tuple(q.new_empty(0) if like is None else as_grad(getattr(grads, name), like).contiguous()
                 for name, like in zip(_GRADS, likes))


def _host_backward(dout, dlse, q, k, v, out, lse, fixed, learnable):
    """`elastic_np.AttentionGrads` of CPU tensors (``fixed`` with ``backend``; its array options tensors or not)."""
    fixed = {**fixed, **{name: arrays._host(fixed[name], name) for name in _spec.TENSOR_OPTIONS}}
    host = {name: arrays._host(value, name) for name, value in learnable.items()}
    return dispatch.attention_backward(*_hosted(dout, q, k, v, out, lse), dlse=arrays._host(dlse, "dlse"),
                                       **common.numpy_options(fixed, host))


@_backward.register_fake
def _backward_shapes(dout, dlse, q, k, v, out, lse, *args):
    values = dict(zip(_NAMES, args))
    return _empty_like_each(q, (q, k, v) + tuple(values[name] for name in common.LEARNABLE))


def _hosted(dout, q, k, v, out, lse):
    """The backward's arrays as NumPy arrays on the host (`_torch_arrays._host`), each named in its errors."""
    return tuple(arrays._host(x, name) for x, name in zip((dout, q, k, v, out, lse),
                                                          ("dout", "q", "k", "v", "out", "lse")))


def _empty_like_each(q, likes):
    """A fake result per entry of ``likes``: an empty tensor like it, or of size 0 for an absent option."""
    return tuple(q.new_empty(0) if like is None else like.new_empty(like.shape) for like in likes)


def _keep(ctx, tensors, args):
    """Save ``tensors`` and the tensors among the option arguments ``args`` for the backward; keep the rest."""
    at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    ctx.args = [None if i in at else a for i, a in enumerate(args)]
    ctx.tensor_at = at
    ctx.save_for_backward(*tensors, *(args[i] for i in at))


def _kept(ctx):
    """``(tensors, args)``: what `_keep` saved, the option arguments whole again."""
    saved = ctx.saved_tensors
    tensors, options = saved[:len(saved) - len(ctx.tensor_at)], saved[len(saved) - len(ctx.tensor_at):]
    args = list(ctx.args)
    for i, tensor in zip(ctx.tensor_at, options):
        args[i] = tensor
    return tensors, args


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    _keep(ctx, (q, k, v, *output), args)


def _gradients(ctx, dout, dlse):
    (q, k, v, out, lse), args = _kept(ctx)
    dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
    dlse = None if dlse is None else dlse.to(lse.dtype)
    grads = dict(zip(("q", "k", "v", *common.LEARNABLE),
                     torch.ops.elastic_np.attention_backward(dout, dlse, q, k, v, out, lse, *args)))
    names = ("q", "k", "v", *_NAMES, "backend")
    return tuple(grads[name] if name in grads and need else None for name, need in zip(names, ctx.needs_input_grad))


_forward.register_autograd(_gradients, setup_context=_setup_context)


@torch.library.custom_op("elastic_np::attention_double_backward", mutates_args=(), schema=DOUBLE_BACKWARD_SCHEMA)
def _double_backward(*args):
    cotangents, (dout, dlse, q, k, v, out, lse), (*options, backend) = args[:7], args[7:14], args[14:]
    if _device(q) is not None:
        raise BackendUnavailableError(
            "elastic_np::attention_double_backward: the CUDA backend has no double backward yet; a second "
            "derivative of elastic_np.torch.attention takes CPU tensors")
    fixed, learnable = _options(options, None)
    fixed["backend"] = backend
    host = {name: arrays._host(value, name) for name, value in learnable.items()}
    ddq, ddk, ddv, *dd = (arrays._host(x, name) for x, name in zip(cotangents, _COTANGENTS))
    grads = dispatch.attention_double_backward(
        ddq, ddk, ddv, *_hosted(dout, q, k, v, out, lse), dlse=arrays._host(dlse, "dlse"),
        **dict(zip(_COTANGENTS[3:], dd)), **common.numpy_options(fixed, host))
    likes = (out, lse, q, k, v) + tuple(learnable[name] for name in common.LEARNABLE)
    return tuple(q.new_empty(0) if like is None else arrays._as_grad(grad, like).contiguous()
                 for grad, like in zip(grads, likes))


@_double_backward.register_fake
def _double_backward_shapes(*args):
    dout, dlse, q, k, v, out, lse = args[7:14]
    values = dict(zip(_NAMES, args[14:]))
    return _empty_like_each(q, (out, lse, q, k, v) + tuple(values[name] for name in common.LEARNABLE))


def _backward_setup_context(ctx, inputs, output):
    dout, dlse, q, k, v, out, lse, *args = inputs
    _keep(ctx, (dout, dlse, q, k, v, out, lse), args)


def _second_gradients(ctx, *cotangents):
    """The gradients of the backward's inputs: ``out`` and ``lse`` get none (see the module's docstring)."""
    (dout, dlse, q, k, v, out, lse), args = _kept(ctx)
    values = dict(zip(_NAMES, args))
    likes = (q, k, v) + tuple(values[name] for name in common.LEARNABLE)
    # None for an absent option's empty result, and for a result the loss did not use
    cotangents = [None if like is None or c is None else c.to(like.dtype) for c, like in zip(cotangents, likes)]
    results = torch.ops.elastic_np.attention_double_backward(*cotangents, dout, dlse, q, k, v, out, lse, *args)
    grads = dict(zip(("dout", "dlse", "q", "k", "v", *common.LEARNABLE), results))
    names = ("dout", "dlse", "q", "k", "v", "out", "lse", *_NAMES, "backend")
    return tuple(grads[name] if name in grads and need else None for name, need in zip(names, ctx.needs_input_grad))


_backward.register_autograd(_second_gradients, setup_context=_backward_setup_context)


def attention(q, k, v, fixed, learnable):
    """``(out, lse)`` through ``elastic_np::attention``, from `common.split`'s options (``fixed`` with ``backend``).

    An eager call on CPU tensors skips the operator, whose dispatch would be
    most of a small call: one that records no gradient (plain tensors) runs
    the operator's forward directly (`_host_forward`, the same code and
    bits), one that records a gradient (plain tensors or parameters) runs it
    in `_EagerAttention`, whose backward is the operator's (see there).
    Anything else (``torch.compile`` tracing, a ``torch.func`` transform, any
    other tensor subclass, CUDA tensors) goes through the operator.
    """
    if _plain_inference(q, k, v, fixed, learnable):
        return _host_forward(q, k, v, fixed, learnable)
    if _on_host(q, k, v, fixed, learnable, _TRAINED) is not None:
        return _EagerAttention.apply(q, k, v, tuple(fixed), *fixed.values(),
                                     *(learnable[name] for name in common.LEARNABLE))
    backend = fixed["backend"]
    args = op_arguments({n: x for n, x in fixed.items() if n != "backend"}, learnable)
    return torch.ops.elastic_np.attention(q, k, v, *args, backend)


#: The tensor types an eager call without gradient, and one with, takes past the operator (`_on_host`).
_PLAIN, _TRAINED = (torch.Tensor,), (torch.Tensor, torch.nn.Parameter)


def _on_host(q, k, v, fixed, learnable, kinds):
    """The call's tensors if it may skip the operator (eager, CPU tensors of types ``kinds``), else None."""
    tensors = [x for x in (q, k, v, *learnable.values(), *(fixed[n] for n in _spec.TENSOR_OPTIONS))
               if isinstance(x, torch.Tensor)]
    if fixed.get("backend") == "cuda" or _device(q) is not None:  # the CUDA backend's tensors
        return None
    if any(type(x) not in kinds or x.device.type != "cpu" for x in tensors):
        return None
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None
    if torch._C._functorch.peek_interpreter_stack() is not None:  # torch.func's tensors are wrapped
        return None
    return tensors


def _plain_inference(q, k, v, fixed, learnable):
    """Whether the call may skip the operator: eager, no gradient recorded, plain CPU tensors (`attention`)."""
    tensors = _on_host(q, k, v, fixed, learnable, _PLAIN)
    return tensors is not None and not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors))


class _EagerAttention(torch.autograd.Function):
    """``elastic_np::attention`` and its gradients for an eager call on CPU tensors, without the operators.

    ``apply(q, k, v, names, *values)``: ``names`` those of ``fixed``, then
    its values and those of `common.LEARNABLE`, as `attention` takes them
    (Python scalars stay scalars, so that the forward runs through
    `elastic_np.attention`'s plan). The forward is `_host_forward`, the
    backward `_host_backward`, with the operators' bits; a backward that
    records its own graph (``create_graph=True``) calls
    ``elastic_np::attention_backward``, whose derivative is the double
    backward. An unused ``out`` or ``lse`` gets no cotangent (None), as
    through the operator.
    """

    @staticmethod
    def forward(ctx, q, k, v, names, *values):
        fixed, learnable = _unpacked(names, values)
        out, lse = _host_forward(q, k, v, fixed, learnable)
        ctx.set_materialize_grads(False)
        ctx.names = names
        _keep(ctx, (q, k, v, out, lse), values)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        (q, k, v, out, lse), values = _kept(ctx)
        fixed, learnable = _unpacked(ctx.names, values)
        dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
        dlse = None if dlse is None else dlse.to(lse.dtype)
        likes = (q, k, v) + tuple(learnable[name] for name in common.LEARNABLE)
        if torch.is_grad_enabled():  # create_graph: the operator, differentiable
            args = op_arguments({n: x for n, x in fixed.items() if n != "backend"}, learnable)
            grads = torch.ops.elastic_np.attention_backward(dout, dlse, q, k, v, out, lse, *args, fixed["backend"])
        else:
            result = _host_backward(dout, dlse, q, k, v, out, lse, fixed, learnable)
            grads = [arrays._as_grad(getattr(result, name), like).contiguous() if isinstance(like, torch.Tensor)
                     else None for name, like in zip(_GRADS, likes)]
        needs = ctx.needs_input_grad
        return (*(g if need else None for g, need in zip(grads[:3], needs)), None, *(None,) * len(fixed),
                *(g if need else None for g, need in zip(grads[3:], needs[4 + len(fixed):])))


def _unpacked(names, values):
    """``(fixed, learnable)`` from `_EagerAttention`'s ``names`` and ``values``."""
    fixed = dict(zip(names, values))
    return fixed, dict(zip(common.LEARNABLE, values[len(names):]))
