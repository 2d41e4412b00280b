"""Shared base of the asv suite: profiles, seeded inputs, FLOP counts, backends.

Every benchmark module imports its inputs and parameter grids from here so
that the same problem means the same arrays everywhere (one seed), and so
that the grid can be shrunk for a quick check in one place.

Profiles
--------
The environment variable ``ELASTIC_NP_ASV_PROFILE`` picks the parameter
grids when the suite is imported (asv reads the grids at discovery):

``regular`` (default)
    Sequence lengths 256 and 1024, float32 and float64, long sequences of
    4096 for ``peakmem_``.
``quick``
    One short sequence length (128), float32 only in the timing grids, long
    sequences of 1024: what CI's ``asv run --python=same --quick --dry-run``
    uses to stay within minutes. Every option set still runs once, and the
    accuracy benchmarks keep both dtypes.

Compilation
-----------
asv's ``--quick`` times a single call, so a benchmark that reached a Numba
kernel for the first time would record its compile time. Every benchmark
that runs a kernel therefore calls it once in ``setup`` (see `warm_up`).
"""

import os

import numpy as np

import elastic_np
from elastic_np._api import dispatch

try:  # the measurement helpers, in the tools' package since it has one
    import elastic_np.cli._bench as _bench
except ImportError:
    try:  # before: at the top of the package; they appeared after its skeleton
        from elastic_np import _bench
    except ImportError:  # pragma: no cover - only on very old commits
        _bench = None

PROFILE = os.environ.get("ELASTIC_NP_ASV_PROFILE", "regular")
_PROFILES = {
    "regular": {
        "seq_lens": [256, 1024],
        "long_seq_lens": [4096],
        "dtypes": ["float32", "float64"],
        "repeat": 5,
    },
    "quick": {"seq_lens": [128], "long_seq_lens": [1024], "dtypes": ["float32"], "repeat": 1},
}
if PROFILE not in _PROFILES:
    raise ValueError(
        f"ELASTIC_NP_ASV_PROFILE must be one of {sorted(_PROFILES)}, got {PROFILE!r}"
    )

SEED = 0
SEQ_LENS = _PROFILES[PROFILE]["seq_lens"]
LONG_SEQ_LENS = _PROFILES[PROFILE]["long_seq_lens"]
#: Timed repetitions inside a ``track_`` throughput benchmark (best of).
TRACK_REPEAT = _PROFILES[PROFILE]["repeat"]
#: dtypes of the timing grids; the accuracy benchmarks always cover both.
DTYPES = _PROFILES[PROFILE]["dtypes"]
ACCURACY_DTYPES = ["float32", "float64"]

#: Batch, query heads, head dimension of every attention benchmark.
BATCH, HEADS, HEAD_DIM = 1, 4, 64
#: Key/value heads of the grouped-query variant (4 query heads share one).
GQA_KV_HEADS = 1
#: Sequence length of the accuracy benchmarks: not a multiple of any tile.
ACCURACY_SEQ_LEN = 200

#: The option sets the kernels are benchmarked with. ``gqa`` is plain
#: attention with `GQA_KV_HEADS` key/value heads.
VARIANTS = ["plain", "causal", "window", "elastic", "dynamic_window", "gqa"]


def variant_options(variant):
    """Keyword options of `elastic_np.attention` for one entry of `VARIANTS`."""
    if variant in ("plain", "gqa"):
        return {}
    if variant == "causal":
        return {"causal": True}
    if variant == "window":
        # A causal sliding window of 64 keys: the cost should follow the window.
        return {"window_size": (64, 0)}
    if variant == "elastic":
        return {"nvm": True, "tau": 0.5, "beta": 1.0}
    if variant == "dynamic_window":
        # Open where the bell exceeds 0.1: a band of about +-14% of M around the diagonal.
        return {"dynamic_window": elastic_np.DynamicWindow(0.1, sharpness=1.0, threshold=0.1)}
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


def kv_heads(variant):
    """Key/value heads for ``variant``: `GQA_KV_HEADS` for "gqa", else `HEADS`."""
    return GQA_KV_HEADS if variant == "gqa" else HEADS


def make_inputs(N, dtype, *, M=None, Hkv=HEADS, seed=SEED):
    """Seeded ``q`` ``(BATCH, HEADS, N, HEAD_DIM)`` and ``k, v`` ``(BATCH, Hkv, M, HEAD_DIM)``."""
    require_bench_helpers()
    M = N if M is None else M
    return _bench.make_inputs(
        BATCH, HEADS, N, M, HEAD_DIM, Hkv=Hkv, dtype=np.dtype(dtype), seed=seed
    )


def make_dout(N, dtype, seed=SEED + 1):
    """Seeded cotangent of the output, ``(BATCH, HEADS, N, HEAD_DIM)``."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((BATCH, HEADS, N, HEAD_DIM)).astype(dtype)


def kept_pairs(N, M, *, causal=False, window_size=(-1, -1), dynamic_window=None, **_):
    """Number of ``(i, j)`` pairs the structural options keep (per batch and head).

    Counts causal, ``window_size`` and the band where the dynamic window's bell
    exceeds its threshold; NVM and ``tau``/``beta`` remove nothing structurally
    (which scores NVM drops depends on the data) and are ignored.
    """
    i = np.arange(N)[:, None] + (M - N)  # bottom-right aligned query position
    j = np.arange(M)[None, :]
    keep = np.ones((N, M), dtype=bool)
    if causal:
        keep &= j <= i
    left, right = window_size
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    if dynamic_window is not None:
        sigma = float(np.max(dynamic_window.sigma))
        x = 2.0 * (j - i) / (M - 1) if M > 1 else np.zeros((N, M))
        bell = np.exp(-(x**2) / (2 * sigma**2)) / (sigma * np.sqrt(2 * np.pi))
        keep &= bell > dynamic_window.threshold
    return int(keep.sum())


def flops(N, M=None, *, backward=False, B=BATCH, H=HEADS, D=HEAD_DIM, Dv=None, **options):
    """FLOPs of one attention call, counting only the pairs the options keep.

    The FlashAttention convention: ``2 * (D + Dv)`` per kept pair and head for
    the forward's two matrix products; forward + backward counts 3.5 forwards
    (the backward's five products). With ``causal=True`` alone this equals
    `elastic_np.cli._bench.attention_flops`. GFLOP/s computed from it are useful
    work per second: a kernel that skips masked tiles is not credited for them.
    """
    M = N if M is None else M
    Dv = D if Dv is None else Dv
    forward = 2.0 * B * H * kept_pairs(N, M, **options) * (D + Dv)
    return forward * (3.5 if backward else 1.0)


def require_bench_helpers():
    """Raise `NotImplementedError` (asv: skipped) when ``elastic_np.cli._bench`` is missing."""
    if _bench is None:
        raise NotImplementedError("elastic_np.cli._bench is not in this version of the package")
    return _bench


def require_backend(name):
    """The backend module ``name``; `NotImplementedError` (asv: skipped) when unavailable.

    A kernel module that does not exist yet in the benchmarked commit, or a
    CUDA backend without a usable GPU, makes the benchmark skip in ``setup``.
    """
    try:
        return dispatch.get_backend(name)
    except (dispatch.BackendUnavailableError, ImportError) as exc:
        raise NotImplementedError(str(exc)) from exc


def require_torch():
    """Raise `NotImplementedError` (asv: skipped) when PyTorch is not installed."""
    require_bench_helpers()
    if not _bench.torch_available():
        raise NotImplementedError("torch is not installed")


def warm_up(fn):
    """Call ``fn`` once so that any JIT compilation happens in ``setup``, not in a timing.

    A backend that does not implement an option yet raises
    `NotImplementedError`, which asv reports as a skipped benchmark.
    """
    return fn()


def relative_error(result, oracle):
    """Normwise worst error ``max|result - oracle| / max|oracle|``, in float64."""
    result = np.asarray(result, dtype=np.float64)
    oracle = np.asarray(oracle, dtype=np.float64)
    if result.shape != oracle.shape:
        raise ValueError(f"shape {result.shape} differs from the oracle's {oracle.shape}")
    scale = np.max(np.abs(oracle)) if oracle.size else 0.0
    worst = np.max(np.abs(result - oracle)) if oracle.size else 0.0
    return float(worst / scale) if scale > 0 else float(worst)


class AttentionCase:
    """One attention problem for a backend: seeded inputs, options, forward and backward.

    Parameters
    ----------
    backend : str
        "reference", "cpu" or "cuda"; an unavailable one raises
        `NotImplementedError` (asv: skipped).
    variant : str
        An entry of `VARIANTS`.
    N : int
        Query and key sequence length.
    dtype : str or dtype
    """

    def __init__(self, backend, variant, N, dtype):
        require_backend(backend)
        self.backend = backend
        self.variant = variant
        self.N = N
        self.options = variant_options(variant)
        self.q, self.k, self.v = make_inputs(N, dtype, Hkv=kv_heads(variant))
        self.dout = make_dout(N, dtype)

    def forward(self):
        """``(out, lse)`` from `elastic_np.attention`."""
        return elastic_np.attention(
            self.q, self.k, self.v, return_lse=True, backend=self.backend, **self.options
        )

    def backward(self, out, lse):
        """`elastic_np.AttentionGrads` from `elastic_np.attention_backward`."""
        return elastic_np.attention_backward(
            self.dout, self.q, self.k, self.v, out, lse, backend=self.backend, **self.options
        )

    def forward_backward(self):
        return self.backward(*self.forward())

    def flops(self, backward=False):
        return flops(self.N, backward=backward, **self.options)


def best_time(fn):
    """Best wall time of ``fn()`` in seconds over `TRACK_REPEAT` calls (at least 0.2 s in all)."""
    bench = require_bench_helpers()
    return bench.best_time(fn, repeat=TRACK_REPEAT, min_time=0.2 if TRACK_REPEAT > 1 else 0.0)
