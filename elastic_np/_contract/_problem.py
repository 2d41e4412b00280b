"""The attention problem: `prepare` validates the inputs and options once, for every backend.

`prepare` turns the user's ``q, k, v`` and keyword options into an
`AttentionProblem` whose fields every backend reads: per-head ``tau`` and
``beta`` arrays, per-(batch, head) ``sigma``, ``kv_lengths`` filled in, the
mask broadcast (as a view) to ``(B, H, N, M)``. One check may be left to a
backend: that of the bias's values (``defer_bias_check``), for kernels that
read every entry anyway.
"""

import dataclasses
import math
from typing import Optional

import numpy as np

from elastic_np._contract import _quantized, _spec, _validation
from elastic_np._contract._grads import reduce_to_shape, sink_gradient, sum_to_shape
from elastic_np._contract._types import AttentionGrads

@dataclasses.dataclass(frozen=True, eq=False)
class AttentionProblem:
    """Validated attention inputs, in the form every backend reads.

    ``q``, ``k``, ``v`` are the caller's arrays (never written to), ``tau`` and
    ``beta`` are float64 ``(H,)``, ``sigma`` float64 ``(B, H)`` or None,
    ``kv_lengths`` int64 ``(B,)``, ``mask`` a read-only boolean view of shape
    ``(B, H, N, M)`` or None, ``window`` a pair of ints (``-1`` unbounded),
    ``align`` ``"array"`` or ``"kv_lengths"`` (see `kv_ends`).
    The score modifiers: ``softcap`` a float ``> 0`` or None, ``alibi``
    float64 ``(B, H)`` slopes or None, ``bias`` a read-only view of the
    caller's floating array broadcast to ``(B, H, N, M)`` (its own dtype) or
    None, with ``bias_shape`` the shape it was given in; ``bias_unchecked``
    is True when its values are still to be checked, by the backend (see
    `prepare`'s ``defer_bias_check``); ``kv_unchecked`` likewise for the
    keys and values below ``kv_lengths`` (`check_cache_values`).
    ``quantized``: the name of a quantized cache's dtype
    (`elastic_np._contract._quantized`), else None; ``k_scale`` and
    ``v_scale`` its scales: float64 ``(Hkv,)``, or a per-token or per-group
    scale as `elastic_np._contract._quantized.fine_scale` gives it. The reference's ``k`` and
    ``v`` are then the dequantized float64 values, the kernels' the stored ones.
    ``variant``: a user's ``score_mod``, ``mask_mod``, ``block_mask`` and
    ``captures`` (`elastic_np._variants.variant.Variant`), or None.
    ``plan_key``: hashable, the same for every call whose fields are the
    same (shape, dtype, checks and option values; `_spec.fields_key`), or
    None (an option given as an array): a backend may key what it derives
    from the fields on it. Such calls share their field arrays, which
    nothing writes to.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float
    causal: bool
    window: tuple
    kv_lengths: np.ndarray
    mask: Optional[np.ndarray]
    nvm: bool
    tau: np.ndarray
    beta: np.ndarray
    sigma: Optional[np.ndarray]
    sharpness: float
    threshold: float
    tau_shape: tuple
    beta_shape: tuple
    sigma_shape: Optional[tuple]
    softcap: Optional[float] = None
    alibi: Optional[np.ndarray] = None
    bias: Optional[np.ndarray] = None
    bias_shape: Optional[tuple] = None
    bias_unchecked: bool = False
    kv_unchecked: bool = False
    align: str = "array"
    precision: Optional[str] = None
    layout: str = "bhnd"
    plan_key: Optional[tuple] = None
    k_scale: Optional[np.ndarray] = None
    v_scale: Optional[np.ndarray] = None
    quantized: Optional[str] = None
    variant: Optional[object] = None

    def as_bhnd(self, a):
        """A 4-D array of the caller's ``layout`` as ``(B, H, N, ·)``, or the reverse: a view, no copy."""
        return a if self.layout == "bhnd" else np.swapaxes(a, 1, 2)

    as_given = as_bhnd  # swapping axes 1 and 2 is its own inverse

    def with_arrays(self, q, k, v):
        """This problem for other ``(B, H, N, D)`` arrays ``q``, ``k``, ``v`` of its shapes and dtype (nothing checked)."""
        problem = object.__new__(AttentionProblem)
        problem.__dict__.update(self.__dict__, q=q, k=k, v=v)
        return problem

    def with_variant(self, variant):
        """This problem with a user's ``variant`` (`elastic_np._variants.variant.Variant`), checked against its shape.

        Without a ``plan_key``: what a backend derives for a key holds no variant.
        """
        B, H, Hkv, N, M, D, Dv = self.shape
        problem = self.with_arrays(self.q, self.k, self.v)
        problem.__dict__.update(variant=variant.for_problem(B, H, N, M), plan_key=None)
        return problem

    def grads_as_given(self, grads):
        """``grads`` with ``dq``, ``dk``, ``dv`` in the caller's ``layout`` (views)."""
        if self.layout == "bhnd":
            return grads
        return dataclasses.replace(grads, dq=self.as_given(grads.dq), dk=self.as_given(grads.dk),
                                   dv=self.as_given(grads.dv))

    @property
    def kv_ends(self):
        """int64 ``(B,)``: the key position after batch ``b``'s last query.

        Query ``i`` of batch ``b`` sits at position ``i + kv_ends[b] - N``;
        causal, the window, ALiBi and the dynamic window measure the offset
        ``j - i - (kv_ends[b] - N)`` from it. ``M`` for ``align="array"``,
        ``kv_lengths`` for ``align="kv_lengths"``.
        """
        if self.align == "kv_lengths":
            return self.kv_lengths
        return np.full(self.q.shape[0], self.k.shape[2], dtype=np.int64)

    @property
    def shape(self):
        """``(B, H, Hkv, N, M, D, Dv)``."""
        B, H, N, D = self.q.shape
        _, Hkv, M, Dv = self.v.shape
        return B, H, Hkv, N, M, D, Dv

    @property
    def backward_shapes(self):
        """``(name, shape)`` of the arrays the backward takes besides the inputs, ``dout`` and ``out`` in ``layout``."""
        B, H, Hkv, N, M, D, Dv = self.shape
        rows = (B, H, N, Dv) if self.layout == "bhnd" else (B, N, H, Dv)
        return (("dout", rows), ("out", rows), ("lse", (B, H, N)))

    @property
    def group_size(self):
        """Query heads per key/value head: head ``h`` reads kv head ``h // group_size``."""
        return self.q.shape[1] // self.k.shape[1]

    @property
    def dtype(self):
        """The dtype of ``q``, ``k``, ``v`` (and of ``out`` and the gradients of the kernels)."""
        return self.q.dtype

    @property
    def compute_dtype(self):
        """The dtype the kernels compute in, and of ``lse``: float32 for bfloat16 and float16 inputs."""
        return _validation.compute_dtype(self.q.dtype)

    def sink_gradient(self, delta, lse):
        """``dbeta`` per head, or summed over the heads when ``beta`` is shared (see `sink_gradient`)."""
        if math.prod(self.beta_shape) > 1:
            return sink_gradient(delta, lse)
        return sink_gradient(delta, lse, per_head=False).reshape(1)

    def reduce_grads(self, dq, dk, dv, dtau_h, dbeta_h, dsigma_bh, dbias=None, dcaptures=None):
        """Build `AttentionGrads` from per-head ``dtau``, ``dbeta`` and per-(b, h) ``dsigma``.

        ``dbias`` is the gradient of the score in any shape that broadcasts
        to the bias's 4-D shape (``(B, H, N, M)``, or already summed over the
        axes the bias is broadcast along); it is summed to ``bias_shape`` and
        returned in the dtype of ``dq``. ``dcaptures``: the captures' gradients of a
        variant's ``score_mod``, as `AttentionGrads` holds them.
        """
        if self.bias is not None:
            dbias = reduce_to_shape(dbias, self.bias_shape).astype(dq.dtype, copy=False)
        else:
            dbias = None
        return AttentionGrads(
            dq=dq,
            dk=dk,
            dv=dv,
            dtau=sum_to_shape(dtau_h, self.tau_shape),
            dbeta=sum_to_shape(dbeta_h, self.beta_shape),
            dsigma=None if self.sigma is None else sum_to_shape(dsigma_bh, self.sigma_shape),
            dbias=dbias,
            dcaptures=dcaptures,
        )


def prepare(q, k, v, *, dtypes=None, check_finite=True, defer_bias_check=False, defer_kv_check=False,
            **options):
    """Validate the attention inputs and options (`elastic_np._contract._spec`); return an `AttentionProblem`.

    ``dtypes`` restricts the accepted dtype of ``q, k, v`` to these names (a
    kernel backend's, all three the same); with ``dtypes=None`` any real
    floating dtype is accepted and converted to float64 (the reference).
    With ``check_finite=False`` no value is checked. ``defer_bias_check``
    leaves the check of the bias's values to a backend whose kernels read
    every entry anyway (the problem's ``bias_unchecked`` is then True; the
    backend raises `BIAS_VALUES_ERROR` as `check_bias_values` would).
    ``defer_kv_check`` likewise leaves `check_cache_values` to the backend
    (the problem's ``kv_unchecked`` is then True). ``options`` are the
    keyword options of `elastic_np.attention`; an unknown one is a `TypeError`.
    """
    options = _spec.complete(options, "prepare")
    check_finite = _validation.boolean(check_finite, "check_finite")
    quantized = _quantized.check_cache(np.asarray(q), np.asarray(k), np.asarray(v), options["k_scale"],
                                       options["v_scale"])
    k_given, v_given = np.asarray(k), np.asarray(v)
    q, k, v = _checked_arrays(q, k_given, v_given, dtypes, _spec.check_layout(options["layout"]), quantized)
    B, H, N, D = q.shape
    if check_finite:
        _validation.check_finite(q, "q")
    shape = _spec.Shape(B, H, N, k.shape[2], D, check_bias_values=check_finite and not defer_bias_check,
                        Hkv=k.shape[1])
    compute_dtype = np.dtype(np.float64) if dtypes is None else _validation.compute_dtype(q.dtype)
    plan_key, fields = _fields(options, shape, compute_dtype, (q.shape, k.shape, v.shape))
    if quantized:
        layout = options["layout"]
        fields = {**fields, "quantized": _validation.dtype_name(k.dtype),
                  **{name: _quantized.fine_scale(fields[name], name, given.shape, layout)
                     for name, given in (("k_scale", k_given), ("v_scale", v_given))}}
        _quantized.check_same_kind(fields["k_scale"], fields["v_scale"])
        plan_key = None if plan_key is None else (*plan_key, k.dtype)
        if dtypes is None:  # the reference reads the dequantized values
            k, v = _quantized.dequantized(k, fields["k_scale"]), _quantized.dequantized(v, fields["v_scale"])
    if check_finite and not defer_kv_check:
        _validation.check_cache_values(k, v, fields["kv_lengths"])
    return _new_problem(
        q=q, k=k, v=v, **fields,
        bias_unchecked=fields["bias"] is not None and check_finite and defer_bias_check,
        kv_unchecked=check_finite and defer_kv_check, plan_key=plan_key,
    )


class Kept(dict):
    """What was derived from a hashable key (a ``plan_key``, say), the latest ``size`` of them.

    All are dropped when it is full: a model's step repeats a few keys, each
    layer the same, and what is dropped is made again on its next call.
    """

    def __init__(self, size=64):
        super().__init__()
        self.size = size

    def get_or_make(self, key, make):
        """``self[key]``, ``make()`` and kept the first time; ``make()`` alone, kept nowhere, for ``key`` None."""
        if key is None:
            return make()
        value = self.get(key)
        if value is None:
            value = make()
            if len(self) >= self.size:
                self.clear()
            self[key] = value
        return value


#: Every field of `AttentionProblem` with a default, and the default.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AttentionProblem) if f.default is not dataclasses.MISSING}


def _new_problem(**values):
    """``AttentionProblem(**values)``, without the frozen class's ``__init__``, which sets each of its
    28 fields through ``object.__setattr__``, a cost on every call."""
    problem = object.__new__(AttentionProblem)
    problem.__dict__.update(_DEFAULTS, **values)
    return problem


_FIELDS_KEPT = 64
#: `_fields` of the latest option sets that `_spec.fields_key` keys, by ``plan_key``.
_FIELDS = Kept(_FIELDS_KEPT)


def _fields(options, shape, compute_dtype, shapes):
    """``(plan_key, fields)``: the problem's fields of ``options``, checked against ``compute_dtype``'s range.

    Looked up when every option is a plain scalar (`_spec.fields_key`), and
    computed, and kept, the first time; ``plan_key`` (with ``shapes``, those
    of ``q, k, v``) is None otherwise.
    """
    options_key = _spec.fields_key(options)
    plan_key = None if options_key is None else (shape, shapes, compute_dtype, options_key)
    return plan_key, _FIELDS.get_or_make(plan_key, lambda: _checked_fields(options, shape, compute_dtype))


def resized(problem, options, k, v):
    """``problem`` for the stand-ins ``k`` and ``v`` of another number of keys ``M`` (nothing else changed):
    the fields of the options that depend on ``M`` made again (`_spec.KEY_COUNT`), and its ``plan_key``.

    For a problem whose options were keyed (its ``plan_key`` set): the others' fields, and their checks,
    do not depend on ``M``; ``options`` holds the call's value of every option (other keys are ignored).
    """
    shape, (q_shape, _, _), compute_dtype, options_key, *kv_dtype = problem.plan_key
    shape = shape._replace(M=k.shape[2])
    fields = {}
    for option in _spec.KEY_COUNT:
        fields.update(option.fields(options[option.name], shape))
    made = problem.with_arrays(problem.q, k, v)
    made.__dict__.update(fields, plan_key=(shape, (q_shape, k.shape, v.shape), compute_dtype, options_key, *kv_dtype))
    return made


def _checked_fields(options, shape, compute_dtype):
    """`_spec.problem_fields`, checked against ``compute_dtype``'s range (`check_dtype_range`)."""
    fields = _spec.problem_fields(options, shape)
    check_dtype_range(
        compute_dtype, **{name: fields[name] for name in _RANGE_FIELDS},
        uniform=fields["tau_shape"] == () and fields["beta_shape"] == (),
    )
    return fields


#: The problem's fields that `check_dtype_range` reads.
_RANGE_FIELDS = ("scale", "tau", "beta", "softcap", "alibi", "sigma", "sharpness", "threshold")


#: The axes of ``q, k, v`` in each layout, for messages.
_AXES = {"bhnd": "(B, heads, length, dim)", "bnhd": "(B, length, heads, dim)"}


def _checked_arrays(q, k, v, dtypes, layout="bhnd", quantized=False):
    """``q, k, v`` as ``(B, H, N, D)`` arrays (views for ``layout="bnhd"``) of one accepted dtype
    (float64 for ``dtypes=None``) and consistent shapes; ``quantized``: ``k`` and ``v`` hold a quantized
    cache (`elastic_np._contract._quantized.check_cache`), kept in their dtype."""
    arrays = {"q": np.asarray(q), "k": np.asarray(k), "v": np.asarray(v)}
    for name, a in arrays.items():
        _check_array(a, name, dtypes, layout, stored=quantized and name != "q")
    given = tuple(a.shape for a in arrays.values())
    if layout == "bnhd":
        arrays = {name: np.swapaxes(a, 1, 2) for name, a in arrays.items()}
    q, k, v = arrays.values()
    if dtypes is None:
        q = q.astype(np.float64, copy=False)
        if not quantized:
            k, v = (a.astype(np.float64, copy=False) for a in (k, v))
    elif not quantized and not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"`q`, `k`, `v` must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    try:
        _check_shapes(q.shape, k.shape, v.shape)
    except ValueError as exc:
        raise ValueError(f"{exc}; read as layout={layout!r}, {_AXES[layout]}, from shapes q {given[0]}, "
                         f"k {given[1]}, v {given[2]}") from None
    return q, k, v


def _check_array(a, name, dtypes, layout, stored):
    """The checks of one of ``q, k, v``: its dtype (``stored``: a quantized cache's, taken as it is) and its axes."""
    if not stored:
        _validation.check_real_float_dtype(a, name)
    if a.ndim != 4:
        raise ValueError(f"`{name}` must have 4 dimensions {_AXES[layout]} (layout={layout!r}), got shape {a.shape}")
    if dtypes is not None:
        _check_kernel_dtype(a.dtype, name, (_validation.dtype_name(a.dtype),) if stored else dtypes)


def _check_kernel_dtype(dtype, name, dtypes):
    """A `TypeError` naming ``name`` unless ``dtype`` is one of ``dtypes``, in the machine's byte order."""
    if _validation.dtype_name(dtype) not in dtypes:
        raise TypeError(f"`{name}` has dtype {dtype}; this backend takes {', '.join(map(str, dtypes))}")
    if not dtype.isnative:
        order = "big" if dtype.byteorder == ">" else "little"
        raise TypeError(f"`{name}` is stored {order}-endian ({dtype.str}); this backend reads the machine's "
                        f"byte order: pass `{name}.astype({name}.dtype.newbyteorder('='))`")


def _check_shapes(q, k, v):
    """Raise a `ValueError` unless ``(B, H, N, D)`` shapes ``q, k, v`` make one problem (grouped-query heads allowed)."""
    B, H, N, D = q
    if D == 0:
        raise ValueError("`q` and `k` must have a head dim D >= 1, got D = 0")
    if k[0] != B or v[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k[0]}, v {v[0]}")
    Hkv, M = k[1], k[2]
    if k[3] != D:
        raise ValueError(f"`k` head dim {k[3]} != `q` head dim {D}")
    if v[1:3] != (Hkv, M):
        raise ValueError(f"`v` heads and length {v[1:3]} do not match `k`'s {(Hkv, M)}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads Hkv={Hkv}")


def check_dtype_range(dtype, *, scale, tau, beta, softcap, alibi, sigma, sharpness, threshold, uniform=False):
    """Reject options that ``dtype``, the dtype a backend computes in, cannot hold.

    Every backend computes with the options, and with the factors the
    kernels form from them (``scale / tau``, ``softcap / tau``,
    ``tau / softcap``, ``slope / tau``), in its dtype: float64 for the
    reference, the input dtype for the kernels. Each must be a finite normal
    number of that dtype, or 0 where 0 is a valid value; ``beta``,
    ``sharpness`` and ``threshold`` must only not overflow (a ``beta`` below
    the normal range still acts as the tiny sink it is). Otherwise a kernel
    would compute with ``inf`` or 0 and silently give empty rows. One check
    here, before any backend runs, so that every backend rejects the same
    values with the same message.

    The per-head values are checked through their extremes (a quotient's
    extremes are the quotients of the extremes), in Python floats: this
    runs on every call, small decoding steps included. ``uniform`` says that
    ``tau`` and ``beta`` each hold one value (given as scalars).
    """
    if tau.size == 0:  # no heads: nothing is computed
        return
    dtype = np.dtype(dtype)
    tiny, big = _dtype_limits(dtype)
    where, factor = ", the dtype of the computation", ", a factor of the kernels' scores"

    def check(name, lo, hi, zero_ok, values, why=where):
        # lo, hi: the smallest and largest magnitude; 0 only where the numerator is 0
        if not (hi <= big and (lo >= tiny or (lo == 0 and zero_ok))):
            with np.errstate(over="ignore", under="ignore"):
                _validation.check_in_dtype_range(name, values(), dtype, zero_ok=zero_ok, why=why)

    if uniform:
        tau_lo = tau_hi = float(tau[0])
        beta_hi = float(beta[0])
    else:
        tau_lo, tau_hi, beta_hi = float(tau.min()), float(tau.max()), float(beta.max())
    size = abs(scale)
    check("`tau`", tau_lo, tau_hi, False, lambda: tau)
    check("`scale`", size, size, True, lambda: scale)
    check("`scale` / `tau`", size / tau_hi, size / tau_lo, scale == 0, lambda: scale / tau, factor)
    if softcap is not None:
        check("`softcap`", softcap, softcap, False, lambda: softcap)
        check("`softcap` / `tau`", softcap / tau_hi, softcap / tau_lo, False, lambda: softcap / tau, factor)
        check("`tau` / `softcap`", tau_lo / softcap, tau_hi / softcap, False, lambda: tau / softcap, factor)
    if sigma is not None and sigma.size:
        check("`sigma`", float(sigma.min()), float(sigma.max()), False, lambda: sigma)
    if alibi is not None:
        with np.errstate(over="ignore", under="ignore"):
            _validation.check_in_dtype_range("`alibi_slopes`", alibi, dtype, zero_ok=alibi == 0, why=where)
            _validation.check_in_dtype_range(
                "`alibi_slopes` / `tau`", alibi / tau, dtype, zero_ok=alibi == 0, why=factor
            )
    for name, value in (("`beta`", beta_hi), ("`sharpness`", sharpness), ("`threshold`", threshold)):
        if value > big:
            raise ValueError(
                f"{name} = {value!r} overflows {dtype}{where}: it must be at most {big:.6g}"
            )


_LIMITS = {}


def _dtype_limits(dtype):
    """``(smallest normal, largest)`` finite numbers of ``dtype``, as Python floats."""
    if dtype not in _LIMITS:
        info = np.finfo(dtype)
        _LIMITS[dtype] = (float(info.tiny), float(info.max))
    return _LIMITS[dtype]
