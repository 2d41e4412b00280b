"""Input validation shared by every public function.

Every check that a public function makes lives here, so that each error
message names the offending parameter in the same words everywhere.
"""

import math
import numbers
import operator

import numpy as np

#: The dtypes the kernels compute in.
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
#: Storage dtypes, by name, that the CPU kernels read and write while computing in
#: float32 (bfloat16 is ``ml_dtypes.bfloat16``, the type JAX uses).
HALF_DTYPES = ("bfloat16", "float16")


def numpy_dtype(dtype):
    """``dtype`` (a dtype, a type or a name such as "bfloat16") as a NumPy dtype.

    "bfloat16" is ``ml_dtypes.bfloat16``, imported only here: NumPy has no
    such type of its own.
    """
    if isinstance(dtype, str) and dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("bfloat16 arrays are ml_dtypes.bfloat16: pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def dtype_name(dtype):
    """``dtype``'s name ("float32", "bfloat16", ...), looked up once per dtype (NumPy builds it anew each time)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        return _DTYPE_NAMES.setdefault(dtype, np.dtype(dtype).name)


_DTYPE_NAMES = {}


def is_half(dtype):
    """True for bfloat16 and float16."""
    return dtype_name(dtype) in HALF_DTYPES


def compute_dtype(dtype):
    """The dtype the kernels compute in for arrays of ``dtype``: float32 for a half, else ``dtype``."""
    dtype = np.dtype(dtype)
    return _FLOAT32 if is_half(dtype) else dtype


_FLOAT32 = np.dtype(np.float32)


def real_float_array(x, name, *, check_finite=True, allow_neg_inf=False):
    """Return ``x`` as a float64 array, rejecting integer, complex and bad values.

    Parameters
    ----------
    x : array_like
        A real floating-point array (any of float16, float32, float64, longdouble).
    name : str
        The parameter name used in error messages.
    check_finite : bool
        Reject NaN and infinite entries with a `ValueError`.
    allow_neg_inf : bool
        With ``check_finite``, still accept ``-inf`` (a masked logit).
    """
    x = np.asarray(x)
    check_real_float_dtype(x, name)
    x = x.astype(np.float64, copy=False)
    if check_finite:
        bad = np.isnan(x) | (x == np.inf) if allow_neg_inf else ~np.isfinite(x)
        if bad.any():
            what = "NaN or +inf" if allow_neg_inf else "NaN or inf"
            raise ValueError(
                f"`{name}` contains {what} at index {np.argwhere(bad)[0].tolist()}; "
                "pass check_finite=False to skip this check"
            )
    return x


def is_real_dtype(dtype):
    """True for real floats (NumPy's and bfloat16) and integers, not bool."""
    return dtype_name(dtype) == "bfloat16" or (
        dtype != np.bool_ and (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)))


def check_real_float_dtype(x, name):
    """A `TypeError` naming ``name`` unless ``x`` holds real floats (NumPy's, or bfloat16)."""
    if x.dtype in _REAL_FLOATS:
        return
    if dtype_name(x.dtype) == "bfloat16":
        _REAL_FLOATS.add(x.dtype)
        return
    if x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.floating):
        hint = ""
        if x.dtype in (np.uint16, np.int16):
            hint = ("; for 16-bit floats held as raw bits, view them as their type: "
                    "a.view(ml_dtypes.bfloat16) or a.view(np.float16)")
        raise TypeError(f"`{name}` must be a real floating-point array, got dtype {x.dtype}{hint}")


#: Dtypes found to be real floats: each is checked once (`numpy.issubdtype` is slow beside a set lookup).
_REAL_FLOATS = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}


def positive_scalar(value, name):
    """A finite float > 0, else a `ValueError` naming ``name``."""
    value = real_scalar(value, name)
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"`{name}` must be finite and > 0, got {value!r}")
    return value


def nonnegative_scalar(value, name):
    """A finite float >= 0, else a `ValueError` naming ``name``."""
    value = real_scalar(value, name)
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"`{name}` must be finite and >= 0, got {value!r}")
    return value


def real_scalar(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (numbers.Real, np.floating, np.integer)
    ):
        if isinstance(value, np.ndarray) and value.ndim == 0:
            return real_scalar(value[()], name)
        raise TypeError(f"`{name}` must be a real number, got {value!r}")
    return float(value)


def reduction_axis(x, axis, name="x"):
    """Normalise ``axis`` for ``x`` and reject an empty reduction axis."""
    if x.ndim == 0:
        raise ValueError(f"`{name}` must have at least one dimension")
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"`axis` must be an integer, got {axis!r}") from None
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"`axis` {axis} is out of bounds for `{name}` of dimension {x.ndim}")
    axis %= x.ndim
    if x.shape[axis] == 0:
        raise ValueError(f"`{name}` has an empty reduction axis (axis={axis})")
    return axis


def per_head(value, H, name, *, positive):
    """Broadcast a scalar or ``(H,)`` parameter to a float64 ``(H,)`` array.

    Returns the array and the shape of ``value`` as given (``()`` for a scalar),
    which is the shape its gradient is returned in.
    """
    if type(value) is float or (type(value) is int and abs(value) < 2**53):
        # the common case, without NumPy's per-call overhead
        if math.isfinite(value) and (value > 0 if positive else value >= 0):
            return np.full(H, float(value)), ()
    arr = np.asarray(value)
    if not is_real_dtype(arr.dtype):
        raise TypeError(f"`{name}` must be a real number or an array of shape (H,)")
    if arr.shape not in ((), (H,)):
        raise ValueError(
            f"`{name}` must be a scalar or have shape (H,) = ({H},), got shape {arr.shape}"
        )
    arr = arr.astype(np.float64)
    bound_ok = arr > 0 if positive else arr >= 0
    if not (np.isfinite(arr).all() and bound_ok.all()):
        rule = "> 0" if positive else ">= 0"
        raise ValueError(f"`{name}` must be finite and {rule}, got {value!r}")
    return np.broadcast_to(arr, (H,)).copy(), arr.shape


def boolean(value, name):
    """``value`` as a bool when it is one (Python or NumPy), else a `TypeError` naming ``name``.

    Truth-testing would take ``"False"`` for True and fail on an array with
    NumPy's ambiguity message; integers are not accepted either.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"`{name}` must be a bool (True or False), got {value!r}")


def check_in_dtype_range(name, values, dtype, *, zero_ok, why=""):
    """Raise a `ValueError` naming ``name`` unless every value fits ``dtype`` as a normal number.

    A value fits when it is finite and its magnitude lies between the
    smallest normal number of ``dtype`` and its maximum; 0 fits where
    ``zero_ok`` (a bool or a boolean array like ``values``) is True. Below
    the normal range a value loses precision or becomes 0; above it, it is
    ``inf``. ``values`` are float64 (a quotient computed in float64 that
    over- or underflows there is out of range for either dtype).
    """
    info = np.finfo(dtype)
    size = np.abs(np.asarray(values, dtype=np.float64))
    fits = (size <= info.max) & ((size >= info.tiny) | ((size == 0) & zero_ok))
    if not fits.all():
        bad = float(np.asarray(values, dtype=np.float64).ravel()[np.argmin(fits.ravel())])
        zero = "0 or " if np.any(zero_ok) else ""
        raise ValueError(
            f"{name} = {bad!r} is out of the range of {np.dtype(dtype)}{why}: it must be "
            f"{zero}between {float(info.tiny):.6g} and {float(info.max):.6g} in magnitude "
            "(below, it underflows; above, it overflows)"
        )


def kv_lengths_array(kv_lengths, B, M):
    """``kv_lengths`` as int64 ``(B,)`` in ``[0, M]`` (all ``M`` when None)."""
    if kv_lengths is None:
        return np.full(B, M, dtype=np.int64)
    lengths = np.asarray(kv_lengths)
    if not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"`kv_lengths` must hold integers, got dtype {lengths.dtype}")
    if lengths.shape != (B,):
        raise ValueError(f"`kv_lengths` must have shape (B,) = ({B},), got {lengths.shape}")
    if ((lengths < 0) | (lengths > M)).any():
        raise ValueError(f"`kv_lengths` must lie in [0, M] = [0, {M}], got {lengths.tolist()}")
    return lengths.astype(np.int64)


def broadcast_mask(mask, shape):
    """A boolean ``mask`` as a read-only view broadcast to ``shape`` (None stays None)."""
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        hint = ""
        if np.issubdtype(mask.dtype, np.floating):
            hint = " (True keeps an entry); a float mask is an additive bias: pass it as `bias=`"
        raise TypeError(f"`mask` must be a boolean array, got dtype {mask.dtype}{hint}")
    try:
        return np.broadcast_to(mask, shape)
    except ValueError:
        raise ValueError(
            f"`mask` of shape {mask.shape} is not broadcastable to (B, H, N, M) = {shape}"
        ) from None


def alibi_array(slopes, B, H):
    """ALiBi slopes as float64 ``(B, H)``, from shape ``(H,)`` or ``(B, H)``."""
    if slopes is None:
        return None
    arr = np.asarray(slopes)
    if not is_real_dtype(arr.dtype):
        raise TypeError(f"`alibi_slopes` must be a real array, got dtype {arr.dtype}")
    if arr.shape not in ((H,), (B, H)):
        raise ValueError(
            f"`alibi_slopes` must have shape (H,) = ({H},) or (B, H) = ({B}, {H}), "
            f"got {arr.shape}"
        )
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise ValueError("`alibi_slopes` contains NaN or inf")
    return np.broadcast_to(arr, (B, H)).copy()


def broadcast_bias(bias, shape, check_values):
    """The bias as a read-only view broadcast to ``shape``, and the shape it came in."""
    if bias is None:
        return None, None
    bias = np.asarray(bias)
    check_real_float_dtype(bias, "bias")
    if bias.ndim > 4:
        raise ValueError(f"`bias` must have at most 4 dimensions, got shape {bias.shape}")
    try:
        view = np.broadcast_to(bias, shape)
    except ValueError:
        raise ValueError(
            f"`bias` of shape {bias.shape} is not broadcastable to (B, H, N, M) = {shape}"
        ) from None
    if check_values:
        check_bias_values(bias)
    return view, bias.shape


#: The error for a bias with NaN or +inf, wherever it is found.
BIAS_VALUES_ERROR = "`bias` contains NaN or +inf (-inf is allowed: it removes the entry)"


#: Entries `all_finite` checks at a time: the temporary its check makes stays this small.
FINITE_CHUNK = 1 << 18


def all_finite(a):
    """Whether every entry of the float array ``a`` is finite, checked in slabs of about `FINITE_CHUNK` entries.

    A slab is a range of the axis of ``a``'s longest stride (of a C-contiguous
    ``a``, of its entries in order), so that each is read in memory order;
    where one index of that axis holds more entries, each is checked so in turn.
    """
    if a.size <= FINITE_CHUNK or a.ndim == 1 and not a.flags.c_contiguous:
        return bool(np.isfinite(a).all())
    if a.flags.c_contiguous:
        flat = a.reshape(-1)
        return all(np.isfinite(flat[i:i + FINITE_CHUNK]).all() for i in range(0, flat.size, FINITE_CHUNK))
    outer = max(range(a.ndim), key=lambda i: abs(a.strides[i]) if a.shape[i] > 1 else -1)
    a = np.moveaxis(a, outer, 0)
    per_index = a.size // a.shape[0]
    if per_index > FINITE_CHUNK:
        return all(all_finite(part) for part in a)
    step = FINITE_CHUNK // per_index
    return all(np.isfinite(a[i:i + step]).all() for i in range(0, a.shape[0], step))


def check_finite(a, name):
    """Raise a `ValueError` naming ``name`` where the float array ``a`` holds a NaN or an inf (`all_finite`)."""
    if not all_finite(a):
        raise ValueError(f"`{name}` contains NaN or inf")


def check_cache_values(k, v, kv_lengths):
    """Raise ValueError naming ``k`` or ``v`` when a key below ``kv_lengths[b]`` holds NaN or inf.

    The keys of batch entry ``b`` at or beyond ``kv_lengths[b]`` are padding
    (a preallocated cache's free slots): never read, so never checked.
    """
    M = k.shape[2]
    whole = bool((kv_lengths == M).all())
    for name, a in (("k", k), ("v", v)):
        if whole:
            finite = all_finite(a)
        else:
            finite = all(all_finite(a[b, :, :n]) for b, n in enumerate(kv_lengths))
        if not finite:
            raise ValueError(f"`{name}` contains NaN or inf")


def check_bias_values(bias, message=BIAS_VALUES_ERROR):
    """Raise ValueError(``message``) when ``bias`` has a NaN or a ``+inf``.

    ``-inf`` removes an entry, like a false mask entry, and is allowed. The
    maximum finds both (NaN propagates) in one pass with no temporaries: a
    bias may be as large as the score matrix.
    """
    if bias.size and not np.max(bias) < np.inf:
        raise ValueError(message)
