"""`elastic_np.torch.varlen_attention`: the operators ``elastic_np::varlen_attention`` and its backward.

The packed counterpart of ``elastic_np.torch._ops``: the operators call
`elastic_np.varlen_attention` and `elastic_np.varlen_attention_backward` on
NumPy views of CPU tensors. Their option arguments are those of
``elastic_np::attention`` (built from the option table) less the ones a
packed batch does not take, with the per-sequence ``mask`` and ``bias``
(`elastic_np._api.varlen.PER_SEQUENCE`) as lists of tensors, ``Tensor[]?``, and a quantized cache's
``k_scale`` and ``v_scale`` (`elastic_np._api.varlen.CACHE_SCALES`). The
backward's results are the gradients of ``q``, ``k``, ``v``, ``tau``,
``beta``, ``sigma`` (an empty tensor where an option is absent) and the list
of the biases' gradients.
"""

import functools

import torch

from elastic_np._api import adapters as common
from elastic_np._api import varlen
from elastic_np._contract import _spec
from elastic_np.torch import _ops
from elastic_np.torch import _arrays as arrays

#: The operators' option arguments in schema order, ``(name, schema type)``.
OPTION_ARGS = tuple(
    (name, "Tensor[]?" if name in varlen.PER_SEQUENCE else kind) for name, kind in _ops.OPTION_ARGS
    if name not in _spec.PER_CALL or name in varlen.PER_SEQUENCE or name in varlen.CACHE_SCALES
)
_NAMES = tuple(name for name, _ in OPTION_ARGS)
_OPTIONS = ", ".join(f"{kind} {name}" for name, kind in OPTION_ARGS)
#: The learnable options given as one tensor, and those given as a list of tensors (one per sequence).
_LEARNABLE = tuple(name for name in common.LEARNABLE if name not in varlen.PER_SEQUENCE)
_LEARNABLE_LISTS = tuple(name for name in common.LEARNABLE if name in varlen.PER_SEQUENCE)
#: The packed batch's own arguments, after ``q, k, v`` (``cu_seqlens_k`` may be None with ``block_table``).
_BATCH = ("cu_seqlens_q", "cu_seqlens_k", "max_q", "max_k", "block_table", "seqused_k")
_BATCH_SCHEMA = "Tensor cu_seqlens_q, Tensor? cu_seqlens_k, int? max_q, int? max_k, Tensor? block_table, " \
                "Tensor? seqused_k"

FORWARD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_BATCH_SCHEMA}, {_OPTIONS}, str backend) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = (f"(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                   f"{_BATCH_SCHEMA}, {_OPTIONS}, str backend) -> "
                   f"({', '.join(['Tensor'] * (3 + len(_LEARNABLE)) + ['Tensor[]'] * len(_LEARNABLE_LISTS))})")


def op_arguments(fixed, learnable):
    """The operators' option arguments from `common.split`'s ``(fixed, learnable)``: arrays as tensors."""
    return _ops.op_arguments(fixed, learnable, OPTION_ARGS)


def _host_options(args):
    """The keyword options of `elastic_np.varlen_attention` from the operators' option arguments."""
    values = dict(zip(_NAMES, args))
    values["window_size"] = tuple(values["window_size"])
    for name, kind in OPTION_ARGS:
        if kind == "Tensor[]?" and values[name] is not None:
            values[name] = [arrays._host(x, f"{name}[{s}]") for s, x in enumerate(values[name])]
        elif kind == "Tensor?":
            values[name] = arrays._host(values[name], name)
    learnable = {name: values.pop(name) for name in common.LEARNABLE}
    return common.numpy_options(values, learnable)


def _batch(batch):
    """The packed batch's arguments as host arrays, by name."""
    return {name: arrays._host(x, name) for name, x in zip(_BATCH, batch)}


@torch.library.custom_op("elastic_np::varlen_attention", mutates_args=(), schema=FORWARD_SCHEMA)
def _forward(q, k, v, *args):
    *args, backend = args
    batch, options = _batch(args[:len(_BATCH)]), _host_options(args[len(_BATCH):])
    out, lse = varlen.varlen_attention(*(arrays._host(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))),
                                        **batch, return_lse=True, backend=backend, **options)
    out, lse = arrays.from_numpy(out).to(q.dtype), arrays.from_numpy(lse).to(arrays.lse_dtype(q.dtype))
    return out.contiguous(), lse.contiguous()


@_forward.register_fake
def _forward_shapes(q, k, v, *args):
    return q.new_empty((*q.shape[:2], v.shape[-1])), q.new_empty(q.shape[:2], dtype=arrays.lse_dtype(q.dtype))


@torch.library.custom_op("elastic_np::varlen_attention_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _backward(dout, dlse, q, k, v, out, lse, *args):
    *args, backend = args
    batch, options = _batch(args[:len(_BATCH)]), _host_options(args[len(_BATCH):])
    if batch.pop("block_table") is not None:
        raise ValueError("varlen attention has no backward over a paged cache (`block_table`): the forward only")
    grads = varlen.varlen_attention_backward(
        *(arrays._host(x, n) for x, n in ((dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"),
                                          (lse, "lse"))),
        **batch, dlse=arrays._host(dlse, "dlse"), backend=backend, **options)
    values = dict(zip(_NAMES, args[len(_BATCH):]))
    named = dict(zip(("q", "k", "v"), (q, k, v)), **{name: values[name] for name in _LEARNABLE})
    tensors = tuple(q.new_empty(0) if like is None else _grad(common.grad_of(grads, name), like)
                    for name, like in named.items())
    lists = tuple([_grad(g, like) for g, like in zip(common.grad_of(grads, name) or [], values[name] or [])]
                  for name in _LEARNABLE_LISTS)
    return (*tensors, *lists)


def _grad(grad, like):
    return arrays._as_grad(grad, like).contiguous()


@_backward.register_fake
def _backward_shapes(dout, dlse, q, k, v, out, lse, *args):
    values = dict(zip(_NAMES, args[len(_BATCH):]))
    likes = (q, k, v) + tuple(values[name] for name in _LEARNABLE)
    tensors = tuple(q.new_empty(0) if like is None else like.new_empty(like.shape) for like in likes)
    return (*tensors, *([b.new_empty(b.shape) for b in values[name] or []] for name in _LEARNABLE_LISTS))


def _setup_context(ctx, inputs, output):
    """Keep the inputs for the backward: every tensor (those in lists too) saved, the rest as it is."""
    q, k, v, *args = inputs
    ctx.args, saved, ctx.tensor_at = [], [], []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            ctx.tensor_at.append((i, None))
            saved.append(a)
            a = None
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            ctx.tensor_at.append((i, len(a)))
            saved.extend(a)
            a = None
        ctx.args.append(a)
    ctx.save_for_backward(q, k, v, *output, *saved)


def _gradients(ctx, dout, dlse):
    q, k, v, out, lse, *saved = ctx.saved_tensors
    args = list(ctx.args)
    at = 0
    for i, count in ctx.tensor_at:
        args[i] = saved[at] if count is None else list(saved[at:at + count])
        at += 1 if count is None else count
    if args[_BATCH.index("block_table")] is not None:
        raise RuntimeError("elastic_np.torch.varlen_attention has no backward over a paged cache (`block_table`): "
                           "call it under torch.no_grad(), or gather the pages into packed keys")
    dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
    dlse = None if dlse is None else dlse.to(lse.dtype)
    results = torch.ops.elastic_np.varlen_attention_backward(dout, dlse, q, k, v, out, lse, *args)
    grads = dict(zip(("q", "k", "v", *_LEARNABLE, *_LEARNABLE_LISTS), results))
    names = ("q", "k", "v", *_BATCH, *_NAMES, "backend")
    return tuple(_gradient(grads.get(name), need) for name, need in zip(names, ctx.needs_input_grad))


def _gradient(grad, need):
    """An input's gradient where it needs one, else None; a list of tensors gets a list (of Nones)."""
    if isinstance(need, (list, tuple)):
        return [g if n else None for g, n in zip(grad or [None] * len(need), need)]
    return grad if need else None


_forward.register_autograd(_gradients, setup_context=_setup_context)


def varlen_attention(q, k, v, batch, fixed, learnable):
    """``(out, lse)`` through ``elastic_np::varlen_attention``.

    ``batch`` maps the names of `_BATCH` to their values; ``fixed`` and
    ``learnable`` are `common.split`'s options, ``fixed`` with ``backend``.
    """
    backend = fixed["backend"]
    args = op_arguments({n: x for n, x in fixed.items() if n != "backend"}, learnable)
    return torch.ops.elastic_np.varlen_attention(q, k, v, *(batch[name] for name in _BATCH), *args, backend)


#: `elastic_np.varlen_attention`'s names (FlashAttention's) of the first arguments, by torch's ``varlen_attn`` names.
OUR_NAMES = {"q": "query", "k": "key", "v": "value", "cu_seqlens_q": "cu_seq_q", "cu_seqlens_k": "cu_seq_k"}


def taking_our_names(fn):
    """``fn``, with torch's names of `OUR_NAMES`, also taking ours by keyword."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for ours, torchs in OUR_NAMES.items():
            if ours in kwargs:
                if torchs in kwargs:
                    raise TypeError(f"{fn.__name__}() got both `{torchs}` and `{ours}`, two names of one argument")
                kwargs[torchs] = kwargs.pop(ours)
        return fn(*args, **kwargs)

    return wrapper


def wants_aux_lse(return_aux, return_lse):
    """Whether torch's ``return_aux`` asks for ``lse``; an error for what else it asks, or with ``return_lse``.

    ``return_aux`` is None or ``torch.nn.attention.varlen.AuxRequest`` (a
    named tuple of bools, of which elastic_np computes ``lse``).
    """
    if return_aux is None:
        return False
    fields = getattr(return_aux, "_asdict", None)
    if fields is None or "lse" not in fields():
        raise TypeError(f"`return_aux` must be None or torch.nn.attention.varlen.AuxRequest, got "
                        f"{type(return_aux).__name__} {return_aux!r}")
    others = [name for name, wanted in fields().items() if wanted and name != "lse"]
    if others:
        raise ValueError(f"`return_aux` asks for {', '.join(others)}, which elastic_np does not compute (it "
                         "returns `lse` alone)")
    if return_aux.lse and return_lse:
        raise ValueError("give `return_aux=AuxRequest(lse=True)` (torch's lse, (H, total_q)) or `return_lse=True` "
                         "(elastic_np's, (total_q, H)), not both")
    return bool(return_aux.lse)


def check_num_splits(num_splits):
    """A `ValueError` for a ``num_splits`` other than None or 1 (torch's split-KV count on a GPU)."""
    if num_splits is not None and (isinstance(num_splits, bool) or num_splits != 1):
        raise ValueError(f"`num_splits`={num_splits!r} sets the split-KV count of torch's GPU kernel; the CPU "
                         "kernels split each sequence's keys as a call of that sequence alone would, so its "
                         "bits never depend on the rest of the batch (what torch's num_splits=1 gives): pass "
                         "None or 1")
