"""A user's ``score_mod`` and ``mask_mod`` compiled by Numba, and their ``captures`` checked.

Each function is compiled once per process and signature (the dtype of the
score, the captures' types): `compiled_score`, `compiled_mask`. Its return
type is checked then, so a function that returns something else is an
error at its first call, naming it.
"""

import weakref

import numba
import numpy as np
from numba import njit, types
from numba.core import errors as numba_errors
from numba.core.registry import CPUDispatcher
from numba.extending import overload

#: The dtypes a floating capture may have (the kernels read it as it is).
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_JITTED = weakref.WeakKeyDictionary()  # the user's Python function -> its Numba dispatcher


def checked_captures(captures):
    """``captures`` as a tuple of NumPy arrays, else a `TypeError` or `ValueError` naming the entry.

    Each must be an array (or array_like) with at least one axis, of a bool,
    integer, float32 or float64 dtype in the machine's byte order; a floating
    one must hold no NaN (``-inf`` and ``inf`` are values a function may
    use). The arrays are never written to.
    """
    if isinstance(captures, np.ndarray) or not isinstance(captures, (tuple, list)):
        raise TypeError(f"`captures` must be a tuple of arrays, got {type(captures).__name__}")
    checked = []
    for at, value in enumerate(captures):
        a = np.asarray(value)
        name = f"`captures[{at}]`"
        if a.dtype.kind not in "biuf" or (a.dtype.kind == "f" and a.dtype not in FLOAT_DTYPES):
            raise TypeError(f"{name} has dtype {a.dtype}; captures are bool, integer, float32 or float64 arrays")
        if not a.dtype.isnative:
            raise TypeError(f"{name} is not in the machine's byte order ({a.dtype.str}): pass "
                            f"`a.astype(a.dtype.newbyteorder('='))`")
        if a.ndim == 0:
            raise ValueError(f"{name} is a scalar: pass an array with at least one axis (shape (1,) for one "
                             "value), or write a constant into the function")
        if a.dtype.kind == "f" and np.isnan(a).any():
            raise ValueError(f"{name} contains NaN")
        checked.append(a)
    return tuple(checked)


def floating(captures):
    """Whether each capture is floating (has a gradient)."""
    return tuple(a.dtype.kind == "f" for a in captures)


def jitted(fn, name):
    """``fn`` compiled by Numba (``fastmath=False``), once per function; a `TypeError` if it is no function."""
    if isinstance(fn, CPUDispatcher):
        return fn
    if not callable(fn) or not hasattr(fn, "__code__"):
        raise TypeError(f"`{name}` must be a Python function (or a numba.njit one), got {type(fn).__name__}")
    dispatcher = _JITTED.get(fn)
    if dispatcher is None:
        dispatcher = njit(fastmath=False)(fn)
        _JITTED[fn] = dispatcher
    return dispatcher


def compiled_score(score_mod, captures, dtype):
    """``score_mod`` compiled for a score of ``dtype`` (the kernels'), int64 indices and ``captures``."""
    score_type = numba.from_dtype(np.dtype(dtype))
    result = _scalar_type(_compiled(score_mod, "score_mod", (score_type,) + (types.int64,) * 4, captures))
    if not isinstance(result, (types.Float, types.Integer, types.Boolean)):
        raise TypeError(f"`score_mod` must return a real number; it returns {result}")
    return jitted(score_mod, "score_mod")


def compiled_mask(mask_mod, captures):
    """``mask_mod`` compiled for int64 indices and ``captures``; a `TypeError` unless it returns a bool."""
    result = _scalar_type(_compiled(mask_mod, "mask_mod", (types.int64,) * 4, captures))
    if not isinstance(result, types.Boolean):
        raise TypeError(f"`mask_mod` must return a bool (True keeps the entry); it returns {result}")
    return jitted(mask_mod, "mask_mod")


def _scalar_type(result):
    """The type of a scalar result, that of its value for a 0-d array (Numba's ``np.where`` of scalars)."""
    if isinstance(result, types.Array) and result.ndim == 0:
        return result.dtype
    return result


def _compiled(fn, name, leading, captures):
    """The return type of ``fn`` compiled for ``leading`` types and the captures' types."""
    dispatcher = jitted(fn, name)
    signature = leading + tuple(numba.typeof(a) for a in captures)
    try:
        dispatcher.compile(signature)
    except numba_errors.NumbaError as exc:
        first = str(exc).strip().splitlines()
        raise TypeError(f"`{name}` could not be compiled by Numba for arguments {signature}: "
                        f"{' '.join(first[:3])}") from None
    return dispatcher.overloads[signature].signature.return_type


def scalar_of(x):
    """``x``, or the value of a 0-d array (what Numba's ``np.where`` gives for scalars): for compiled code."""
    return x[()] if isinstance(x, np.ndarray) else x


@overload(scalar_of, jit_options={"fastmath": False})
def _scalar_of(x):
    if isinstance(x, types.Array):
        return lambda x: x[()]
    return lambda x: x
