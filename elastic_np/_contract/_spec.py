"""The attention options, described once.

Each option of `elastic_np.attention` is one `Option` record in `OPTIONS`: its
name, default, type, documentation, whether it has a gradient and whether a
framework adapter may pass it as a tensor, and how `prepare` turns it into
fields of the `~elastic_np._contract._problem.AttentionProblem`. Everything else is
built from the table: `prepare`'s checks, the signatures and the option
paragraphs of the docstrings of every public function that takes the options
(`takes_options`), the adapters' split into learnable and fixed options,
and the conformance kit's option list.

Adding an option: a record here, the two written-out entry points
(`elastic_np.attention`, `elastic_np.attention_backward`), the oracle and the
kernels (see the architecture page).
"""

import dataclasses
import functools
import inspect
import math
import operator
import textwrap
from typing import Callable, NamedTuple, Optional

import numpy as np

from elastic_np._contract import _quantized, _validation
from elastic_np._contract._types import WINDOW_MAX, DynamicWindow

#: The values of ``align``: where the last query sits (see ``AttentionProblem.kv_ends``).
ALIGNS = ("array", "kv_lengths")

#: Every backend takes every option.
BACKENDS = ("reference", "cpu", "cuda")
#: The dtypes the kernels compute in, by name; each option is taken in all of them.
KERNEL_DTYPES = tuple(dtype.name for dtype in _validation.KERNEL_DTYPES)


class Shape(NamedTuple):
    """What an option's check may read of the problem: sizes and which values to check."""

    B: int
    H: int
    N: int
    M: int
    D: int
    check_bias_values: bool
    Hkv: Optional[int] = None  # None: H (a problem without grouped heads, or no cache scale to check)


@dataclasses.dataclass(frozen=True)
class Option:
    """One keyword option of the attention.

    Attributes
    ----------
    name : str
        The keyword.
    default : object
        Its default value.
    type : str
        The numpydoc type line.
    doc : str
        The numpydoc description (of `elastic_np.attention`).
    fields : callable
        ``fields(value, shape)`` validates the value for a problem of
        `Shape` ``shape`` and returns the ``AttentionProblem`` fields it sets.
    gradient : str or None
        The `~elastic_np.AttentionGrads` field of its gradient.
    tensor : bool
        Whether an adapter passes a framework tensor for it through to the
        backend (converted to a host array); ``dynamic_window`` holds one in
        its ``sigma``.
    per_call : bool
        Whether it describes the batch (its shapes or contents) rather than
        the model: `elastic_np.torch.ElasticAttention` takes it with each
        call, the others when it is built.
    backends : tuple of str
        The backends that take it.
    dtypes : tuple of str
        The dtypes the kernels take it in (the reference computes in
        float64 whatever the inputs' dtype, and takes every option).
    key_count : bool
        Whether its fields depend on the number of keys ``M`` (a plan of
        another cache length makes them again: `elastic_np._contract._problem.resized`).
    in_kit : bool
        Whether the conformance kit's cases exercise it (and a function under
        test must take it to run them): not for how the arrays are laid out
        or how a GPU forms its products.
    schema : str
        Its arguments in a ``torch.library`` operator's schema (``"bool
        causal"``; the dynamic window as its ``sigma``, ``sharpness`` and
        ``threshold``; the tensor options as ``Tensor?``).
    """

    name: str
    default: object
    type: str
    doc: str
    fields: Callable
    gradient: Optional[str] = None
    tensor: bool = False
    per_call: bool = False
    key_count: bool = False
    backends: tuple = BACKENDS
    dtypes: tuple = KERNEL_DTYPES
    in_kit: bool = True
    schema: str = ""


def _scale(value, shape):
    scale = 1.0 / math.sqrt(shape.D) if value is None else _validation.real_scalar(value, "scale")
    if not np.isfinite(scale):
        raise ValueError(f"`scale` must be finite, got {scale!r}")
    return {"scale": float(scale)}


def _window(value, shape):
    """``(left, right)`` validated; a side of ``N + M`` or more, which bounds nothing, becomes -1.

    Every offset ``j - i - (E_b - N)`` lies in ``(-(N + M), N + M)``, so a wider
    side is unbounded; as -1 it cannot overflow the kernels' int64 arithmetic.
    """
    left, right = window_pair(value)
    span = shape.N + shape.M
    return {"window": (-1 if left >= span else left, -1 if right >= span else right)}


def window_pair(value):
    """``window_size`` as two ints in ``[-1, WINDOW_MAX]``, else a `ValueError` naming it (a bool is no side)."""
    try:
        left, right = value
        if isinstance(left, (bool, np.bool_)) or isinstance(right, (bool, np.bool_)):
            raise TypeError("a bool is not a window side")
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise ValueError(
            f"`window_size` must be a pair of integers (left, right), got {value!r}"
        ) from None
    if not (-1 <= left <= WINDOW_MAX and -1 <= right <= WINDOW_MAX):
        raise ValueError(
            f"`window_size` entries must lie in [-1, 2**63 - 1] (-1: unbounded), got {value!r}"
        )
    return left, right


def _align(value, shape):
    if not isinstance(value, str) or value not in ALIGNS:
        raise ValueError(f"`align` must be one of {ALIGNS}, got {value!r}")
    return {"align": value}


def _per_head(name, positive):
    def fields(value, shape):
        values, given = _validation.per_head(value, shape.H, name, positive=positive)
        return {name: values, f"{name}_shape": given}

    return fields


def _dynamic_window(value, shape):
    if value is None:
        return {"sigma": None, "sigma_shape": None, "sharpness": 1.0, "threshold": 0.0}
    if not isinstance(value, DynamicWindow):
        raise TypeError("`dynamic_window` must be an elastic_np.DynamicWindow or None")
    try:
        sigma = np.broadcast_to(value.sigma, (shape.B, shape.H)).copy()
    except ValueError:
        raise ValueError(
            f"`sigma` of shape {value.sigma.shape} is not broadcastable to (B, H) = ({shape.B}, {shape.H})"
        ) from None
    return {"sigma": sigma, "sigma_shape": value.sigma.shape, "sharpness": value.sharpness,
            "threshold": value.threshold}


def _softcap(value, shape):
    return {"softcap": None if value is None else _validation.positive_scalar(value, "softcap")}


def _cache_scale(name):
    def fields(value, shape):
        return {name: _quantized.scale_values(value, name, shape.H if shape.Hkv is None else shape.Hkv)}

    return fields


def _bias(value, shape):
    bias, given = _validation.broadcast_bias(value, (shape.B, shape.H, shape.N, shape.M), shape.check_bias_values)
    return {"bias": bias, "bias_shape": given}


#: The values of ``precision``: None (the dtype's own) or ``"tf32"``.
PRECISIONS = (None, "tf32")


def _precision(value, shape):
    if value is not None and (not isinstance(value, str) or value not in PRECISIONS):
        raise ValueError(f"`precision` must be None or 'tf32', got {value!r}")
    return {"precision": value}


#: The values of ``layout``: the axes of ``q, k, v`` (and ``out``, ``dout`` and the gradients).
LAYOUTS = ("bhnd", "bnhd")


def check_layout(value):
    """``value`` if it is one of `LAYOUTS`, else a `ValueError` naming ``layout``."""
    if not (isinstance(value, str) and value in LAYOUTS):
        raise ValueError(f"`layout` must be 'bhnd' ((B, H, N, D), the default) or 'bnhd' ((B, N, H, D), "
                         f"FlashAttention's), got {value!r}")
    return value


def _boolean(name):
    return lambda value, shape: {name: _validation.boolean(value, name)}


#: The options, in the order of the contract and of every signature.
OPTIONS = (
    Option("scale", None, "float, optional", "Score scale; ``1/sqrt(D)`` by default.", _scale, schema="float? scale"),
    Option("causal", False, "bool, optional",
           "Keep ``j <= i + (M - N)`` (bottom-right aligned, as FlashAttention).", _boolean("causal"),
           schema="bool causal"),
    Option("window_size", (-1, -1), "(int, int), optional",
           "``(left, right)``: keep ``i + M - N - left <= j <= i + M - N + right``; ``-1`` leaves a "
           "side unbounded.", _window, key_count=True, schema="int[] window_size"),
    Option("kv_lengths", None, "array_like of int, shape (B,), optional",
           "Keep ``j < kv_lengths[b]``; the keys past it (a preallocated cache's padding) are never read.",
           lambda value, shape: {"kv_lengths": _validation.kv_lengths_array(value, shape.B, shape.M)},
           tensor=True, per_call=True, key_count=True, schema="Tensor? kv_lengths"),
    Option("align", "array", '{"array", "kv_lengths"}, optional',
           'Where the last query sits: at the array\'s last key (``"array"``, query ``i`` at position '
           '``i + M - N``) or at each sequence\'s last key (``"kv_lengths"``, at ``i + kv_lengths[b] - N``), '
           "as for new queries appended to a ragged cache. Causal, the window, ALiBi and the dynamic window "
           "measure offsets from there; ``M`` above then reads ``kv_lengths[b]``.", _align, per_call=True,
           schema="str align"),
    Option("mask", None, "array_like of bool, optional",
           "Broadcastable to ``(B, H, N, M)``; True keeps.",
           lambda value, shape: {"mask": _validation.broadcast_mask(value, (shape.B, shape.H, shape.N, shape.M))},
           tensor=True, per_call=True, key_count=True, schema="Tensor? mask"),
    Option("nvm", False, "bool, optional", "Negative Value Masking: drop scores below 0.", _boolean("nvm"),
           schema="bool nvm"),
    Option("tau", 1.0, "float or array_like of shape (H,), optional",
           "Temperature, ``> 0``: the logits are the scores divided by it. Learnable.",
           _per_head("tau", positive=True), gradient="dtau", tensor=True, schema="Tensor? tau"),
    Option("beta", 0.0, "float or array_like of shape (H,), optional",
           "The sink, ``>= 0``: added to the softmax denominator. Learnable.",
           _per_head("beta", positive=False), gradient="dbeta", tensor=True, schema="Tensor? beta"),
    Option("dynamic_window", None, "DynamicWindow, optional",
           "Learnable bell-curve window gate (its ``sigma`` is learnable).", _dynamic_window,
           gradient="dsigma", tensor=True, key_count=True, schema="Tensor? sigma, float sharpness, float threshold"),
    Option("softcap", None, "float, optional",
           "Soft-capping: the score becomes ``softcap * tanh(score / softcap)`` (``> 0``; None for none), "
           "before ALiBi, bias, NVM and temperature.", _softcap, schema="float? softcap"),
    Option("alibi_slopes", None, "array_like, shape (H,) or (B, H), optional",
           "ALiBi: adds ``-slope * |i + (M - N) - j|`` to the score. Fixed (no gradient).",
           lambda value, shape: {"alibi": _validation.alibi_array(value, shape.B, shape.H)}, tensor=True,
           schema="Tensor? alibi_slopes"),
    Option("bias", None, "array_like of float, optional",
           "Additive score bias broadcastable to ``(B, H, N, M)``, added after the soft-cap and before "
           "NVM; ``-inf`` removes an entry. Learnable: the backward returns ``dbias`` in its shape.",
           _bias, gradient="dbias", tensor=True, per_call=True, key_count=True, schema="Tensor? bias"),
    Option("k_scale", None, "float or array_like, optional",
           "The scale of a quantized ``k`` (int8, ``ml_dtypes.float8_e4m3fn`` or ``float8_e5m2``): the keys "
           "read are ``k * k_scale``, finite and ``> 0``: one scale for the tensor, one per kv head "
           "(``(Hkv,)``), one per token (float32 or float16 of ``k``'s shape without its last axis, "
           "``(B, Hkv, M)`` or, in the ``bnhd`` layout, ``(B, M, Hkv)``) or one per group of ``G`` columns "
           "(that shape and ``D // G``) (`elastic_np.quantize_kv` makes them). Only with a quantized ``k``; "
           "no gradient.",
           _cache_scale("k_scale"), tensor=True, per_call=True, backends=("reference", "cpu"),
           schema="Tensor? k_scale"),
    Option("v_scale", None, "float or array_like, optional",
           "The scale of a quantized ``v``, as ``k_scale``: the values read are ``v * v_scale``.",
           _cache_scale("v_scale"), tensor=True, per_call=True, backends=("reference", "cpu"),
           schema="Tensor? v_scale"),
    Option("precision", None, '{None, "tf32"}, optional',
           "Products of the CUDA kernels. None: float32 inputs keep float32 accuracy (on the tensor cores "
           "as 3xTF32, three TF32 products per float32 product). ``\"tf32\"``: one TF32 product (10 bits of "
           "mantissa) instead of three, faster and less accurate, like "
           "``torch.backends.cuda.matmul.allow_tf32``; kernels that do not use the tensor cores keep float32. "
           "CUDA float32 only.",
           _precision, backends=("cuda",), dtypes=("float32",), in_kit=False, schema="str? precision"),
    Option("layout", "bhnd", '{"bhnd", "bnhd"}, optional',
           'Axes of ``q``, ``k``, ``v`` (and of ``out``, ``dout`` and their gradients): ``"bhnd"``, '
           '``(B, H, N, D)`` as PyTorch\'s SDPA, or ``"bnhd"``, ``(B, N, H, D)`` as FlashAttention. Read '
           "in place, without a copy; ``lse``, ``mask`` and ``bias`` keep ``(B, H, N[, M])``.",
           lambda value, shape: {"layout": check_layout(value)}, per_call=True, in_kit=False, schema="str layout"),
)

#: The option names, in order.
NAMES = tuple(option.name for option in OPTIONS)
#: Each `Option` by its name.
OPTION = {option.name: option for option in OPTIONS}
#: The options whose fields depend on the number of keys.
KEY_COUNT = tuple(option for option in OPTIONS if option.key_count)
#: The defaults, by name.
DEFAULTS = {option.name: option.default for option in OPTIONS}
#: The options with a gradient.
LEARNABLE = tuple(option.name for option in OPTIONS if option.gradient)
#: The options an adapter converts from framework tensors (besides the learnable ones).
TENSOR_OPTIONS = tuple(option.name for option in OPTIONS if option.tensor and not option.gradient)
#: The options that describe the batch (see `Option.per_call`).
PER_CALL = tuple(option.name for option in OPTIONS if option.per_call)
#: The score modifiers (the contract's "Score modifiers"): applied to the scores before NVM.
MODIFIERS = ("softcap", "alibi_slopes", "bias")
#: The options the conformance kit's cases exercise (see `Option.in_kit`).
IN_KIT = tuple(option.name for option in OPTIONS if option.in_kit)

_BY_NAME = {option.name: option for option in OPTIONS}


def taken_by(backend):
    """The names of the options ``backend`` takes (`Option.backends`)."""
    return tuple(option.name for option in OPTIONS if backend in option.backends)


#: Keywords of PyTorch's SDPA and of FlashAttention that are not ours, with what to use instead.
FOREIGN_NAMES = {
    "is_causal": "use `causal=` (PyTorch's `is_causal`)",
    "attn_mask": "use `mask=` for a boolean mask (True keeps an entry) or `bias=` for a float one "
                 "(added to the scores, -inf removes an entry)",
    "softmax_scale": "use `scale=` (FlashAttention's `softmax_scale`)",
    "dropout_p": "attention dropout is not supported: the kernels are deterministic and their gradients "
                 "exact; apply dropout outside the attention if the model needs it",
    "enable_gqa": "grouped-query attention needs no flag: `k` and `v` with Hkv heads, H a multiple of Hkv",
}


def unexpected_keyword(function, name):
    """The `TypeError` for keyword ``name`` that ``function`` does not take, saying ours where it is a foreign name."""
    message = f"{function}() got an unexpected keyword argument {name!r}"
    if name in FOREIGN_NAMES:
        message += f": {FOREIGN_NAMES[name]}"
    return TypeError(message)


def answers_foreign_names(fn):
    """``fn``, whose call with a keyword it does not take raises `unexpected_keyword` (the foreign names answered).

    Python's own message is kept for every other mistake in the call; nothing
    is checked before a call succeeds.
    """
    known = frozenset(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TypeError:
            unknown = [name for name in kwargs if name not in known]
            if unknown:
                raise unexpected_keyword(fn.__name__, unknown[0]) from None
            raise

    return wrapper


def complete(options, function, names=NAMES):
    """``options`` with the defaults of ``names`` filled in; a `TypeError` for any other keyword.

    ``function`` is the name the error message gives, as Python's own
    message for an unexpected keyword does.
    """
    if names is NAMES:
        if options.keys() <= DEFAULTS.keys():
            return {**DEFAULTS, **options}
        names = DEFAULTS.keys()
    for name in options:
        if name not in names:
            raise unexpected_keyword(function, name)
    return {**{name: DEFAULTS[name] for name in names}, **options}


#: The types of option values that `fields_key` keys on: a call with any other is not looked up.
_KEYED_TYPES = frozenset((type(None), bool, int, float, str))
#: The options that may be keyed by an array's values: their fields are copies, never views of it.
_KEYED_ARRAYS = frozenset(("tau", "beta", "kv_lengths", "alibi_slopes"))
#: The largest such array keyed (entries); a larger one is not looked up.
_KEYED_SIZE = 1024


def fields_key(options):
    """A hashable key of ``options`` (complete) when every value can be keyed, else None.

    Keyed: Python's scalars, tuples of ints, and small NumPy arrays of
    NumPy's numbers for the options whose fields copy them (`_KEYED_ARRAYS`,
    by dtype, shape and bytes). Two calls with the same key have the same `problem_fields` for
    the same shape: the values enter with their types (``1``, ``1.0`` and
    ``True`` are told apart); a negative float zero, whose sign ``==`` does
    not see, is not keyed.
    """
    values = tuple(map(options.__getitem__, NAMES))
    types = tuple(map(type, values))
    key = None
    for at, (value, kind) in enumerate(zip(values, types)):
        if kind in _KEYED_TYPES:
            if kind is float and value == 0 and math.copysign(1.0, value) < 0:
                return None
        elif kind is tuple:
            if any(type(part) is not int for part in value):
                return None
        elif (kind is np.ndarray and NAMES[at] in _KEYED_ARRAYS and value.size <= _KEYED_SIZE
              and value.dtype.kind in "fiu"):
            key = key or list(values)
            key[at] = (value.dtype, value.shape, value.tobytes())
        else:
            return None
    return (values if key is None else tuple(key)), types


def problem_fields(options, shape):
    """The ``AttentionProblem`` fields of every option in ``options`` (complete), in table order."""
    fields = {}
    for option in OPTIONS:
        fields.update(option.fields(options[option.name], shape))
    return fields


def check_support(options, backend, dtype=None):
    """Raise a `ValueError` for an option set away from its default that ``backend`` does not take.

    ``dtype``, for a kernel backend, is the dtype it computes in: an option
    the kernels do not take in it is rejected too.
    """
    dtype = None if dtype is None else _validation.dtype_name(dtype)
    for option in OPTIONS:
        if backend in option.backends and (dtype is None or dtype in option.dtypes):
            continue
        if not _is_default(options.get(option.name, option.default), option):
            if backend not in option.backends:
                raise ValueError(f"backend {backend!r} does not take `{option.name}` (backends that do: "
                                 f"{', '.join(option.backends)})")
            raise ValueError(f"the {backend} kernels do not take `{option.name}` in {dtype} "
                             f"(they do in {', '.join(option.dtypes)})")


def _is_default(value, option):
    default = option.default
    return value is default or (
        not isinstance(value, np.ndarray) and type(value) is type(default) and value == default
    )


def gathered(names_and_values):
    """The option values among a mapping of names (an entry point's ``locals()``)."""
    return {name: names_and_values[name] for name in NAMES}


#: Keyword parameters that follow the options in every signature.
_AFTER_OPTIONS = ("return_lse", "check_finite", "backend")


def signature(fn, names=NAMES):
    """``fn``'s signature with its ``**options`` replaced by the options ``names``, keyword-only.

    The options go before the first of ``return_lse``, ``check_finite``,
    ``backend`` (else last), as in `elastic_np.attention`.
    """
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
    at = next((i for i, p in enumerate(params) if p.name in _AFTER_OPTIONS), len(params))
    keyword = inspect.Parameter.KEYWORD_ONLY
    options = [inspect.Parameter(name, keyword, default=DEFAULTS[name]) for name in names]
    return inspect.Signature(params[:at] + options + params[at:])


def parameter_docs(names=NAMES, indent=4):
    """The numpydoc entries of the options ``names``, indented by ``indent`` spaces."""
    entries = []
    for name in names:
        option = _BY_NAME[name]
        entries.append(f"{name} : {option.type}\n" + textwrap.indent(_fill(option.doc, 88 - indent - 4), "    "))
    return textwrap.indent("\n".join(entries), " " * indent).lstrip()


def _fill(text, width):
    """``text`` wrapped to ``width`` columns, never inside an inline literal (````...````)."""
    pieces = text.split("``")
    joined = "``".join(p.replace(" ", "\0") if i % 2 else p for i, p in enumerate(pieces))
    return textwrap.fill(joined, width, break_on_hyphens=False).replace("\0", " ")


def name_list(names):
    """``"a, b, c"``: the names of options, for a docstring's shared entry."""
    return ", ".join(names)


def with_option_docs(own=()):
    """Fill a docstring's ``%(options)s`` and ``%(other_names)s`` from the option table.

    ``%(options)s`` becomes the numpydoc entries of the options not in
    ``own`` (which the function documents itself), ``%(other_names)s``
    those options' names on one line, for one shared entry.
    """
    others = [name for name in NAMES if name not in own]

    def decorate(fn):
        if fn.__doc__:
            fn.__doc__ = fn.__doc__.replace("%(options)s", parameter_docs(others)).replace(
                "%(other_names)s", name_list(others))
        return fn

    return decorate


def takes_options(own=(), names=NAMES):
    """Give a function taking ``**options`` the options' signature (`signature`) and docstring entries.

    The function completes ``options`` with `complete` itself. Its signature
    lists the options ``names`` (all by default); its docstring is filled as
    by `with_option_docs`, for those options.
    """
    documented = with_option_docs(own=set(own) | (set(NAMES) - set(names)))

    def decorate(fn):
        fn.__signature__ = signature(fn, names)
        return documented(fn)

    return decorate
