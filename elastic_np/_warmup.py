"""`warmup`: compile, or load from Numba's cache, the kernels later calls will need, ahead of them."""

import collections
import time

import numpy as np

from elastic_np import _compile_report, _dispatch, _spec, _validation
from elastic_np._errors import BackendUnavailableError

#: One shape per kernel path, ``(B, H, Hkv, N, M)``: the prefill, and both decode kernels
#: (one new query per sequence; 16, the key-major kernel's).
_PATHS = {"prefill": (1, 2, 1, 32, 32), "decode": (1, 2, 1, 1, 40), "decode, 16 queries": (1, 2, 1, 16, 40)}


#: What `warmup` returns.
Warmup = collections.namedtuple("Warmup", ["seconds", "compiled"])


def _option_names(options):
    if options is None:
        return set(_spec.MODIFIERS)  # what compiles code of its own: their stage and the bias's gradient
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
    """The options of the calls that reach the code ``names`` need: none, a modifier, a bias."""
    stages = [{}]
    if names & {"softcap", "alibi_slopes"}:
        stages.append({"softcap": 30.0})
    if "bias" in names:
        stages.append({"bias": np.full((1, 1, 1, 1), 0.25)})
    return stages


def warmup(dtypes=("float32", "float64"), options=None, backend="auto", head_dim=64, second_order=False):
    """Compile, or load from Numba's on-disk cache, what later calls of `attention` will run.

    A kernel compiles on its first call in a process: seconds for each dtype
    (loading it from the cache, which the first compile fills, takes a
    fraction of that). Call this where waiting is cheap: in a Docker image's
    build (``RUN elastic-np warmup``, which fills the cache the image ships),
    at a worker's start (``client.run(elastic_np.warmup)`` for Dask), or
    before a training loop. It calls `attention` and `attention_backward` on
    tiny inputs, once per kernel path (prefill, and both decode kernels),
    which compiles every specialisation later calls of those dtypes use:
    the kernels take the options as runtime values, and only the score
    modifiers and the bias's gradient have code of their own. A compile is
    logged at INFO level on the ``"elastic_np"`` logger, as on any call.

    Parameters
    ----------
    dtypes : sequence of dtype-like, optional
        The dtypes of later calls (default: float32 and float64).
    options : sequence of str, optional
        Names of the options later calls use (``("causal", "softcap")``);
        None (default) compiles what every option needs.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        The backend to warm up, as `attention` picks it ("auto", the
        default: "cuda" when a GPU is usable, else "cpu"); "reference"
        compiles nothing.
    head_dim : int, optional
        The head dimension of the tiny calls. The CPU kernels serve every
        head dimension with one compile; the CUDA kernels compile per
        head dimension.
    second_order : bool, optional
        Also compile the double backward (`attention_double_backward`), for
        second derivatives (gradient penalties, Hessian-vector products):
        its own kernels, about as long again to compile. Default False.

    Returns
    -------
    Warmup
        ``seconds``: ``{(dtype name, path): seconds}`` for each kernel path
        (and ``"double backward"`` with ``second_order``);
        ``compiled``: how many functions Numba compiled (0 when everything
        came from the cache or was already loaded).

    Raises
    ------
    ValueError
        For an unknown option name, a dtype the backend does not take, or a
        bad ``head_dim``.
    BackendUnavailableError
        When the backend is not usable here, or has no double backward and
        ``second_order`` is true.

    Examples
    --------
    >>> import elastic_np as enp
    >>> report = enp.warmup(dtypes=["float64"], options=["causal"])
    >>> sorted(report.seconds)
    [('float64', 'decode'), ('float64', 'decode, 16 queries'), ('float64', 'prefill')]
    """
    names = _option_names(options)
    if not (isinstance(head_dim, int) and head_dim > 0):
        raise ValueError(f"`head_dim` must be a positive int, got {head_dim!r}")
    module = _dispatch.get_backend(backend)
    dtypes = _checked_dtypes(module, dtypes)
    name = module.__name__.rsplit(".", 1)[-1]
    if second_order and not hasattr(module, "double_backward"):
        raise BackendUnavailableError(f"backend {name!r} has no double backward to warm up (`second_order`)")
    paths = [(path, shape, False) for path, shape in _PATHS.items()]
    if second_order:
        paths.append(("double backward", _PATHS["prefill"], True))
    seconds = {}
    with _compile_report.watch() as everything:
        if hasattr(module, "start_threads"):  # else the first call that goes parallel starts them
            module.start_threads()
        for dtype in dtypes:
            for path, shape, second in paths:
                start = time.perf_counter()
                for stage_options in _stages(names):
                    _run(shape, head_dim, dtype, dict(stage_options, backend=name), second_order=second)
                seconds[(dtype.name, path)] = time.perf_counter() - start
    return Warmup(seconds, len(everything.compiled))


def _checked_dtypes(module, dtypes):
    """``dtypes`` (one or a sequence) as NumPy dtypes; a `ValueError` for one the backend does not take."""
    given = [dtypes] if isinstance(dtypes, (str, type, np.dtype)) else dtypes
    dtypes = [_validation.numpy_dtype(d) for d in given]
    for dtype in dtypes:
        if module.dtypes is not None and dtype.name not in module.dtypes:
            taken = ", ".join(str(d) for d in module.dtypes)
            raise ValueError(f"`dtypes` must be among the backend's ({taken}); got {dtype}")
    return dtypes


def _run(shape, head_dim, dtype, options, second_order=False):
    """One forward and backward of `attention` at ``shape`` in ``dtype`` (the double backward instead
    of the backward with ``second_order``)."""
    B, H, Hkv, N, M = shape
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, N, head_dim)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, M, head_dim)).astype(dtype) for _ in range(2))
    out, lse = _dispatch.attention(q, k, v, return_lse=True, **options)
    if second_order:
        _dispatch.attention_double_backward(q, k, v, np.ones_like(out), q, k, v, out, lse, **options)
    else:
        _dispatch.attention_backward(np.ones_like(out), q, k, v, out, lse, **options)
