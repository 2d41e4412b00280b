"""What the single-threaded tile primitives share: the target's SIMD width, their compile options, `compile_for`.

The primitives are small dense building blocks that the kernels of
`elastic_np.cpu` call once per tile, inside a task that one thread runs:
the products (`elastic_np.cpu._tiles.products`), the exponential and the tangent
(`elastic_np.cpu._tiles.exp`) and the block transposes
(`elastic_np.cpu._tiles.transpose`); each module's docstring lists its functions.

All arrays are 2-D, C-contiguous and of one dtype (float32 or float64); they may
be larger than the block used, which is the top-left corner, or for a
product's factors the block from a given column (the row length of the array
is its leading dimension). Each function is compiled for
explicit signatures, one per dtype, when `compile_for` is first called for that
dtype (or loaded from the cache): a float32 caller never waits for the float64
versions. Sizes and ``accumulate`` are runtime arguments, the factors
``a`` and ``b`` may be read-only, and any other layout (a column slice, for
instance) is a typing error rather than a slower extra specialisation.

The vectors run along the rows (contiguous), so the tiles are fastest with
``n`` a multiple of the SIMD width (16 float32 or 8 float64 elements with
AVX-512) and ``n >= 64``.
"""

import threading

import numpy as np
from llvmlite import binding
from numba import njit, types
from numba.core import config
from numba.extending import overload
from numba.np import numpy_support

from elastic_np.cpu._runtime import numba_private

# Only contraction of a*b+c into fused multiply-adds is allowed: IEEE inf/NaN
# semantics and the written order of every sum are kept (full fastmath=True
# buys the products nothing, and would let LLVM reorder the exponential's
# Cody-Waite reduction).
_OPTIONS = dict(cache=True, fastmath={"contract"}, boundscheck=False, error_model="numpy")
#: The same for their helpers (`elastic_np.cpu._runtime.numba_private.inner`).
_INNER_OPTIONS = {name: value for name, value in _OPTIONS.items() if name != "cache"}


# Explicit signatures: exactly one compiled version per dtype, whatever the
# caller passes (literal True/False or sizes, int32 sizes, read-only factors),
# and a clear typing error for anything that is not a 2-D C-contiguous array.
_DTYPES = (types.float32, types.float64)


def _matrix(dtype, readonly=False):
    return types.Array(dtype, 2, "C", readonly=readonly)


#: The functions with explicit signatures: (dispatcher, signatures, typed callees); see `compile_for`.
_TYPED = []


_COMPILED = set()  # (dtype, dispatcher)


_READY = set()  # (dtype, functions) of the compile_for calls done


_COMPILE_LOCK = threading.Lock()


def _typed(signatures, needs=(), **options):
    """``njit(signatures, **options)``, each dtype's signatures compiled by `compile_for`.

    ``needs``: the typed functions it calls, compiled before it. After its
    first `compile_for` the dispatcher compiles nothing else: a call with
    other types is a typing error, as with eager signatures.
    """

    def wrap(fn):
        dispatcher = njit(**options)(fn)
        _TYPED.append((dispatcher, list(signatures), tuple(needs)))
        return dispatcher

    return wrap


def _signatures(dispatcher):
    """The explicit signatures of a typed function."""
    return next(signatures for d, signatures, _ in _TYPED if d is dispatcher)


def compile_for(dtype, functions=None):
    """Compile (or load from the cache) the signatures of ``dtype`` of the tile functions.

    ``functions``: a tuple of the typed tile functions a caller uses (what they call
    comes with them), or of their C entry points (`elastic_np.cpu._tiles.calls`),
    which are then built and registered too; all the typed functions by
    default. Call it before the first compiled caller of that dtype is typed
    (the CPU backend's entry points do, each for what its kernels call);
    cheap once done.
    """
    key = (np.dtype(dtype), functions)
    if key in _READY:
        return
    element = numpy_support.from_dtype(key[0])
    calls = [f for f in functions or () if hasattr(f, "entries")]
    with _COMPILE_LOCK:
        wanted = _wanted(functions, calls)
        for dispatcher, signatures, _ in _TYPED:  # in definition order: callees first
            if dispatcher in wanted and (key[0], dispatcher) not in _COMPILED:
                _compile_signatures(dispatcher, [s for s in signatures if s.args[0].dtype == element])
                _COMPILED.add((key[0], dispatcher))
        for call in calls:
            symbol, make_entry = call.entries[element]
            if not numba_private.linked(symbol):
                numba_private.register_symbol(symbol, make_entry().address)
        _READY.add(key)


def _wanted(functions, calls):
    """The typed functions that ``functions`` (all for None) and the entry points ``calls`` need."""
    wanted = {d for d, _, _ in _TYPED} if functions is None else set(functions) - set(calls)
    wanted.update(d for f in calls for d in f.needs)
    for dispatcher, _, needs in reversed(_TYPED):  # what a function needs is defined before it
        if dispatcher in wanted:
            wanted.update(needs)
    return wanted


def _compile_signatures(dispatcher, signatures):
    """Compile ``signatures`` of a typed function, which compiles nothing else."""
    if not signatures:
        return
    dispatcher.disable_compile(False)
    try:
        for signature in signatures:
            dispatcher.compile(signature)
    finally:
        dispatcher.disable_compile()


_EXP_SIGNATURES = {dtype: types.void(_matrix(dtype), types.intp, types.intp) for dtype in _DTYPES}


def _target_features():
    """The CPU features LLVM compiles for: ``{"avx512f", "avx2", "fma", ...}``."""
    if config.CPU_NAME is not None:  # a portable cache: only the features named
        return {f[1:] for f in (config.CPU_FEATURES or "").split(",") if f.startswith("+")}
    return {name for name, on in binding.get_host_cpu_features().items() if on}


def _vector_bytes(features):
    """Bytes of the widest SIMD register LLVM targets (64, 32 or 16)."""
    if "avx512f" in features:
        return 64
    return 32 if "avx2" in features or "avx" in features else 16


_FEATURES = _target_features()


#: Whether products and sums fuse into one rounding (the exp and tanh error bounds depend on it).
HAS_FMA = "fma" in _FEATURES


#: SIMD register width in bytes and the register count that sizes the blocks.
VECTOR_BYTES = _vector_bytes(_FEATURES)


REGISTERS = 32 if VECTOR_BYTES == 64 else 16


def constant_in_jit_code(width_of):
    """Give ``width_of(array)`` to jit code too, as a compile-time constant of the array's dtype."""

    @overload(width_of, inline="always")
    def _width_overload(x):
        if isinstance(x, types.Array):
            width = width_of(numpy_support.as_dtype(x.dtype))
            return lambda x: width
        return None

    return width_of


#: Bytes of a cache line, the unit in which `transpose_stream` writes.
LINE_BYTES = 64
