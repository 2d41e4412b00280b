"""A user's ``score_mod`` and ``mask_mod`` compiled by Numba, and their ``captures`` checked.

Each function is compiled once per process and signature (the dtype of the
score, the captures' types): `compiled_score`, `compiled_mask`. Its return
type is checked then, so a function that returns something else is an
error at its first call, naming it.
"""

import types as types_module
import weakref

import numba
import numpy as np
from numba import njit, types
from numba.core import errors as numba_errors
from numba.extending import is_jitted, overload

#: The dtypes a floating capture may have (the kernels read it as it is).
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_JITTED = weakref.WeakKeyDictionary()  # the user's Python function -> {replacements' id: its Numba dispatcher}


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
        if not a.dtype.isnative:
            raise TypeError(f"{name} is not in the machine's byte order ({a.dtype.str}): pass "
                            f"`a.astype(a.dtype.newbyteorder('='))`")
        if a.dtype.kind not in "biuf" or (a.dtype.kind == "f" and a.dtype not in FLOAT_DTYPES):
            raise TypeError(f"{name} has dtype {a.dtype}; captures are bool, integer, float32 or float64 arrays")
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


def jitted(fn, name, replacements=None, narrow=False):
    """``fn`` compiled by Numba (``fastmath=False``, NumPy's error model), once per function and ``replacements``.

    ``replacements``: a mapping from modules or functions that ``fn``'s
    globals and closure hold (``math``, ``math.tanh``) to what it calls
    instead (a backend's vectorised ``tanh``), or None. ``narrow``: its float
    constants become float32 (those float32 holds finite and nonzero, or 0),
    as a Python float meets a float32 tensor in PyTorch: a float32 score
    then stays float32 through ``score / 30.0``. A `TypeError` if ``fn`` is
    no function. A numba.njit function is taken as it is.
    """
    if is_jitted(fn):
        return fn
    if not callable(fn) or not hasattr(fn, "__code__"):
        raise TypeError(f"`{name}` must be a Python function (or a numba.njit one), got {type(fn).__name__}")
    key = (None if replacements is None else id(replacements), narrow)
    by_replacements = _JITTED.setdefault(fn, {})
    dispatcher = by_replacements.get(key)
    if dispatcher is None:
        source = fn if replacements is None and not narrow else rebound(fn, replacements or {}, narrow)
        dispatcher = by_replacements[key] = njit(fastmath=False, error_model="numpy")(source)
    return dispatcher


def narrowed(value):
    """A float constant as float32 where float32 holds it (finite, and nonzero unless it is 0)."""
    if type(value) is not float:
        return value
    narrow = np.float32(value) if abs(value) <= float(np.finfo(np.float32).max) else None
    return value if narrow is None or (narrow == 0 and value != 0) else narrow


def rebound(fn, replacements, narrow=False):
    """``fn`` with the globals and closure cells that ``replacements`` names replaced, its float constants
    float32 with ``narrow`` (its code otherwise unchanged)."""
    def swap(value):
        try:
            return replacements.get(value, value)
        except TypeError:  # unhashable
            return value

    namespace = {name: swap(value) for name, value in fn.__globals__.items()}
    closure = None if fn.__closure__ is None else tuple(
        types_module.CellType(swap(cell.cell_contents)) for cell in fn.__closure__)
    code = fn.__code__
    if narrow:
        with np.errstate(over="ignore"):
            code = code.replace(co_consts=tuple(narrowed(c) for c in code.co_consts))
    made = types_module.FunctionType(code, namespace, fn.__name__, fn.__defaults__, closure)
    made.__kwdefaults__ = fn.__kwdefaults__
    return made


def compiled_score(score_mod, captures, dtype, replacements=None):
    """``score_mod`` compiled for a score of ``dtype`` (the kernels'), int64 indices and ``captures``
    (``replacements`` as `jitted` takes them)."""
    score_type = numba.from_dtype(np.dtype(dtype))
    signature = (score_type,) + (types.int64,) * 4
    narrow = np.dtype(dtype) == np.float32
    result = _scalar_type(_compiled(score_mod, "score_mod", signature, captures, replacements, narrow))
    if not isinstance(result, (types.Float, types.Integer, types.Boolean)):
        raise TypeError(f"`score_mod` must return a real number; it returns {result}")
    return jitted(score_mod, "score_mod", replacements, narrow)


def compiled_mask(mask_mod, captures, replacements=None):
    """``mask_mod`` compiled for int64 indices and ``captures``; a `TypeError` unless it returns a bool."""
    result = _scalar_type(_compiled(mask_mod, "mask_mod", (types.int64,) * 4, captures, replacements))
    if not isinstance(result, types.Boolean):
        raise TypeError(f"`mask_mod` must return a bool (True keeps the entry); it returns {result}")
    return jitted(mask_mod, "mask_mod", replacements)


def _scalar_type(result):
    """The type of a scalar result, that of its value for a 0-d array (Numba's ``np.where`` of scalars)."""
    if isinstance(result, types.Array) and result.ndim == 0:
        return result.dtype
    return result


def _compiled(fn, name, leading, captures, replacements=None, narrow=False):
    """The return type of ``fn`` compiled for ``leading`` types and the captures' types."""
    dispatcher = jitted(fn, name, replacements, narrow)
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
