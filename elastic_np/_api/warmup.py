"""`warmup`: compile, or load from Numba's cache, every kernel later calls will need, ahead of them.

What compiles separately, and so what `warmup` runs (tiny calls, through
the public functions, once per kernel path and dtype):

- a kernel per path: the prefill, the decode kernel of a few queries and
  the key-major one of 16, the backward, the double backward;
- the decode kernels again for keys read by position rather than by head:
  a ``(B, N, H, D)`` cache (``layout="bnhd"``, every packed sequence) and
  paged keys (``block_table``);
- stages compiled on first use: the score modifiers (soft-cap, ALiBi, the
  bias), the bias's gradient, the dynamic window's tables;
- for bfloat16, the prefill forward on AMX tiles and the one without them
  (NVM, a head dimension the tiles do not take);
- the forwards of a quantized cache, per format and kind of scale (per
  head; float32 and float16 per-token or per-group ones), when asked
  (``caches``);
- a user's variant (``score_mod``, ``mask_mod``, a block mask), whose
  kernels compile per function and are kept in the process only, when
  given.

The other options are runtime values of the same kernels (`elastic_np.cpu._prefill.plan`).
"""

import collections
import time

import numpy as np

from elastic_np._api import compile_report, dispatch, varlen
from elastic_np._contract import _quantized, _spec, _validation
from elastic_np._contract._errors import BackendUnavailableError
from elastic_np._contract._types import DynamicWindow
from elastic_np._variants.block_mask import create_block_mask
from elastic_np._variants.variant import given, make_variant

#: ``(H, Hkv, N, M)`` of the padded calls of each path (batch 1): the prefill, and both decode kernels (one
#: new query per sequence; 16, the key-major kernel's). Two kv heads: with one, a ``(B, M, Hkv, D)`` cache
#: is also a ``(B, Hkv, M, D)`` one, and ``layout="bnhd"`` would not reach the kernels' other reading.
_HEADS = (4, 2)
_PADDED = {"prefill": (*_HEADS, 32, 32), "decode": (*_HEADS, 1, 40), "decode, 16 queries": (*_HEADS, 16, 40)}

#: The packed sequences, ``(queries, keys)`` each: a prefill, a decode of one query and one of 16.
_PACKED = ((24, 24), (1, 40), (16, 40))

#: The paged calls: 2 sequences of ``queries`` each, ``used`` keys of pages of ``block`` keys.
_PAGED = {"queries": (1, 16), "used": (40, 21), "block": 16}

#: The options of the calls that leave the kernels' common stage (the other options are runtime values).
_COMMON = {"causal": True, "nvm": True, "tau": 0.5, "beta": 0.5}


#: What `warmup` returns.
Warmup = collections.namedtuple("Warmup", ["seconds", "compiled"])


def _option_names(options):
    if options is None:
        return set(_spec.MODIFIERS) | {"dynamic_window"}  # what compiles code of its own
    if isinstance(options, str):
        options = (options,)
    names = set(options)
    unknown = sorted(names - set(_spec.NAMES))
    if unknown:
        raise ValueError(
            f"`options` must name options of `attention` ({', '.join(_spec.NAMES)}); got {', '.join(unknown)}"
        )
    return names


def _stages(names):
    """The options of the calls that reach the code ``names`` need: the common stage, a modifier, a bias, a window.

    The common stage's NVM also reaches bfloat16's prefill forward without
    AMX tiles, which other head dimensions run too.
    """
    stages = [{}, dict(_COMMON)]
    if names & {"softcap", "alibi_slopes"}:
        stages.append({"softcap": 30.0, "alibi_slopes": np.linspace(0.25, 1.0, _HEADS[0])})
    if "bias" in names:
        stages.append({"bias": np.full((1, 1, 1, 1), 0.25)})
    if "dynamic_window" in names:
        stages.append({"dynamic_window": DynamicWindow(2.0)})
    return stages


def warmup(dtypes=("float32", "float64"), options=None, backend="auto", head_dim=64, second_order=False, caches=(),
           *, score_mod=None, mask_mod=None, block_mask=None, captures=()):
    """Compile, or load from Numba's on-disk cache, every kernel that later calls of ``dtypes`` will run.

    A kernel compiles on its first call in a process: seconds for each dtype
    and path (loading it from the cache, which the first compile fills,
    takes a fraction of that). Call this where waiting is cheap: in a Docker
    image's build (``RUN elastic-np warmup``, which fills the cache the image
    ships), at a worker's start (``client.run(elastic_np.warmup)`` for
    Dask), or before a training loop.

    It runs tiny calls of every path in both layouts (``"bhnd"`` and
    ``"bnhd"``): the forward and backward of the prefill, of both decode
    kernels (one query, and the key-major kernel's 16) and of packed batches
    (`varlen_attention` with ``cu_seqlens``), and the forward of paged
    batches (``block_table``, ``seqused_k``; they have no backward), each
    plain, with the common options (causal, NVM, ``tau``, ``beta``), and
    with those of the score modifiers, the bias (and its gradient) and the
    dynamic window that ``options`` names: what compiles code of its own,
    every other option being a runtime value of the same kernels.
    ``second_order`` adds the double backward (at the prefill's and the
    decode's shapes, in both layouts). A compile is logged at INFO level on
    the ``"elastic_np"`` logger, as on any call, but not announced
    (`CompileWarning`): here it is what was asked for.

    Parameters
    ----------
    dtypes : sequence of dtype-like, optional
        The dtypes of later calls (default: float32 and float64).
    options : sequence of str, optional
        Names of the options later calls use (``("causal", "softcap")``);
        None (default) compiles what every option needs. Only the score
        modifiers (``softcap``, ``alibi_slopes``), ``bias`` and
        ``dynamic_window`` have code of their own, compiled when named.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        The backend to warm up, as `attention` picks it ("auto", the
        default: "cuda" when a GPU is usable, else "cpu"); "reference"
        compiles nothing.
    head_dim : int, optional
        The head dimension of the tiny calls. The CPU kernels serve every
        head dimension with one compile (bfloat16's prefill forward, which
        runs on AMX tiles where the head dimension allows, with two, both
        compiled here); the CUDA kernels compile per head dimension.
    second_order : bool, optional
        Also compile the double backward (`attention_double_backward`), for
        second derivatives (gradient penalties, Hessian-vector products):
        its own kernels, about as long again to compile. Default False.
    caches : sequence of str, optional
        The quantized cache formats later calls read (``"int8"``,
        ``"float8_e4m3fn"``, ``"float8_e5m2"``): each one's forwards (decode
        and prefill, contiguous in both layouts and paged), with per-head
        scales and with float32 and float16 per-token or per-group ones,
        for the dtypes of ``q`` among ``dtypes`` that read one (float32,
        bfloat16, float16). Default none.
    score_mod, mask_mod, block_mask, captures : optional
        A user's variant, as later calls of `attention` pass it: its
        kernels (the forward and the backward, padded in both layouts and
        packed), which compile per function and which Numba keeps in the
        process only, compiled here (the path ``"variant"``). They run on a
        problem of one query and one key, where ``b``, ``h``, ``q_idx`` and
        ``kv_idx`` are 0: the functions must take those indices. A block
        mask stands for every block mask of its ``mask_mod`` (they share
        the kernels). The CPU backend only.

    Returns
    -------
    Warmup
        ``seconds``: ``{(dtype name, path): seconds}`` for each path
        (``"prefill"``, ``"decode"``, ``"decode, 16 queries"``, ``"packed"``,
        ``"paged"``, ``"double backward"`` with ``second_order``, and
        ``"int8 cache"`` and so on with ``caches``);
        ``compiled``: how many functions Numba compiled (0 when everything
        came from the cache or was already loaded).

    Raises
    ------
    ValueError
        For an unknown option name, a dtype the backend does not take, a
        bad ``head_dim``, or a variant for a backend without user variants.
    BackendUnavailableError
        When the backend is not usable here, or has no double backward and
        ``second_order`` is true.

    Examples
    --------
    >>> import elastic_np as enp
    >>> report = enp.warmup(dtypes=["float64"], options=["causal"])
    >>> [path for dtype, path in report.seconds]
    ['prefill', 'decode', 'decode, 16 queries', 'packed', 'paged']
    """
    names = _option_names(options)
    if not (isinstance(head_dim, int) and head_dim > 0):
        raise ValueError(f"`head_dim` must be a positive int, got {head_dim!r}")
    module = dispatch.get_backend(backend)
    dtypes = _checked_dtypes(module, dtypes)
    name = module.__name__.rsplit(".", 1)[-1]
    if second_order and not hasattr(module, "double_backward"):
        raise BackendUnavailableError(f"backend {name!r} has no double backward to warm up (`second_order`)")
    stages = _stages(names)
    paths = [(path, _padded_calls(shape), stages) for path, shape in _PADDED.items()]
    paths += [("packed", _packed_calls, stages), ("paged", _paged_calls, stages)]
    if second_order:
        paths.append(("double backward", _double_backward_calls, stages))
    cache_paths = [(f"{fmt} cache", _cache_calls(fmt), [{}]) for fmt in _cache_formats(caches, name)]
    variant = _variant(module, name, score_mod, mask_mod, block_mask, captures)
    if variant is not None:
        paths.append(("variant", _variant_calls, [variant]))
    seconds = {}
    with compile_report.watch() as everything, compile_report.unannounced():
        if hasattr(module, "start_threads"):  # else the first call that goes parallel starts them
            module.start_threads()
        for dtype in dtypes:
            for path, calls, path_stages in paths + (cache_paths if dtype.name in _quantized.QUERY_DTYPES else []):
                start = time.perf_counter()
                for stage in path_stages:
                    calls(_Inputs(dtype, head_dim), dict(stage, backend=name))
                seconds[(dtype.name, path)] = time.perf_counter() - start
    return Warmup(seconds, len(everything.compiled))


def _variant(module, name, score_mod, mask_mod, block_mask, captures):
    """The options of a user's variant's calls (a block mask remade for one query and one key), or None."""
    if not given(score_mod, mask_mod, block_mask, captures):
        return None
    made = make_variant(score_mod, mask_mod, block_mask, captures)  # checked as a call checks it
    if not getattr(module, "takes_variants", False):
        raise ValueError(f"backend {name!r} does not take a user's `score_mod`, `mask_mod` or `block_mask`")
    options = {"score_mod": made.score_mod, "captures": made.captures}
    if block_mask is not None:
        options["block_mask"] = create_block_mask(made.mask_mod, 1, 1, 1, 1, captures=made.captures)
    else:
        options["mask_mod"] = made.mask_mod
    return options


def _variant_calls(inputs, options):
    """A user's variant: the forward and backward of `attention` at one query and one key in both layouts, and of
    `varlen_attention` on one such sequence (without a block mask, which it does not take)."""
    for layout in _spec.LAYOUTS:
        q, k, v = inputs.padded(1, 1, 1, 1, layout)
        out, lse = dispatch.attention(q, k, v, return_lse=True, layout=layout, **options)
        dispatch.attention_backward(np.ones_like(out), q, k, v, out, lse, layout=layout, **options)
    if "block_mask" not in options:
        cu = np.array([0, 1])
        q, k, v = inputs(1, 1), inputs(1, 1), inputs(1, 1)
        out, lse = varlen.varlen_attention(q, k, v, cu, cu, return_lse=True, **options)
        varlen.varlen_attention_backward(np.ones_like(out), q, k, v, out, lse, cu, cu, **options)


def _cache_formats(caches, backend):
    """``caches`` checked: quantized formats (a `ValueError` naming another), none for a backend without them."""
    caches = (caches,) if isinstance(caches, str) else tuple(caches)
    unknown = [c for c in caches if c not in _quantized.QUANTIZED_DTYPES]
    if unknown:
        raise ValueError(f"`caches` must name quantized formats ({', '.join(_quantized.QUANTIZED_DTYPES)}); got "
                         f"{', '.join(map(str, unknown))}")
    return caches if backend == "cpu" else ()


def _cache_calls(fmt):
    """The forwards of a quantized cache of ``fmt``: decode and prefill in both layouts, and paged, with a scale
    per kv head, float32 per-token scales and float16 per-group ones."""

    def calls(inputs, options):
        for scale, scale_dtype in (("head", np.float32), ("token", np.float32), ("group", np.float16)):
            def quantized(a, layout):
                data, factor = _quantized.quantize_kv(a, fmt, scale=scale, layout=layout,
                                                      group_size=a.shape[-1] // 2 if scale == "group" else None)
                return data, factor.astype(scale_dtype)

            for shape in (_PADDED["decode"], _PADDED["prefill"]):
                for layout in _spec.LAYOUTS:
                    q, k, v = inputs.padded(*shape, layout)
                    (kd, ks), (vd, vs) = quantized(k, layout), quantized(v, layout)
                    dispatch.attention(q, kd, vd, k_scale=ks, v_scale=vs, layout=layout, **options)
            table, used, pages = _paged_table(inputs)
            (kd, ks), (vd, vs) = (quantized(a, "bnhd") for a in pages)
            for queries in (1, 20):  # the decode kernel, the prefill kernel (more than 16 queries)
                q = inputs(used.size * queries, _HEADS[0])
                varlen.varlen_attention(q, kd, vd, np.arange(used.size + 1) * queries, None, block_table=table,
                                         seqused_k=used, k_scale=ks, v_scale=vs, **options)

    return calls


def _checked_dtypes(module, dtypes):
    """``dtypes`` (one or a sequence) as NumPy dtypes; a `ValueError` for one the backend does not take."""
    given = [dtypes] if isinstance(dtypes, (str, type, np.dtype)) else dtypes
    dtypes = [_validation.numpy_dtype(d) for d in given]
    for dtype in dtypes:
        if module.dtypes is not None and dtype.name not in module.dtypes:
            taken = ", ".join(str(d) for d in module.dtypes)
            raise ValueError(f"`dtypes` must be among the backend's ({taken}); got {dtype}")
    return dtypes


class _Inputs:
    """Random arrays of one dtype and head dimension, drawn from one seed."""

    def __init__(self, dtype, head_dim):
        self.dtype, self.head_dim, self.rng = dtype, head_dim, np.random.default_rng(0)

    def __call__(self, *shape):
        """An array of ``shape`` followed by the head dimension."""
        return self.rng.standard_normal((*shape, self.head_dim)).astype(self.dtype)

    def padded(self, H, Hkv, N, M, layout):
        """``q, k, v`` of one sequence in ``layout``, ``(1, H, N, D)`` or ``(1, N, H, D)``."""
        if layout == "bnhd":
            return self(1, N, H), self(1, M, Hkv), self(1, M, Hkv)
        return self(1, H, N), self(1, Hkv, M), self(1, Hkv, M)


def _padded_calls(shape):
    """The forward and backward of `attention` at ``(H, Hkv, N, M)``, in both layouts."""

    def calls(inputs, options):
        for layout in _spec.LAYOUTS:
            q, k, v = inputs.padded(*shape, layout)
            out, lse = dispatch.attention(q, k, v, return_lse=True, layout=layout, **options)
            dispatch.attention_backward(np.ones_like(out), q, k, v, out, lse, layout=layout, **options)

    return calls


def _double_backward_calls(inputs, options):
    """The forward and double backward of `attention` at the prefill's and the decode's shapes, in both layouts."""
    for shape in (_PADDED["prefill"], _PADDED["decode"]):
        for layout in _spec.LAYOUTS:
            q, k, v = inputs.padded(*shape, layout)
            out, lse = dispatch.attention(q, k, v, return_lse=True, layout=layout, **options)
            dispatch.attention_double_backward(np.ones_like(q), None, None, np.ones_like(out), q, k, v, out, lse,
                                                layout=layout, **options)


def _per_sequence(options, count):
    """``options`` as a packed call takes them: a bias as one array per sequence."""
    if options.get("bias") is None:
        return options
    return {**options, "bias": [options["bias"][0]] * count}


def _packed_calls(inputs, options):
    """`varlen_attention` and its backward on `_PACKED`'s sequences."""
    cu_q, cu_k = (np.cumsum([0, *lengths]) for lengths in zip(*_PACKED))
    q, k, v = inputs(cu_q[-1], _HEADS[0]), inputs(cu_k[-1], _HEADS[1]), inputs(cu_k[-1], _HEADS[1])
    options = _per_sequence(options, len(_PACKED))
    out, lse = varlen.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **options)
    varlen.varlen_attention_backward(np.ones_like(out), q, k, v, out, lse, cu_q, cu_k, **options)


def _paged_table(inputs):
    """``(table, used, (k, v))``: `_PAGED`'s sequences, their pages in order, and pages of ``inputs``."""
    used, block = np.array(_PAGED["used"]), _PAGED["block"]
    blocks = -(-used // block)
    table = np.zeros((used.size, blocks.max()), dtype=np.int64)
    for s, first in enumerate(np.cumsum([0, *blocks[:-1]])):
        table[s, :blocks[s]] = first + np.arange(blocks[s])
    return table, used, (inputs(blocks.sum(), block, _HEADS[1]), inputs(blocks.sum(), block, _HEADS[1]))


def _paged_calls(inputs, options):
    """`varlen_attention` over a paged cache, with each of `_PAGED`'s numbers of queries a sequence."""
    table, used, (k, v) = _paged_table(inputs)
    options = _per_sequence(options, used.size)
    for queries in _PAGED["queries"]:
        q = inputs(used.size * queries, _HEADS[0])
        varlen.varlen_attention(q, k, v, np.arange(used.size + 1) * queries, None, block_table=table,
                                 seqused_k=used, **options)
