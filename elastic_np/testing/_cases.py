"""The battery's cases: the options and capabilities, the seeded shapes and options, `draw_inputs`."""

import dataclasses
import importlib.util
from typing import Optional

import numpy as np

from elastic_np import reference
from elastic_np._contract import _quantized, _spec
from elastic_np._contract._validation import compute_dtype
from elastic_np._variants.block_mask import create_block_mask
from elastic_np._contract._problem import prepare
from elastic_np._contract._quantized import dequantized, fine_scale, quantize_kv

from elastic_np._contract._types import DynamicWindow

#: Keyword options of the attention that the cases exercise, in the order of the contract
#: (`elastic_np._contract._spec.IN_KIT`: not ``layout`` or ``precision``).
OPTION_NAMES = _spec.IN_KIT
#: The options of a quantized cache (its cases' own, in no combined case).
CACHE_SCALES = ("k_scale", "v_scale")
#: The dtypes of ``q`` a quantized cache's cases run in (the CPU kernels read one with ``q`` in these).
CACHE_DTYPES = _quantized.QUERY_DTYPES
#: The score modifiers among them (a case combining them needs all three).
MODIFIER_NAMES = _spec.MODIFIERS
#: Capabilities that are not keyword options and are only declared via ``options``:
#: ``"gqa"``: ``k``, ``v`` with fewer heads than ``q`` (grouped-query attention);
#: ``"bottom_right_causal"``: causal with ``N != M``, aligned bottom-right as in
#: the contract (torch's ``is_causal`` is top-left aligned, so it must not declare it).
CAPABILITIES = ("gqa", "bottom_right_causal")
#: The arguments of a user's attention variant (`elastic_np.attention`'s ``score_mod``, ``mask_mod``,
#: ``block_mask`` and ``captures``), which the variant cases need; declared as the options are.
VARIANT_NAMES = ("score_mod", "mask_mod", "block_mask", "captures")


@dataclasses.dataclass(frozen=True)
class Case:
    """One battery case: a shape and the options it passes.

    ``quick`` and ``full`` are ``(B, H, Hkv, N, M, D, Dv)``; ``requires`` names
    the options and capabilities the implementation must have for the case to
    run; ``make_options(rng, shape)`` returns the keyword options.
    ``oracle_gradients``: False for a case that repeats another at more
    queries, which the float64 oracle's own gradient check skips (its code
    does not depend on the shape), and for a user's variant. ``cache``: None, or ``(format,
    granularity)`` of a quantized ``k`` and ``v`` (`quantized_cache`; such a
    case runs forward only, with ``q`` in `CACHE_DTYPES`).
    """

    name: str
    requires: frozenset
    quick: tuple
    full: tuple
    make_options: object
    oracle_gradients: bool = True
    cache: Optional[tuple] = None

    def shape(self, quick):
        return self.quick if quick else self.full


def _sizes(B=2, H=2, Hkv=None, N=11, M=None, D=8, Dv=6, *, full_scale=5):
    """Quick and full shapes: the full one has longer sequences and head dims."""
    Hkv = H if Hkv is None else Hkv
    M = N if M is None else M
    quick = (B, H, Hkv, N, M, D, Dv)
    full = (B, 2 * H, 2 * Hkv, N * full_scale + 2, M * full_scale + 2, 4 * D, 4 * Dv)
    return quick, full


def _mask(rng, shape):
    """Random boolean mask of shape (B, 1, N, M), each row keeping at least one key."""
    B, H, Hkv, N, M, D, Dv = shape
    mask = rng.random((B, 1, N, M)) < 0.7
    mask[:, :, np.arange(N), rng.integers(0, M, size=N)] = True
    return mask


def _window_threshold(sigma, N, M, start=0.1):
    """A threshold for the dynamic window that no bell value comes close to.

    The gate jumps where the bell crosses the threshold; keeping every bell
    value 0.1% away from it means that no rounding flips an entry in or out.
    """
    offset = np.arange(M)[None, :] - np.arange(N)[:, None] - (M - N)
    x = 2.0 * offset / (M - 1) if M > 1 else np.zeros((N, M))
    s = np.asarray(sigma, dtype=np.float64).reshape(-1)[:, None, None]
    f = np.exp(-(x**2) / (2 * s**2)) / (s * np.sqrt(2 * np.pi))
    for t in start * (1 + 0.037 * np.arange(200)):
        if np.min(np.abs(f - t)) > 1e-3 * t:
            return float(t)
    raise RuntimeError("no threshold away from the bell values found")  # pragma: no cover


def _dynamic_window(rng, shape):
    B, H, Hkv, N, M, D, Dv = shape
    sigma = rng.uniform(0.3, 0.8, size=(B, H))
    return DynamicWindow(sigma, sharpness=4.0, threshold=_window_threshold(sigma, N, M))


def _combined(rng, shape):
    B, H, Hkv, N, M, D, Dv = shape
    lengths = np.array([M - 1, M // 2, 0][:B] + [M] * max(B - 3, 0))
    return {
        "scale": 0.4,
        "causal": True,
        "window_size": (M // 2, -1),
        "kv_lengths": lengths,
        "mask": _mask(rng, shape),
        "nvm": True,
        "tau": rng.uniform(0.5, 1.5, size=H),
        "beta": rng.uniform(0.2, 2.0, size=H),
        "dynamic_window": _dynamic_window(rng, shape),
    }


def _slopes(rng, shape):
    """ALiBi slopes of the usual geometric form, ``2^(-8 (h + 1) / H)``."""
    H = shape[1]
    return 2.0 ** (-8.0 * np.arange(1, H + 1) / H)


def _bias(rng, shape, broadcast=(), neg_inf=0.0):
    """A unit-scale bias of shape ``(B, H, N, M)`` with size 1 on the ``broadcast`` axes.

    A fraction ``neg_inf`` of its entries is ``-inf`` (the entry is removed).
    """
    B, H, Hkv, N, M, D, Dv = shape
    full = [B, H, N, M]
    bias_shape = tuple(1 if axis in broadcast else n for axis, n in enumerate(full))
    bias = rng.standard_normal(bias_shape)
    if neg_inf:
        bias[rng.random(bias_shape) < neg_inf] = -np.inf
    return bias


def _modifiers_combined(rng, shape):
    B, H, Hkv, N, M, D, Dv = shape
    return {
        "causal": True,
        "window_size": (M // 2, -1),
        "nvm": True,
        "tau": rng.uniform(0.5, 1.5, size=H),
        "beta": rng.uniform(0.2, 2.0, size=H),
        "softcap": 1.5,
        "alibi_slopes": _slopes(rng, shape),
        "bias": _bias(rng, shape, broadcast=(0,), neg_inf=0.1),
    }


def distance_bias(score, b, h, q_idx, kv_idx, table, documents):
    """The variant cases' ``score_mod``: a learnable bias of head ``h`` and the distance ``kv_idx - q_idx``
    clipped to [-4, 4], ``table`` ``(H, 9)``."""
    return score + table[h, min(max(kv_idx - q_idx, -4), 4) + 4]


def same_document(b, h, q_idx, kv_idx, table, documents):
    """The variant cases' ``mask_mod``: keys of the query's own document (``documents[b, i]``, that of position
    ``i`` of sequence ``b``), causal."""
    return documents[b, q_idx] == documents[b, kv_idx] and kv_idx <= q_idx


def _variant(block_mask):
    """The options of a variant case: `distance_bias` and `same_document` (N = M), as a block mask of blocks of
    8 (empty, full and partial ones) with ``block_mask``."""

    def make_options(rng, shape):
        B, H, Hkv, N, M, D, Dv = shape
        splits = ([N // 2, N // 2 + N // 5], [N // 4])  # three documents, then two
        documents = np.stack([np.searchsorted(splits[b % 2], np.arange(N), side="right") for b in range(B)])
        captures = (rng.standard_normal((H, 9)), documents)
        options = {"score_mod": distance_bias, "captures": captures}
        if block_mask:
            options["block_mask"] = create_block_mask(same_document, B, H, N, M, captures=captures, block_size=8)
        else:
            options["mask_mod"] = same_document
        return options

    return make_options


def variant_arguments(options):
    """``(options, variant)``: ``options`` less the `VARIANT_NAMES`, and those (as keyword arguments)."""
    variant = {name: options[name] for name in VARIANT_NAMES if name in options}
    return {name: value for name, value in options.items() if name not in variant}, variant


def _case(name, requires, sizes, make_options, oracle_gradients=True, cache=None):
    quick, full = sizes
    return Case(name, frozenset(requires), quick, full, make_options, oracle_gradients, cache)


CASES = (
    _case("plain", (), _sizes(), lambda rng, s: {}),
    _case("scale", ("scale",), _sizes(), lambda rng, s: {"scale": 0.3}),
    _case("causal", ("causal",), _sizes(), lambda rng, s: {"causal": True}),
    _case("causal N<M", ("causal", "bottom_right_causal"), _sizes(N=5, M=11),
          lambda rng, s: {"causal": True}),
    _case("causal N>M", ("causal", "bottom_right_causal"), _sizes(N=11, M=5),
          lambda rng, s: {"causal": True}),
    _case("window", ("window_size",), _sizes(), lambda rng, s: {"window_size": (3, 2)}),
    _case("kv_lengths", ("kv_lengths",), _sizes(),
          lambda rng, s: {"kv_lengths": np.array([s[4] - 3, s[4] // 2])}),
    _case("empty rows", ("kv_lengths",), _sizes(),
          lambda rng, s: {"kv_lengths": np.array([s[4], 0])}),
    _case("mask", ("mask",), _sizes(), lambda rng, s: {"mask": _mask(rng, s)}),
    _case("nvm", ("nvm",), _sizes(), lambda rng, s: {"nvm": True}),
    _case("tau", ("tau",), _sizes(), lambda rng, s: {"tau": 0.6}),
    _case("beta", ("beta",), _sizes(), lambda rng, s: {"beta": 1.5}),
    _case("tau, beta per head", ("tau", "beta"), _sizes(),
          lambda rng, s: {"tau": rng.uniform(0.5, 1.5, size=s[1]),
                          "beta": rng.uniform(0.2, 2.0, size=s[1])}),
    _case("dynamic window", ("dynamic_window",), _sizes(),
          lambda rng, s: {"dynamic_window": _dynamic_window(rng, s)}),
    _case("gqa", ("gqa",), _sizes(H=4, Hkv=2), lambda rng, s: {}),
    # new queries at the end of each sequence of a ragged cache
    _case("aligned to kv_lengths", ("causal", "window_size", "kv_lengths", "align"),
          _sizes(B=3, N=5, M=11),
          lambda rng, s: {"causal": True, "window_size": (4, -1), "align": "kv_lengths",
                          "kv_lengths": np.array([s[4], s[4] - 4, 3])}),
    _case("combined", set(OPTION_NAMES) - set(MODIFIER_NAMES) - {"align", *CACHE_SCALES} | set(CAPABILITIES),
          _sizes(B=3, H=4, Hkv=2, N=7, M=13), _combined),
    _case("softcap", ("softcap",), _sizes(), lambda rng, s: {"softcap": 0.8}),
    _case("alibi", ("alibi_slopes",), _sizes(N=7, M=13),  # N != M: the offset is aligned
          lambda rng, s: {"alibi_slopes": _slopes(rng, s)}),
    _case("softcap + bias", ("softcap", "bias"), _sizes(),  # the cap comes before the bias
          lambda rng, s: {"softcap": 1.2, "bias": 2 * _bias(rng, s)}),
    _case("bias", ("bias",), _sizes(), lambda rng, s: {"bias": _bias(rng, s)}),
    _case("bias (N, M)", ("bias",), _sizes(),
          lambda rng, s: {"bias": _bias(rng, s, broadcast=(0, 1))[0, 0]}),
    _case("bias keys, -inf", ("bias",), _sizes(),
          lambda rng, s: {"bias": _bias(rng, s, broadcast=(1, 2), neg_inf=0.2)}),
    # a per-query bias cancels out of the softmax unless beta > 0 (the sink)
    _case("bias queries", ("bias", "beta"), _sizes(),
          lambda rng, s: {"bias": _bias(rng, s, broadcast=(0, 3)), "beta": 0.7}),
    _case("modifiers combined", ("causal", "window_size", "nvm", "tau", "beta", "gqa",
                                 "bottom_right_causal") + MODIFIER_NAMES,
          _sizes(B=2, H=4, Hkv=2, N=7, M=13), _modifiers_combined),
    # more queries than the quick shapes above have: kernels that tile the
    # queries (the CPU backend's prefill kernel takes N > 16) run in --quick
    # too; the full battery's shapes have them already, and at five times
    # these sizes no draw keeps every NVM score away from 0 (`draw_inputs`)
    _case("plain, N=20", (), _sizes(N=20, M=24, full_scale=1), lambda rng, s: {}, oracle_gradients=False),
    _case("combined, N=20", set(OPTION_NAMES) - set(MODIFIER_NAMES) - {"align", *CACHE_SCALES} | set(CAPABILITIES),
          _sizes(B=3, H=4, Hkv=2, N=20, M=26, full_scale=1), _combined, oracle_gradients=False),
    _case("modifiers combined, N=20", ("causal", "window_size", "nvm", "tau", "beta", "gqa",
                                       "bottom_right_causal") + MODIFIER_NAMES,
          _sizes(B=2, H=4, Hkv=2, N=20, M=26, full_scale=1), _modifiers_combined, oracle_gradients=False),
    # a quantized cache, read as its values times their scales (the oracle's: dequantized in float64)
    _case("int8 cache", CACHE_SCALES + ("gqa",), _sizes(H=4, Hkv=2, N=5, M=13), lambda rng, s: {},
          oracle_gradients=False, cache=("int8", "head")),
    _case("float8_e4m3fn cache per token, causal", CACHE_SCALES + ("gqa", "causal", "bottom_right_causal"),
          _sizes(H=4, Hkv=2, N=5, M=13), lambda rng, s: {"causal": True}, oracle_gradients=False,
          cache=("float8_e4m3fn", "token")),
    _case("int8 cache per group, N=20", CACHE_SCALES + ("softcap",), _sizes(N=20, M=24, full_scale=1),
          lambda rng, s: {"softcap": 2.0}, oracle_gradients=False, cache=("int8", "group")),
    # a user's variant: a relative-position bias table (a capture with a gradient) and a document mask, as a
    # mask_mod and as a block mask (the oracle's gradients of the captures are held to finite differences in
    # the package's tests, not by `check_oracle_gradients`)
    _case("score_mod, mask_mod", ("score_mod", "mask_mod", "captures"), _sizes(N=20, full_scale=1),
          _variant(block_mask=False), oracle_gradients=False),
    _case("score_mod, block_mask", ("score_mod", "block_mask", "captures"), _sizes(N=20, full_scale=1),
          _variant(block_mask=True), oracle_gradients=False),
)


def draw_inputs(case, dtype, *, quick=True, seed=0, margin=1e-5, dims=None):
    """Seeded inputs of ``case``: ``(q, k, v, dout, options)``.

    ``q, k, v, dout`` (and a ``bias`` option) are float64 arrays holding values
    exactly representable in ``dtype``. Under ``nvm``, the inputs are drawn
    again until no final score lies within ``margin`` (relative to the largest
    score) of 0, where NVM jumps.
    ``dims`` overrides ``(D, Dv)``.
    """
    dtype = np.dtype(dtype)
    B, H, Hkv, N, M, D, Dv = case.shape(quick)
    if dims is not None:
        D, Dv = dims
    shape = (B, H, Hkv, N, M, D, Dv)
    for attempt in range(200):
        rng = np.random.default_rng([seed, attempt, len(case.name)])
        q = rng.standard_normal((B, H, N, D)).astype(dtype).astype(np.float64)
        k = rng.standard_normal((B, Hkv, M, D)).astype(dtype).astype(np.float64)
        v = rng.standard_normal((B, Hkv, M, Dv)).astype(dtype).astype(np.float64)
        dout = rng.standard_normal((B, H, N, Dv)).astype(dtype).astype(np.float64)
        options = case.make_options(rng, shape)
        if "bias" in options:
            options["bias"] = options["bias"].astype(dtype).astype(np.float64)
        if "captures" in options:
            options["captures"] = tuple(in_dtype(c, dtype, np.float64) for c in options["captures"])
        if not options.get("nvm"):
            return q, k, v, dout, options
        # NVM jumps where the final score (after soft-cap, ALiBi, bias) is 0
        s = np.abs(reference.scores(prepare(q, k, v, **options))[0])
        s = s[np.isfinite(s)]
        if s.size == 0 or np.min(s) > margin * np.max(s):
            return q, k, v, dout, options
    raise RuntimeError(  # pragma: no cover
        f"could not draw inputs away from the NVM jump for case {case.name!r}")


def in_dtype(capture, dtype, to=None):
    """A floating ``capture`` rounded to ``dtype`` (as the implementation under test gets it: in float32 for
    bfloat16 and float16, which captures are not taken in), then cast ``to``; any other capture as it is."""
    if not np.issubdtype(capture.dtype, np.floating):
        return capture
    rounded = capture.astype(dtype)
    return rounded.astype(to if to is not None else compute_dtype(dtype))


def quantized_cache(case, k, v):
    """``(k, v, stored)``: a quantized cache's case's ``k`` and ``v`` quantized (`elastic_np.quantize_kv`, groups
    of half the head dim) and, as the oracle reads them, `dequantize`'d back in float64, with ``stored =
    (k_data, v_data, scales)`` what the implementation gets (``scales`` its ``k_scale`` and ``v_scale``);
    ``(k, v, None)`` for any other case."""
    if case.cache is None:
        return k, v, None
    fmt, granularity = case.cache
    (kd, ks), (vd, vs) = (quantize_kv(a, fmt, scale=granularity, group_size=a.shape[-1] // 2
                                      if granularity == "group" else None) for a in (k, v))
    return dequantize(kd, ks), dequantize(vd, vs), (kd, vd, {"k_scale": ks, "v_scale": vs})


def dequantize(data, scale):
    """A quantized ``(B, Hkv, M, D)`` cache times its scale, in float64: what `elastic_np.attention` reads with
    ``k_scale=scale``.

    Parameters
    ----------
    data : ndarray, shape (B, Hkv, M, D)
        int8, ``ml_dtypes.float8_e4m3fn`` or ``ml_dtypes.float8_e5m2``.
    scale : float or ndarray
        A scalar, ``(Hkv,)``, per token ``(B, Hkv, M)`` or per group ``(B, Hkv, M, D // G)``, as
        `elastic_np.quantize_kv` makes them.

    Returns
    -------
    ndarray of float64, shape (B, Hkv, M, D)

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> data, scale = enp.quantize_kv(np.array([[[[0.5, -1.0]]]]), "int8", scale="token")
    >>> enp.testing.dequantize(data, scale).round(3).tolist()
    [[[[0.504, -1.0]]]]
    """
    scale = np.asarray(scale)
    if scale.ndim >= 2:
        return dequantized(data, fine_scale(scale, "scale", data.shape))
    return dequantized(data, np.broadcast_to(scale.astype(np.float64), (data.shape[1],)))


def case_dtypes(case, dtypes):
    """The dtypes of ``dtypes`` ``case`` runs in (a quantized cache's: those of `CACHE_DTYPES`)."""
    return [d for d in dtypes if case.cache is None or np.dtype(d).name in CACHE_DTYPES]


def unavailable(case):
    """What ``case`` needs that this environment lacks: ``["ml_dtypes"]`` for a float8 cache without that
    package (an optional dependency, in the test extra), else nothing."""
    if case.cache is not None and case.cache[0] != "int8" and importlib.util.find_spec("ml_dtypes") is None:
        return ["ml_dtypes"]
    return []


def select_cases(supported, cases=None):
    """Split ``cases`` (default `CASES`) into those whose requirements ``supported`` covers (and that are not
    `unavailable`) and the rest, each with what it lacks."""
    supported, cases = frozenset(supported), CASES if cases is None else cases
    run = [c for c in cases if c.requires <= supported and not unavailable(c)]
    skipped = [(c, sorted(c.requires - supported) + unavailable(c)) for c in cases if c not in run]
    return run, skipped


def variant_cases(chosen):
    """`CASES` with those of a user's variant (needing one of `VARIANT_NAMES`) when ``chosen``, else without."""
    return tuple(c for c in CASES if chosen or not c.requires & set(VARIANT_NAMES))
