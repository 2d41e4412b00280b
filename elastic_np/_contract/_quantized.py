"""Quantized key/value caches: their dtypes, the checks of their scales, and `quantize_kv`.

A quantized cache stores ``k`` (or ``v``) as int8 or float8
(``ml_dtypes.float8_e4m3fn``, ``ml_dtypes.float8_e5m2``) with a float scale,
the value read being ``k * k_scale``: one scale for the tensor or one per kv
head (``(Hkv,)``), the FP8 convention of vLLM, SGLang and FlashInfer.
"""

import numpy as np

from elastic_np._contract import _validation

#: The quantized storage dtypes of ``k`` and ``v``, by name.
QUANTIZED_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
#: The largest finite number of each format: `quantize_kv` maps a head's largest magnitude to it.
LARGEST = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
#: The scale granularities `quantize_kv` makes and the kernels read.
GRANULARITIES = ("tensor", "head")


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
    """A cache scale as float64 ``(Hkv,)``, or None for None; a `ValueError` naming ``name`` otherwise.

    A scalar (or shape ``(1,)``) holds for the tensor, shape ``(Hkv,)`` one
    per kv head; each must be finite and positive. Per-token ``(B, Hkv,
    M)`` and per-group ``(..., D // G)`` scales are not supported yet.
    """
    if value is None:
        return None
    try:
        scale = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a float or an array of floats, got {value!r}") from None
    if scale.ndim > 1 or (scale.ndim == 1 and scale.shape[0] not in (1, Hkv)):
        raise ValueError(
            f"`{name}` must be a scalar (per tensor) or of shape (Hkv,) = ({Hkv},) (per kv head), got shape "
            f"{scale.shape}: per-token (B, Hkv, M) and per-group (..., D // G) scales are not supported yet")
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(f"`{name}` must be finite and > 0, got {value!r}")
    return np.broadcast_to(scale, (Hkv,)).copy()


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
    """The cache ``a`` (``(B, Hkv, M, D)``, the heads along ``head_axis``) times its ``(Hkv,)`` scale, in float64
    (the reference's values)."""
    shape = [1] * a.ndim
    shape[head_axis] = -1
    return a.astype(np.float64) * np.reshape(scale, shape)


def quantize_kv(x, dtype, *, scale="head", layout="bhnd"):
    """A key or value cache quantized to int8 or float8, and its scale: ``(data, scale)``.

    Symmetric: ``data = round(x / scale)`` with ``scale = max|x| / L``, ``L``
    the format's largest finite (127 for int8, 448 for float8_e4m3fn,
    57344 for float8_e5m2), so the largest magnitude maps to ``L``; rounded
    to nearest even. ``attention(q, data_k, data_v, k_scale=..., v_scale=...)``
    reads ``data * scale``.

    Parameters
    ----------
    x : array_like of float, shape (B, Hkv, M, D) (or (B, M, Hkv, D) for ``layout="bnhd"``)
        The cache, finite.
    dtype : {"int8", "float8_e4m3fn", "float8_e5m2"} or the dtype
        The storage format (``ml_dtypes.float8_e4m3fn``, ``ml_dtypes.float8_e5m2``).
    scale : {"head", "tensor"}, optional
        One scale per kv head (shape ``(Hkv,)``, the default) or one for
        the tensor (a 0-d array).
    layout : {"bhnd", "bnhd"}, optional
        The axes of ``x``, as `elastic_np.attention`'s ``layout``.

    Returns
    -------
    data : ndarray of ``dtype``, the shape of ``x``
    scale : ndarray of float32, shape () or (Hkv,)
        Positive; 1 for a head (or tensor) of zeros.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> k = np.array([[[[0.5, -1.0], [0.25, 2.0]]]], dtype=np.float32)
    >>> data, k_scale = enp.quantize_kv(k, "int8")
    >>> data[0, 0].tolist(), k_scale.tolist()
    ([[32, -64], [16, 127]], [0.015748031437397003])
    """
    from elastic_np._contract._spec import check_layout  # the table imports this module

    storage = storage_dtype(dtype)
    if scale not in GRANULARITIES:
        raise ValueError(f"`scale` must be 'head' (one per kv head) or 'tensor', got {scale!r}: per-token and "
                         "per-group scales are not supported yet")
    heads = 1 if check_layout(layout) == "bhnd" else 2
    x = np.asarray(x)
    _validation.check_real_float_dtype(x, "x")
    if x.ndim != 4:
        raise ValueError(f"`x` must have 4 dimensions, got shape {x.shape}")
    wide = x.astype(np.float64)
    if not np.isfinite(wide).all():
        raise ValueError("`x` contains NaN or inf")
    axes = (0, 1, 2, 3) if scale == "tensor" else tuple(a for a in range(4) if a != heads)
    amax = np.abs(wide).max(axis=axes, initial=0.0)
    largest = LARGEST[storage.name]
    factor = np.where(amax > 0, amax / largest, 1.0).astype(np.float32)
    shape = [1, 1, 1, 1]
    if scale == "head":
        shape[heads] = -1
    scaled = np.clip(wide / factor.astype(np.float64).reshape(shape), -largest, largest)
    data = (np.rint(scaled) if storage == np.int8 else scaled).astype(storage)
    return data, factor
