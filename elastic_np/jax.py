"""JAX adapter: `attention` with a custom VJP over the CPU kernels.

``import elastic_np.jax`` imports jax (``pip install "elastic_np[jax]"``);
``import elastic_np`` does not.

`attention` is a ``jax.custom_vjp`` function whose forward and backward
call `elastic_np.attention` and `elastic_np.attention_backward` through
``jax.pure_callback``, with the shapes and dtypes of the results declared,
so it works under ``jax.jit``, ``jax.grad`` and ``jax.vmap`` (one kernel call
per mapped element). The residuals are the inputs, ``out`` and ``lse``: the
backward never computes the forward again. The callbacks run on the host; jax
hands them read-only buffers, which the CPU kernels read in place (through a
writeable view of the same memory, `elastic_np.cpu._tiles.operands.kernel_array`).

The backward is a ``jax.custom_vjp`` function too, whose own backward calls
`elastic_np.attention_double_backward`: second derivatives work in reverse
mode (``jax.grad`` of ``jax.grad``, ``jax.jacrev(jax.grad(f))`` for a Hessian),
not in forward mode (``jax.jvp``, ``jax.hessian``, which raise). ``out``
and ``lse`` get no gradient from it: the double backward is the total
derivative, through the inputs of which they are functions.

An option given as a ``jax.Array`` (``tau``, ``beta``, the window's
``sigma``, ``bias``) is differentiable; a Python number or NumPy array is a
constant, passed to the kernels as it is.
"""

import collections

import numpy as np

import jax
import jax.numpy as jnp

from elastic_np._api import adapters as common
from elastic_np._api import dispatch
from elastic_np._contract import _problem, _spec, _validation
from elastic_np._api.adapters import DynamicWindow

__all__ = ["attention", "DynamicWindow"]

#: The dtypes the kernels take (they compute in float32 for bfloat16 and float16).
_KERNEL_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16))


def _check_dtype(x, name):
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype not in _KERNEL_DTYPES:
        raise TypeError(
            f"`{name}` has dtype {x.dtype}; the elastic_np kernels take float32, float64, bfloat16 or "
            "float16: convert it with .astype(jnp.float32)"
        )



def _host(tree):
    """NumPy arrays of the jax arrays a callback receives (views, no copy)."""
    return {name: np.asarray(value) for name, value in tree.items()}


#: Values that stand for traced arrays in `_validate`: valid for ``q, k, v`` and every
#: option (an array of 1 for ``tau`` and the window's ``sigma``, True for a mask, else 0).
_PLACEHOLDERS = {"tau": 1, "sigma": 1, "mask": True}


def _validate(diff, traced, fixed, constants):
    """Raise the errors of `elastic_np.attention` now, rather than from inside a callback.

    ``q``, ``k``, ``v`` and traced arrays are stood for by zero-stride arrays
    of their shape and dtype holding a valid value; everything else is
    checked as it is.
    """
    stand_in = {}
    for name, x in {**diff, **traced}.items():
        if name not in ("q", "k", "v"):  # those the callback checks, once
            try:
                stand_in[name] = np.asarray(x)
                continue
            except jax.errors.TracerArrayConversionError:
                pass
        fill = diff["k"].shape[2] if name == "kv_lengths" else _PLACEHOLDERS.get(name, 0)
        stand_in[name] = np.broadcast_to(np.array(fill, dtype=x.dtype), x.shape)
    learnable = {name: stand_in.get(name, constants.get(name)) for name in common.LEARNABLE}
    options = common.numpy_options({**fixed, **{n: stand_in[n] for n in traced}}, learnable)
    module = dispatch.get_backend(options.pop("backend"))
    _problem.prepare(stand_in["q"], stand_in["k"], stand_in["v"], dtypes=module.dtypes, **options)


#: The custom-VJP functions made so far, by their fixed options: a new one
#: would make jax compile its callbacks again at every call outside ``jit``.
_FUNCTIONS = collections.OrderedDict()
_FUNCTIONS_KEPT = 64


def _hashable(value):
    """``value`` as a hashable key (arrays by dtype, shape and bytes)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_hashable(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    hash(value)
    return value


def _attention_function(fixed, constants, q_dtype, out_shape, lse_shape):
    """`_make_attention`, the same function for the same arguments (the last `_FUNCTIONS_KEPT`)."""
    try:
        key = _hashable((fixed, constants, str(q_dtype), out_shape, lse_shape))
    except TypeError:  # an option jax would not hash either: make one for this call
        return _make_attention(fixed, constants, q_dtype, out_shape, lse_shape)
    function = _FUNCTIONS.get(key)
    if function is None:
        function = _make_attention(fixed, constants, q_dtype, out_shape, lse_shape)
        _FUNCTIONS[key] = function
        while len(_FUNCTIONS) > _FUNCTIONS_KEPT:
            _FUNCTIONS.popitem(last=False)
    return function


def _make_attention(fixed, constants, q_dtype, out_shape, lse_shape):
    """The custom-VJP function ``(diff, traced) -> (out, lse)`` for one set of fixed options.

    ``diff`` holds ``q``, ``k``, ``v`` and the learnable options given as jax
    arrays; ``traced`` the non-differentiable options given as jax arrays
    (``kv_lengths``, ``mask``, ``alibi_slopes``); ``constants`` the rest.
    """
    results = (jax.ShapeDtypeStruct(out_shape, q_dtype), jax.ShapeDtypeStruct(lse_shape, _validation.compute_dtype(q_dtype)))

    def numpy_call(diff, traced):
        learnable = {name: diff.get(name, constants.get(name)) for name in common.LEARNABLE}
        options = common.numpy_options({**fixed, **traced}, learnable)
        return diff["q"], diff["k"], diff["v"], options

    def forward_callback(diff, traced):
        q, k, v, options = numpy_call(_host(diff), _host(traced))
        out, lse = dispatch.attention(q, k, v, return_lse=True, **options)
        return out.astype(q_dtype, copy=False), lse.astype(_validation.compute_dtype(q_dtype), copy=False)

    def as_cotangents(grads, like):
        """The gradients (`elastic_np.AttentionGrads` or `DoubleBackwardGrads`) of the arrays of ``like``."""
        cotangents = {"q": grads.dq, "k": grads.dk, "v": grads.dv}
        cotangents.update({n: common.grad_of(grads, n) for n in common.LEARNABLE if n in like})
        return {name: np.asarray(g).astype(like[name].dtype, copy=False).reshape(like[name].shape)
                for name, g in cotangents.items()}

    def backward_callback(diff, traced, out, lse, dout, dlse):
        diff = _host(diff)
        q, k, v, options = numpy_call(diff, _host(traced))
        grads = dispatch.attention_backward(np.asarray(dout), q, k, v, np.asarray(out),
                                             np.asarray(lse), dlse=np.asarray(dlse), **options)
        return as_cotangents(grads, diff)

    def double_backward_callback(diff, traced, out, lse, dout, dlse, u):
        diff, u = _host(diff), _host(u)
        q, k, v, options = numpy_call(diff, _host(traced))
        out, lse = np.asarray(out), np.asarray(lse)
        grads = dispatch.attention_double_backward(
            u["q"], u["k"], u["v"], np.asarray(dout), q, k, v, out, lse, dlse=np.asarray(dlse),
            **{"dd" + n: u.get(n) for n in common.LEARNABLE}, **options)
        return (grads.ddout.astype(out.dtype, copy=False), np.asarray(grads.ddlse).astype(lse.dtype, copy=False),
                as_cotangents(grads, diff))

    def run(diff, traced):
        return jax.pure_callback(forward_callback, results, diff, traced, vmap_method="sequential")

    def run_forward(diff, traced):
        # through `function` itself, so that a derivative of the backward differentiates out and lse
        out, lse = function(diff, traced)
        return (out, lse), (diff, traced, out, lse)

    def backward(diff, traced, out, lse, dout, dlse):
        shapes = {name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in diff.items()}
        return jax.pure_callback(backward_callback, shapes, diff, traced, out, lse, dout, dlse,
                                 vmap_method="sequential")

    def backward_forward(diff, traced, out, lse, dout, dlse):
        return gradients(diff, traced, out, lse, dout, dlse), (diff, traced, out, lse, dout, dlse)

    def double_backward(residuals, u):
        diff, traced, out, lse, dout, dlse = residuals
        shapes = (jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(lse.shape, lse.dtype),
                  {name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in diff.items()})
        ddout, ddlse, grads = jax.pure_callback(double_backward_callback, shapes, *residuals, u,
                                                vmap_method="sequential")
        # out and lse are the forward's functions of diff, through which the derivative already goes
        return grads, None, None, None, ddout, ddlse

    def run_backward(residuals, cotangents):
        dout, dlse = cotangents  # zeros for an output the loss does not use
        return gradients(*residuals, dout, dlse), None

    gradients = jax.custom_vjp(backward)
    gradients.defvjp(backward_forward, double_backward)
    function = jax.custom_vjp(run)
    function.defvjp(run_forward, run_backward)
    return function


@_spec.takes_options(own=_spec.LEARNABLE)
def attention(q, k, v, *, return_lse=False, backend="auto", **options):
    """`elastic_np.attention` on jax arrays, differentiable in every learnable input.

    Parameters
    ----------
    q, k, v : jax.Array or array_like
        Shapes ``(B, H, N, D)``, ``(B, Hkv, M, D)``, ``(B, Hkv, M, Dv)``,
        float32, float64 (which needs ``jax_enable_x64``), bfloat16 or
        float16, the same for all three.
    tau, beta : float or jax.Array of shape () or (H,), optional
        Temperature (``> 0``) and the sink, the denominator's offset
        (``>= 0``); a jax array gets a gradient.
    dynamic_window : DynamicWindow or elastic_np.DynamicWindow, optional
        The bell-curve window; with `DynamicWindow` a jax array ``sigma``
        (broadcastable to ``(B, H)``) gets a gradient.
    bias : jax.Array, optional
        Additive score bias broadcastable to ``(B, H, N, M)``; gets a gradient
        in its own shape.
    %(other_names)s
        As in `elastic_np.attention`; no gradient. Under ``jax.jit`` the
        Python options (``causal``, ``window_size`` ...) must be static.
    return_lse : bool, optional
        Also return ``lse`` of shape ``(B, H, N)``, differentiable like ``out``
        (a loss may use either or both). A row with ``lse = -inf`` (nothing
        kept, ``beta = 0``) passes no gradient back.
    backend : {"auto", "cpu", "reference"}, optional
        "auto" runs the CPU kernels; "reference" the float64 oracle, its
        results cast to the dtype of ``q``.

    Returns
    -------
    out : jax.Array, shape (B, H, N, Dv)
        In the dtype of ``q``.
    lse : jax.Array, shape (B, H, N)
        Only with ``return_lse=True``; float32 for bfloat16 and float16 inputs.

    Raises
    ------
    TypeError
        For inputs of another floating dtype (convert them with
        ``.astype(jnp.float32)``) or ``q``, ``k``, ``v`` of different dtypes.
    ValueError
        As `elastic_np.attention`, when the call is made (or traced). Checks
        of values only a callback sees (a traced ``tau`` <= 0, NaN in ``q``)
        come in the ``jax.errors.JaxRuntimeError`` that the callback raises.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import elastic_np.jax as enpj
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 2, 5, 8))
    >>> def loss(beta):
    ...     return enpj.attention(q, k, v, causal=True, tau=0.8, beta=beta).sum()
    >>> jax.jit(jax.grad(loss))(jnp.array([0.5, 1.0])).shape
    (2,)
    """
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    fixed, given = common.split(_spec.complete(options, "attention"))
    diff = {"q": q, "k": k, "v": v}
    diff.update({n: x for n, x in given.items() if isinstance(x, jax.Array)})
    for name, x in diff.items():
        _check_dtype(x, name)
    if q.ndim != 4:
        raise ValueError(f"`q` must have 4 dimensions (B, heads, length, dim), got shape {q.shape}")
    constants = {n: x for n, x in given.items() if n not in diff}
    fixed["backend"] = common.kernel_backend(backend)
    traced = {name: fixed.pop(name) for name in _spec.TENSOR_OPTIONS if isinstance(fixed[name], jax.Array)}
    _validate(diff, traced, fixed, constants)
    B, H, N, _ = q.shape if fixed["layout"] == "bhnd" else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    out_shape = (B, H, N, v.shape[-1]) if fixed["layout"] == "bhnd" else (B, N, H, v.shape[-1])
    function = _attention_function(fixed, constants, q.dtype, out_shape, (B, H, N))
    out, lse = function(diff, traced)
    return (out, lse) if return_lse else out
