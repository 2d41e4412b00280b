"""Quantized key/value caches: their dtypes, the checks of their scales, and `quantize_kv`.

A quantized cache stores ``k`` (or ``v``) as int8 or float8
(``ml_dtypes.float8_e4m3fn``, ``ml_dtypes.float8_e5m2``) with a float scale,
the value read being ``k * k_scale``:

- one scale for the tensor or one per kv head (``(Hkv,)``), the FP8
  convention of vLLM, SGLang and FlashInfer;
- one per token (``k``'s shape without its last axis: ``(B, Hkv, M)``,
  ``(B, M, Hkv)`` in the ``bnhd`` layout, ``(total_k, Hkv)`` packed,
  ``(num_blocks, block_size, Hkv)`` for pages), xFasterTransformer's int8;
- one per group of ``G`` columns of each token's head (that shape and
  ``D // G``), llama.cpp's ``q8_0`` for ``G = 32``.

A per-token or per-group scale (a *fine* scale) is float32 or float16,
stored beside the cache in its layout; the problem holds it as
`fine_scale` gives it, with the axes of the ``(B, Hkv, M, D)`` cache and
``D // G`` groups (1 per token).
"""

import numpy as np

from elastic_np._contract import _validation

#: The quantized storage dtypes of ``k`` and ``v``, by name.
QUANTIZED_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
#: The largest finite number of each format: `quantize_kv` maps a head's largest magnitude to it.
LARGEST = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
#: The scale granularities `quantize_kv` makes and the kernels read.
GRANULARITIES = ("tensor", "head", "token", "group")
#: The dtypes of a per-token or per-group scale.
FINE_DTYPES = ("float32", "float16")
#: The dtypes of ``q`` the CPU kernels read a quantized cache with (they compute in float32).
QUERY_DTYPES = ("float32", "bfloat16", "float16")


def is_quantized(dtype):
    """True for the dtypes of `QUANTIZED_DTYPES`."""
    return _validation.dtype_name(dtype) in QUANTIZED_DTYPES


def storage_dtype(dtype):
    """``dtype`` (a name, a type, a dtype) as one of the quantized NumPy dtypes, else a `TypeError`."""
    name = dtype if isinstance(dtype, str) else getattr(np.dtype(dtype), "name", None)
    if name not in QUANTIZED_DTYPES:
        raise TypeError(f"`dtype` must be one of {', '.join(QUANTIZED_DTYPES)}, got {dtype!r}")
    if name == "int8":
        return np.dtype(np.int8)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


def scale_values(value, name, Hkv):
    """A cache scale as float64 ``(Hkv,)``, a fine scale as it is, or None for None; a `ValueError` naming ``name``
    otherwise.

    A scalar (or shape ``(1,)``) holds for the tensor, shape ``(Hkv,)`` one
    per kv head; an array of two dimensions or more is a per-token or
    per-group scale, whose shape `fine_scale` checks against the cache's.
    Each must be finite and positive.
    """
    if value is None:
        return None
    if is_fine(value):
        return _fine_values(value, name)
    try:
        scale = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a float or an array of floats, got {value!r}") from None
    if scale.ndim == 1 and scale.shape[0] not in (1, Hkv):
        raise ValueError(
            f"`{name}` must be a scalar (per tensor), of shape (Hkv,) = ({Hkv},) (per kv head), or, per token or "
            f"group, of the cache's shape without its last axis (and D // G), got shape {scale.shape}")
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(f"`{name}` must be finite and > 0, got {value!r}")
    return np.broadcast_to(scale, (Hkv,)).copy()


def _fine_values(value, name, check_values=True):
    """A per-token or per-group scale: a float32 or float16 array whose entries are finite and positive
    (checked unless ``check_values`` is False: `check_fine_values`)."""
    scale = np.asarray(value)
    if _validation.dtype_name(scale.dtype) not in FINE_DTYPES:
        raise TypeError(f"`{name}`, a per-token or per-group scale, must be float32 or float16, got {scale.dtype}")
    if check_values:
        check_fine_values(scale, name)
    return scale


def check_fine_values(scale, name):
    """A `ValueError` naming ``name`` unless every entry of ``scale`` is finite and positive (two reductions,
    no temporary the size of ``scale``, unless one is not)."""
    if scale.size == 0 or (scale.min() > 0 and np.isfinite(scale.max())):  # a NaN makes the minimum NaN
        return
    good = np.isfinite(scale) & (scale > 0)
    if not good.all():
        at = tuple(np.argwhere(~good)[0].tolist())
        raise ValueError(f"`{name}` must be finite and > 0 everywhere, got {float(scale[at])} at {at}")


def fine_array(value, name, stored_shape, check_values=True):
    """``value`` as a fine scale of a cache of ``stored_shape`` (any number of axes, the last ``D``): an array of
    that shape with ``D // G`` last; None where ``value`` is not a fine scale (None, or a per-head one)."""
    if not is_fine(value):
        return None
    return fine_scale(_fine_values(value, name, check_values), name, stored_shape)


def is_fine(scale):
    """Whether a scale (an option's value, or `scale_values`' result) is per token or per group."""
    return np.ndim(scale) >= 2


def fine_scale(scale, name, stored_shape, layout="bhnd"):
    """A fine scale as the problem holds it: ``(B, Hkv, M, D // G)``, a view of the caller's array.

    ``stored_shape``: the cache's shape as given (``(B, Hkv, M, D)``, or
    ``(B, M, Hkv, D)`` for ``layout="bnhd"``); the scale has that shape
    without its last axis (per token, ``G = D``) or with ``D // G`` there
    (per group, ``G`` dividing ``D``). Any other scale is returned as it is.
    """
    if not is_fine(scale):
        return scale
    tokens, D = tuple(stored_shape[:-1]), stored_shape[-1]
    if scale.shape == tokens:
        scale = scale[..., None]
    elif not (scale.shape[:-1] == tokens and scale.shape[-1] > 0 and D % scale.shape[-1] == 0):
        raise ValueError(
            f"`{name}` of shape {scale.shape} is neither per token, {tokens} (the cache's shape without its last "
            f"axis), nor per group of G columns, {(*tokens, 'D // G')} with G dividing D = {D}")
    return scale.swapaxes(1, 2) if layout == "bnhd" else scale


def check_same_kind(k_scale, v_scale):
    """A `ValueError` unless ``k_scale`` and ``v_scale`` are both fine scales (per token or group) or neither."""
    if is_fine(k_scale) != is_fine(v_scale):
        raise ValueError("`k_scale` and `v_scale` must both be per token or per group, or neither, got shapes "
                         f"{np.shape(k_scale)} and {np.shape(v_scale)}")


def check_cache(q, k, v, k_scale, v_scale):
    """The checks of a call's dtypes and scales; True when ``k`` and ``v`` are quantized.

    ``q`` may not be quantized; ``k`` and ``v`` are quantized together, in
    one dtype, each with its scale; a float cache takes no scale.
    """
    if is_quantized(q.dtype):
        raise TypeError(f"`q` has the quantized dtype {q.dtype}: only `k` and `v` may be quantized; pass `q` "
                        "as float32, bfloat16 or float16")
    quantized = is_quantized(k.dtype), is_quantized(v.dtype)
    if quantized[0] != quantized[1] or (all(quantized) and k.dtype != v.dtype):
        raise TypeError(f"`k` and `v` must both be quantized, in one dtype, or neither: got {k.dtype} and {v.dtype}")
    for name, a, scale in (("k", k, k_scale), ("v", v, v_scale)):
        if quantized[0] and scale is None:
            raise ValueError(f"`{name}` is a quantized cache ({a.dtype}): pass its scale `{name}_scale`")
        if not quantized[0] and scale is not None:
            raise ValueError(f"`{name}_scale` is given but `{name}` is a {a.dtype} cache, not a quantized one "
                             f"({', '.join(QUANTIZED_DTYPES)})")
    return quantized[0]


def dequantized(a, scale, head_axis=1):
    """The cache ``a`` (``(B, Hkv, M, D)``, the heads along ``head_axis``) times its scale, in float64 (the
    reference's values): a ``(Hkv,)`` one along ``head_axis``, a fine one (``a``'s shape but its last axis,
    ``D // G``) a group of ``G`` columns at a time."""
    if is_fine(scale):
        groups = scale.shape[-1]
        wide = a.astype(np.float64).reshape(*a.shape[:-1], groups, a.shape[-1] // groups)
        return (wide * scale.astype(np.float64)[..., None]).reshape(a.shape)
    shape = [1] * a.ndim
    shape[head_axis] = -1
    return a.astype(np.float64) * np.reshape(scale, shape)


def quantize_kv(x, dtype, *, scale="head", group_size=None, layout="bhnd"):
    """A key or value cache quantized to int8 or float8, and its scale: ``(data, scale)``.

    Symmetric: ``data = round(x / scale)`` with ``scale = max|x| / L`` over
    what the scale covers, ``L`` the format's largest finite (127 for int8,
    448 for float8_e4m3fn, 57344 for float8_e5m2), so the largest magnitude
    maps to ``L``; rounded to nearest even. ``attention(q, data_k, data_v,
    k_scale=..., v_scale=...)`` reads ``data * scale``.

    Parameters
    ----------
    x : array_like of float, shape (B, Hkv, M, D) (or (B, M, Hkv, D) for ``layout="bnhd"``)
        The cache, finite. Any other shape whose last two axes are ``(Hkv,
        D)`` (packed ``(total_k, Hkv, D)``, pages ``(num_blocks,
        block_size, Hkv, D)``) takes ``layout="bnhd"``.
    dtype : {"int8", "float8_e4m3fn", "float8_e5m2"} or the dtype
        The storage format (``ml_dtypes.float8_e4m3fn``, ``ml_dtypes.float8_e5m2``).
    scale : {"head", "tensor", "token", "group"}, optional
        One scale per kv head (shape ``(Hkv,)``, the default), one for the
        tensor (a 0-d array), one per token and head (``x``'s shape without
        its last axis), or one per group of ``group_size`` columns of each
        token's head (that shape and ``D // group_size``).
    group_size : int, optional
        Columns per group for ``scale="group"`` (32, llama.cpp's ``q8_0``,
        when None); it must divide ``D``.
    layout : {"bhnd", "bnhd"}, optional
        The axes of ``x``, as `elastic_np.attention`'s ``layout``.

    Returns
    -------
    data : ndarray of ``dtype``, the shape of ``x``
    scale : ndarray of float32
        Positive; 1 for a head, token or group of zeros.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> k = np.array([[[[0.5, -1.0], [0.25, 2.0]]]], dtype=np.float32)
    >>> data, k_scale = enp.quantize_kv(k, "int8")
    >>> data[0, 0].tolist(), k_scale.tolist()
    ([[32, -64], [16, 127]], [0.015748031437397003])
    >>> data, k_scale = enp.quantize_kv(k, "int8", scale="token")
    >>> data[0, 0].tolist(), k_scale.shape
    ([[64, -127], [16, 127]], (1, 1, 2))
    """
    from elastic_np._contract._spec import check_layout  # the table imports this module

    storage = storage_dtype(dtype)
    if scale not in GRANULARITIES:
        raise ValueError(f"`scale` must be one of {', '.join(map(repr, GRANULARITIES))}, got {scale!r}")
    x = np.asarray(x)
    _validation.check_real_float_dtype(x, "x")
    bnhd = check_layout(layout) == "bnhd"
    if x.ndim != 4 and not (bnhd and x.ndim >= 3):
        raise ValueError(f"`x` must have 4 dimensions (or, with layout='bnhd', 3 or more), got shape {x.shape}")
    group = _group_size(scale, group_size, x.shape[-1])
    wide = x.astype(np.float64)
    if not np.isfinite(wide).all():
        raise ValueError("`x` contains NaN or inf")
    if scale in ("token", "group"):
        wide = wide.reshape(*x.shape[:-1], x.shape[-1] // group, group)
        amax = np.abs(wide).max(axis=-1, initial=0.0)
        expand = amax.shape + (1,)
    else:
        heads = x.ndim - 2 if bnhd else 1
        axes = tuple(range(x.ndim)) if scale == "tensor" else tuple(a for a in range(x.ndim) if a != heads)
        amax = np.abs(wide).max(axis=axes, initial=0.0)
        expand = [1] * x.ndim
        if scale == "head":
            expand[heads] = -1
    largest = LARGEST[storage.name]
    factor = np.where(amax > 0, amax / largest, 1.0).astype(np.float32)
    scaled = np.clip(wide / factor.astype(np.float64).reshape(expand), -largest, largest).reshape(x.shape)
    data = (np.rint(scaled) if storage == np.int8 else scaled).astype(storage)
    return data, factor[..., 0] if scale == "token" else factor


def _group_size(scale, group_size, D):
    """The columns a scale covers along the head's ``D``: ``group_size`` (32 when None) for "group", ``D`` per
    token, none else; a `ValueError` naming ``group_size`` where it does not fit."""
    if scale != "group":
        if group_size is not None:
            raise ValueError(f"`group_size` goes with scale='group', got scale={scale!r}")
        return D
    group = 32 if group_size is None else group_size
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ValueError(f"`group_size` must be a positive int, got {group_size!r}")
    if D % group:
        raise ValueError(f"`group_size` {group} must divide the head dimension {D}")
    return group
