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
"""

import functools

from llvmlite import ir
from numba import carray, cfunc, types
from numba.core import cgutils
from numba.extending import intrinsic

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


def _calling(name, arity):
    """Intrinsic that calls ``elastic_np_<name>_<dtype>`` with ``arity`` arguments, arrays flattened."""

    def codegen(context, builder, signature, args):
        values = []
        for ty, value in zip(signature.args, args):
            if isinstance(ty, types.Array):
                array = context.make_array(ty)(context, builder, value)
                values.append(array.data)
                values += cgutils.unpack_tuple(builder, array.shape, ty.ndim)
            else:
                values.append(context.cast(builder, value, ty, types.intp))
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


def _entry_points(public, body, needs):
    """The intrinsic that calls ``public`` (a typed function) through C entry points running ``body``.

    ``public`` gives the arguments; ``needs`` are the typed functions
    ``body`` calls, which `compile_for` compiles before it builds the entry
    point of the dtype (``make_entry()``, a `numba.cfunc`) and registers it.
    """
    name = public.__name__
    signatures = {sig.args[0].dtype: sig for sig in _signatures(public)}
    calling = _calling(name, len(signatures[_DTYPES[0]].args))
    calling.needs = needs
    calling.entries = {
        dtype: (_symbol(name, dtype), functools.partial(_compile_entry, _c_signature(signatures[dtype]), body))
        for dtype in _DTYPES
    }
    return calling


def _compile_entry(signature, body):
    return cfunc(signature, cache=True, fastmath=False)(body)


# The bodies call what the typed functions call, one level down: the C
# entry point is then the only function that links the product's code.


def _matmul_nn(a, a0, a1, b, b0, b1, c, c0, c1, m, n, k, accumulate):
    c = carray(c, (c0, c1))
    _products._matmul(carray(a, (a0, a1)), carray(b, (b0, b1)), c, m, n, k, accumulate != 0, False, c.reshape(c.size), 0)


def _matmul_tn(a, a0, a1, b, b0, b1, c, c0, c1, m, n, k, accumulate):
    c = carray(c, (c0, c1))
    _products._matmul(carray(a, (a0, a1)), carray(b, (b0, b1)), c, m, n, k, accumulate != 0, True, c.reshape(c.size), 0)


def _matmul_nn_max(a, a0, a1, b, b0, b1, c, c0, c1, m, n, k, col_max, n_max, nonneg, accumulate):
    _products._matmul(
        carray(a, (a0, a1)), carray(b, (b0, b1)), carray(c, (c0, c1)), m, n, k, accumulate != 0, False,
        carray(col_max, (n_max,)), 2 if nonneg != 0 else 1,
    )


def _exp_inplace(x, x0, x1, m, n):
    _exp.exp_inplace(carray(x, (x0, x1)), m, n)


def _exp_shift_sum(x, x0, x1, m, n, shift, n_shift, nvm, sums, n_sums):
    _exp.exp_shift_sum(carray(x, (x0, x1)), m, n, carray(shift, (n_shift,)), nvm != 0, carray(sums, (n_sums,)))


matmul_nn = _entry_points(_products.matmul_nn, _matmul_nn, (_products._matmul,))
matmul_tn = _entry_points(_products.matmul_tn, _matmul_tn, (_products._matmul,))
matmul_nn_max = _entry_points(_products.matmul_nn_max, _matmul_nn_max, (_products._matmul,))
exp_inplace = _entry_points(_exp.exp_inplace, _exp_inplace, (_exp.exp_inplace,))
exp_shift_sum = _entry_points(_exp.exp_shift_sum, _exp_shift_sum, (_exp.exp_shift_sum,))
