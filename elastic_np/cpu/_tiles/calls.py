"""The tile primitives as the kernels call them: through C symbols, not linked into each kernel.

A Numba function that calls another links the callee's code into its own
module and optimises it again, so every kernel would carry, and compile,
its own copy of the products and the exponential, a large share of its
code. Instead each primitive is compiled once per dtype behind a C entry
point (`numba.cfunc`, cached like the rest), whose address
`elastic_np.cpu._tiles.simd.compile_for` registers with LLVM as the symbol
``elastic_np_<name>_<dtype>``; the functions below, called from jit code
with the primitive's own arguments, emit a call to that symbol. Compiled
code refers to it by name, so a kernel loaded from the cache in a new
process finds it once `compile_for` has run (the CPU backend calls it
before any kernel).

Each array travels as its data pointer and shape, each flag as an integer;
only the types the typed function takes are accepted (a strided view, which
pointer and shape would misdescribe, is a typing error, as in a direct call).
The three products share one entry point, ``elastic_np_matmul_<dtype>``: a
factor that starts at a column of its array (a tile of one head of a
``(B, N, H, D)`` array) travels as the whole array's pointer and shape and
that column, so that the entry point's arrays cover exactly what it may read.
The mechanism is Numba's internals (`elastic_np.cpu._runtime.numba_private`); where
its paths ``entry_points`` and ``lazy_stages`` are off, the kernels call the
typed functions and the stages themselves (`elastic_np.cpu._tiles.logits.modify_tile`,
`elastic_np.cpu._prefill.dbias.dbias_tile`).
"""

import functools
import types as pytypes

import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic
from numba.np import numpy_support

from elastic_np.cpu._runtime import numba_private as private
from elastic_np.cpu._tiles import exp, products
from elastic_np.cpu._tiles.simd import _DTYPES, _signatures


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


def _entry_points(public, body, needs, name=None, c_signatures=None, arrange=None):
    """The intrinsic that calls ``public`` (a typed function) through C entry points running ``body``.

    ``public`` gives the arguments; ``needs`` are the typed functions
    ``body`` calls, which `compile_for` compiles before it builds the entry
    point of the dtype (``make_entry()``, a `numba.cfunc`) and registers it.
    An entry point several functions share has its own ``name`` and
    ``c_signatures`` (by dtype); ``arrange`` maps each caller's flattened
    arguments onto it (see `elastic_np.cpu._runtime.numba_private.call_codegen`).
    """
    name = name or public.__name__
    signatures = {sig.args[0].dtype: sig for sig in _signatures(public)}
    if c_signatures is None:
        c_signatures = {dtype: _c_signature(sig) for dtype, sig in signatures.items()}
    calling = private.symbol_call(functools.partial(_symbol, name), signatures, arrange)
    calling.needs = needs
    calling.entries = {
        dtype: (_symbol(name, dtype), functools.partial(private.cached_cfunc, c_signatures[dtype], body))
        for dtype in _DTYPES
    }
    return calling


# The bodies call what the typed functions call, one level down: the C
# entry point is then the only function that links the product's code.


def _matmul(a, a0, a1, a_col, b, b0, b1, b_col, c, c0, c1, m, n, k, accumulate, transposed, col_max, n_max,
            max_mode):
    products._matmul(
        carray(a, (a0, a1)), a_col, carray(b, (b0, b1)), b_col, carray(c, (c0, c1)), m, n, k, accumulate != 0,
        transposed != 0, carray(col_max, (n_max,)), max_mode,
    )


def _exp_inplace(x, x0, x1, m, n):
    exp.exp_inplace(carray(x, (x0, x1)), m, n)


def _exp_shift_sum(x, x0, x1, m, n, shift, n_shift, nvm, sums, n_sums):
    exp.exp_shift_sum(carray(x, (x0, x1)), m, n, carray(shift, (n_shift,)), nvm != 0, carray(sums, (n_sums,)))


# The three products share one entry point (`products._matmul` takes the
# variant as arguments), compiled once per dtype rather than once per variant.
_MATMUL_C = {sig.args[0].dtype: _c_signature(sig) for sig in _signatures(products._matmul)}


def _with_flags(transposed):
    """``matmul_nn``'s or ``matmul_tn``'s values, then ``transposed``, no maxima (``c``'s pointer, size 0, mode 0)."""

    def arrange(builder, values):
        c_pointer, intp = values[8], values[11].type
        return values + [ir.Constant(intp, transposed), c_pointer, ir.Constant(intp, 0), ir.Constant(intp, 0)]

    return arrange


def _with_maxima(builder, values):
    """``matmul_nn_max``'s values ``(..., m, n, k, col_max, n_max, nonneg, accumulate)`` in the entry point's order."""
    head, (col_max, n_max, nonneg, accumulate) = values[:14], values[14:]
    mode = builder.add(nonneg, ir.Constant(nonneg.type, 1))  # 2 for entries >= 0 only, else 1
    return head + [accumulate, ir.Constant(nonneg.type, 0), col_max, n_max, mode]


if private.enabled("entry_points"):
    matmul_nn = _entry_points(
        products.matmul_nn, _matmul, (products._matmul,), "matmul", _MATMUL_C, _with_flags(0)
    )
    matmul_tn = _entry_points(
        products.matmul_tn, _matmul, (products._matmul,), "matmul", _MATMUL_C, _with_flags(1)
    )
    matmul_nn_max = _entry_points(
        products.matmul_nn_max, _matmul, (products._matmul,), "matmul", _MATMUL_C, _with_maxima
    )
    exp_inplace = _entry_points(exp.exp_inplace, _exp_inplace, (exp.exp_inplace,))
    exp_shift_sum = _entry_points(exp.exp_shift_sum, _exp_shift_sum, (exp.exp_shift_sum,))
else:  # the typed functions themselves, linked into each kernel
    matmul_nn, matmul_tn, matmul_nn_max = products.matmul_nn, products.matmul_tn, products.matmul_nn_max
    exp_inplace, exp_shift_sum = exp.exp_inplace, exp.exp_shift_sum


# ---------------------------------------------------------------------------
# Stages compiled on first use: the score modifiers and dbias
# ---------------------------------------------------------------------------
#
# The soft-cap, ALiBi and bias stage of a tile (`elastic_np.cpu._tiles.logits._modify_tile`) is
# much code as the rest of the logits pipeline, and the backward's dbias stage
# (`elastic_np.cpu._prefill.dbias._dbias_tile`) is a fifth of the backward
# kernel's. Behind C entry points they are compiled once per dtype instead of
# inside each kernel, and only when a call first needs them: the kernels call a
# trampoline (a few instructions, built by llvmlite when `compile_for` registers
# the symbol) that jumps to the address its slot holds, which
# `elastic_np.cpu._tiles.logits.ensure_modifiers` and
# `elastic_np.cpu._prefill.dbias.ensure_dbias` fill before a kernel needs it.

#: Flags of `modify_tile`, packed into one integer.
WANT_CAP_SLOPE, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, CAPPED_MAX = 1, 4, 8, 16, 32


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


def ensure_lazy(name, dtype, body):
    """Compile (or load from the cache) ``body`` as ``name``'s entry point for ``dtype``; fill its slot."""
    dtype = numpy_support.from_dtype(np.dtype(dtype))
    private.ensure_lazy(_symbol(name, dtype), LAZY_SIGNATURES[name](dtype), body)


def _registered(name, dtype):
    """What `compile_for` registers for a lazy entry point: its trampoline's code."""
    return pytypes.SimpleNamespace(address=private.trampoline(_symbol(name, dtype), LAZY_SIGNATURES[name](dtype))[0])


if private.enabled("lazy_stages"):  # else the kernels link the stages in

    @intrinsic(prefer_literal=False)
    def modify_tile(typingctx, st, cap_slope, tile_max, bias, bias_strides, tau, alibi, diag_shift, tile, bk, flags,
                    softcap):
        """The modifier stage (`elastic_np.cpu._tiles.logits._modify_tile`) on ``st`` through
        ``elastic_np_modify_tile_<dtype>`` (flags: the constants above)."""
        sig = types.void(st, cap_slope, tile_max, bias, bias_strides, tau, alibi, diag_shift, tile, bk, flags, softcap)
        if not all(private.flattens(ty) for ty in sig.args):
            return None
        return sig, private.call_codegen(functools.partial(_symbol, "modify_tile"))

    @intrinsic(prefer_literal=False)
    def dbias_tile(typingctx, dpt, dbias, tile, slot, inv_tau):
        """The dbias stage (`elastic_np.cpu._prefill.dbias._dbias_tile`) through ``elastic_np_dbias_tile_<dtype>``;
        ``tile = (bk, bq, b, h, i0, j0)``."""
        sig = types.void(dpt, dbias, tile, slot, inv_tau)
        if not all(private.flattens(ty) for ty in sig.args):
            return None
        return sig, private.call_codegen(functools.partial(_symbol, "dbias_tile"))

    for _lazy in (modify_tile, dbias_tile):
        _lazy.needs = ()
        _lazy.entries = {
            dtype: (_symbol(_lazy.__name__, dtype), functools.partial(_registered, _lazy.__name__, dtype))
            for dtype in _DTYPES
        }
