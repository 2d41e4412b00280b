"""The tile primitives as the kernels call them: through C symbols, not linked into each kernel.

A Numba function that calls another links the callee's code into its own
module and optimises it again, so every kernel would carry, and compile,
its own copy of the products and the exponential, a large share of its
code. Instead each primitive is compiled once per dtype behind a C entry
point (`numba.cfunc`, cached like the rest), whose address
`elastic_np.cpu._simd.compile_for` registers with LLVM as the symbol
``elastic_np_<name>_<dtype>``; the functions below, called from jit code
with the primitive's own arguments, emit a call to that symbol. Compiled
code refers to it by name, so a kernel loaded from the cache in a new
process finds it once `compile_for` has run (the CPU backend calls it
before any kernel).

Each array travels as its data pointer and shape, each flag as an integer.
The three products share one entry point, ``elastic_np_matmul_<dtype>``.
"""

import ctypes
import functools
import threading
import types as pytypes

import numpy as np
from llvmlite import binding, ir
from numba import carray, cfunc, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np import numpy_support

from elastic_np.cpu import _exp, _products
from elastic_np.cpu._simd import _DTYPES, _signatures


def _symbol(name, dtype):
    return f"elastic_np_{name}_{dtype}"


def _c_signature(signature):
    """The C entry point's signature: each array as a pointer and its sizes, each flag as an intp."""
    params = []
    for ty in signature.args:
        if isinstance(ty, types.Array):
            params += [types.CPointer(ty.dtype)] + [types.intp] * ty.ndim
        else:
            params.append(types.intp)
    return types.void(*params)


def _calling(name, arity, arrange=None):
    """Intrinsic that calls ``elastic_np_<name>_<dtype>`` with ``arity`` arguments, arrays flattened.

    ``arrange(builder, values)``, when given, turns the flattened values
    into the entry point's arguments (a shared entry point's extra flags).
    """

    def codegen(context, builder, signature, args):
        values = []
        for ty, value in zip(signature.args, args):
            if isinstance(ty, types.Array):
                array = context.make_array(ty)(context, builder, value)
                values.append(array.data)
                values += cgutils.unpack_tuple(builder, array.shape, ty.ndim)
            else:
                values.append(context.cast(builder, value, ty, types.intp))
        if arrange is not None:
            values = arrange(builder, values)
        dtype = next(ty.dtype for ty in signature.args if isinstance(ty, types.Array))
        fnty = ir.FunctionType(ir.VoidType(), [value.type for value in values])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _symbol(name, dtype))
        builder.call(fn, values)
        return context.get_dummy_value()

    def signature(*args):
        return types.void(*args) if isinstance(args[0], types.Array) else None

    # an intrinsic's typer takes its arguments by name (no *args)
    if arity == 3:
        def typer(typingctx, x, m, n):
            return signature(x, m, n), codegen
    elif arity == 6:
        def typer(typingctx, x, m, n, shift, nvm, sums):
            return signature(x, m, n, shift, nvm, sums), codegen
    elif arity == 7:
        def typer(typingctx, a, b, c, m, n, k, accumulate):
            return signature(a, b, c, m, n, k, accumulate), codegen
    elif arity == 9:
        def typer(typingctx, a, b, c, m, n, k, col_max, nonneg, accumulate):
            return signature(a, b, c, m, n, k, col_max, nonneg, accumulate), codegen
    else:
        raise ValueError(f"no typer for a tile function of {arity} arguments")
    return intrinsic(prefer_literal=False)(typer)


def _entry_points(public, body, needs, name=None, c_signatures=None, arrange=None):
    """The intrinsic that calls ``public`` (a typed function) through C entry points running ``body``.

    ``public`` gives the arguments; ``needs`` are the typed functions
    ``body`` calls, which `compile_for` compiles before it builds the entry
    point of the dtype (``make_entry()``, a `numba.cfunc`) and registers it.
    An entry point several functions share has its own ``name`` and
    ``c_signatures`` (by dtype); ``arrange`` maps each caller's flattened
    arguments onto it (see `_calling`).
    """
    name = name or public.__name__
    signatures = {sig.args[0].dtype: sig for sig in _signatures(public)}
    if c_signatures is None:
        c_signatures = {dtype: _c_signature(sig) for dtype, sig in signatures.items()}
    calling = _calling(name, len(signatures[_DTYPES[0]].args), arrange)
    calling.needs = needs
    calling.entries = {
        dtype: (_symbol(name, dtype), functools.partial(_compile_entry, c_signatures[dtype], body))
        for dtype in _DTYPES
    }
    return calling


def _compile_entry(signature, body):
    return cfunc(signature, cache=True, fastmath=False)(body)


# The bodies call what the typed functions call, one level down: the C
# entry point is then the only function that links the product's code.


def _matmul(a, a0, a1, b, b0, b1, c, c0, c1, m, n, k, accumulate, transposed, col_max, n_max, max_mode):
    _products._matmul(
        carray(a, (a0, a1)), carray(b, (b0, b1)), carray(c, (c0, c1)), m, n, k, accumulate != 0,
        transposed != 0, carray(col_max, (n_max,)), max_mode,
    )


def _exp_inplace(x, x0, x1, m, n):
    _exp.exp_inplace(carray(x, (x0, x1)), m, n)


def _exp_shift_sum(x, x0, x1, m, n, shift, n_shift, nvm, sums, n_sums):
    _exp.exp_shift_sum(carray(x, (x0, x1)), m, n, carray(shift, (n_shift,)), nvm != 0, carray(sums, (n_sums,)))


# The three products share one entry point (`_products._matmul` takes the
# variant as arguments), compiled once per dtype rather than once per variant.
_MATMUL_C = {sig.args[0].dtype: _c_signature(sig) for sig in _signatures(_products._matmul)}


def _with_flags(transposed):
    """``matmul_nn``'s or ``matmul_tn``'s values, then ``transposed``, no maxima (``c``'s pointer, size 0, mode 0)."""

    def arrange(builder, values):
        c_pointer, intp = values[6], values[9].type
        return values + [ir.Constant(intp, transposed), c_pointer, ir.Constant(intp, 0), ir.Constant(intp, 0)]

    return arrange


def _with_maxima(builder, values):
    """``matmul_nn_max``'s values ``(..., m, n, k, col_max, n_max, nonneg, accumulate)`` in the entry point's order."""
    head, (col_max, n_max, nonneg, accumulate) = values[:12], values[12:]
    mode = builder.add(nonneg, ir.Constant(nonneg.type, 1))  # 2 for entries >= 0 only, else 1
    return head + [accumulate, ir.Constant(nonneg.type, 0), col_max, n_max, mode]


matmul_nn = _entry_points(
    _products.matmul_nn, _matmul, (_products._matmul,), "matmul", _MATMUL_C, _with_flags(0)
)
matmul_tn = _entry_points(
    _products.matmul_tn, _matmul, (_products._matmul,), "matmul", _MATMUL_C, _with_flags(1)
)
matmul_nn_max = _entry_points(
    _products.matmul_nn_max, _matmul, (_products._matmul,), "matmul", _MATMUL_C, _with_maxima
)
exp_inplace = _entry_points(_exp.exp_inplace, _exp_inplace, (_exp.exp_inplace,))
exp_shift_sum = _entry_points(_exp.exp_shift_sum, _exp_shift_sum, (_exp.exp_shift_sum,))


# ---------------------------------------------------------------------------
# Stages compiled on first use: the score modifiers and dbias
# ---------------------------------------------------------------------------
#
# The soft-cap, ALiBi and bias stage of a tile (`_logits._modify_tile`) is as
# much code as the rest of the logits pipeline, and the backward's dbias
# stage (`_backward._dbias_tile`) is a fifth of the backward kernel's. Behind
# C entry points they are compiled once per dtype instead of inside each
# kernel, and only when a call first needs them: the kernels call a
# trampoline (a few instructions, built by llvmlite when `compile_for`
# registers the symbol) that jumps to the address its slot holds, which
# `elastic_np.cpu._logits.ensure_modifiers` and
# `elastic_np.cpu._backward.ensure_dbias` fill before a kernel needs it.

#: Flags of `modify_tile`, packed into one integer.
WANT_CAP_SLOPE, OVERWRITE, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, CAPPED_MAX = 1, 2, 4, 8, 16, 32


def _flatten(context, builder, ty, value):
    """An argument as an entry point takes it: arrays as pointer and sizes, tuples item by item,
    floats as doubles, the rest as intp."""
    if isinstance(ty, types.Array):
        array = context.make_array(ty)(context, builder, value)
        return [array.data] + cgutils.unpack_tuple(builder, array.shape, ty.ndim)
    if isinstance(ty, types.BaseTuple):
        return [v for i, t in enumerate(ty) for v in _flatten(context, builder, t, builder.extract_value(value, i))]
    if isinstance(ty, types.Float):
        return [context.cast(builder, value, ty, types.float64)]
    return [context.cast(builder, value, ty, types.intp)]


def _lazy_codegen(name, dtype):
    """Code that calls ``elastic_np_<name>_<dtype>`` with the arguments flattened (`_flatten`)."""

    def codegen(context, builder, sig, args):
        values = [v for ty, value in zip(sig.args, args) for v in _flatten(context, builder, ty, value)]
        fnty = ir.FunctionType(ir.VoidType(), [value.type for value in values])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _symbol(name, dtype))
        builder.call(fn, values)
        return context.get_dummy_value()

    return codegen


@intrinsic(prefer_literal=False)
def modify_tile(typingctx, st, cap_slope, tile_max, bias, bias_strides, tau, alibi, diag_shift, tile, bk, flags,
                softcap):
    """`_logits._modify_tile` on ``st`` through ``elastic_np_modify_tile_<dtype>`` (flags: the constants above)."""
    sig = types.void(st, cap_slope, tile_max, bias, bias_strides, tau, alibi, diag_shift, tile, bk, flags, softcap)
    return sig, _lazy_codegen("modify_tile", st.dtype)


@intrinsic(prefer_literal=False)
def dbias_tile(typingctx, dpt, dbias, tile, slot, inv_tau):
    """`_backward._dbias_tile` through ``elastic_np_dbias_tile_<dtype>``; ``tile = (bk, bq, b, h, i0, j0)``."""
    return types.void(dpt, dbias, tile, slot, inv_tau), _lazy_codegen("dbias_tile", dpt.dtype)


def _vector(dtype, ndim=1):
    return [types.CPointer(dtype)] + [types.intp] * ndim


#: The C signatures of the lazy entry points, by name and dtype.
LAZY_SIGNATURES = {
    "modify_tile": lambda dtype: types.void(
        *_vector(dtype, 2), *_vector(dtype, 2), *_vector(dtype),  # st, cap_slope, tile_max
        *_vector(dtype), *_vector(types.int64), *_vector(types.float64),  # bias, bias_strides, tau
        *_vector(types.float64, 2), *_vector(types.int64),  # alibi, diag_shift
        *[types.intp] * 7, types.float64,  # tile (b, h, i0, bq, j0), bk, flags; softcap
    ),
    "dbias_tile": lambda dtype: types.void(
        *_vector(dtype, 2),  # dpt
        *_vector(types.int64), *_vector(types.int64), *_vector(dtype), *_vector(types.float64, 2),  # dbias
        *[types.intp] * 7, types.float64,  # tile (bk, bq, b, h, i0, j0), slot; inv_tau
    ),
}

_TRAMPOLINES = {}  # symbol -> (execution engine, address of the code, address of the slot)
_TRAMPOLINE_LOCK = threading.Lock()


def _trampoline(name, dtype):
    """``(code, slot)`` addresses: code for ``elastic_np_<name>_<dtype>`` that jumps to the address in the slot."""
    symbol = _symbol(name, dtype)
    with _TRAMPOLINE_LOCK:  # compile_for and ensure_lazy may ask from two threads
        if symbol not in _TRAMPOLINES:
            _TRAMPOLINES[symbol] = _build_trampoline(name, dtype)
    return _TRAMPOLINES[symbol][1:]


def _build_trampoline(name, dtype):
    """``(engine, code address, slot address)`` of a new trampoline for ``name``'s signature."""
    kinds = [
        "double" if ty == types.float64 else "ptr" if isinstance(ty, types.CPointer) else "i64"
        for ty in LAZY_SIGNATURES[name](dtype).args
    ]
    params = ", ".join(f"{kind} %a{n}" for n, kind in enumerate(kinds))
    text = (
        "@slot = global ptr null\n"
        f"define void @jump({params}) {{\n"
        "  %f = load ptr, ptr @slot\n"
        f"  call void %f({params})\n"
        "  ret void\n}\n"
    )
    module = binding.parse_assembly(text)
    module.triple = binding.get_process_triple()
    machine = binding.Target.from_triple(module.triple).create_target_machine()
    engine = binding.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    return engine, engine.get_function_address("jump"), engine.get_global_value_address("slot")


_LAZY = {}  # (name, dtype) -> the compiled entry point (kept alive: its address is in the slot)
_LAZY_LOCK = threading.Lock()


def ensure_lazy(name, dtype, body):
    """Compile (or load from the cache) ``body`` as ``name``'s entry point for ``dtype``; fill its slot."""
    dtype = numpy_support.from_dtype(np.dtype(dtype))
    if (name, dtype) in _LAZY:
        return
    with _LAZY_LOCK:
        if (name, dtype) not in _LAZY:
            entry = cfunc(LAZY_SIGNATURES[name](dtype), cache=True, fastmath=False)(body)
            ctypes.c_void_p.from_address(_trampoline(name, dtype)[1]).value = entry.address
            _LAZY[name, dtype] = entry


def _registered(name, dtype):
    """What `compile_for` registers for a lazy entry point: its trampoline's code."""
    return pytypes.SimpleNamespace(address=_trampoline(name, dtype)[0])


for _lazy in (modify_tile, dbias_tile):
    _lazy.needs = ()
    _lazy.entries = {
        dtype: (_symbol(_lazy.__name__, dtype), functools.partial(_registered, _lazy.__name__, dtype))
        for dtype in _DTYPES
    }
