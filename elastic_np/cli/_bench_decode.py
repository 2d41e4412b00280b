"""Decode measurements: the CPU kernel beside torch SDPA and a streaming read of the cache.

Decoding is ``N`` new queries per sequence (1 to 16) against a cache of ``M``
keys, with grouped-query heads; its floor is reading the keys and values
once. `compare` times, in one process over interleaved rounds,
``enp.attention(..., causal=True, backend="cpu")``,
``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa``, when
torch is installed) and a streaming read of as many bytes on the same
threads. Each implementation runs a block of calls per round, as a decoding
loop makes them (torch's idle threads otherwise slow down whatever runs
right after it); a round's time is the best of its block. Used by
``elastic-np bench --decode`` and the asv suite.
"""

import concurrent.futures
import time

import numpy as np

import elastic_np as enp
from elastic_np import cpu
from elastic_np._contract import _validation
from elastic_np.cli import _bench

#: (B, H, Hkv, N, M, D) of the CPU inference issue's goals.
SHAPES = (
    (1, 32, 8, 1, 8192, 128),
    (4, 32, 8, 1, 4096, 128),
    (1, 32, 8, 16, 8192, 128),
    (1, 8, 8, 16, 8192, 64),
)
#: Shapes for a quick look (and CI), seconds in all: the default shapes' heads at half their cache.
QUICK_SHAPES = ((1, 32, 8, 1, 4096, 128), (1, 32, 8, 16, 4096, 128))
#: Names of the timed implementations, in the order they run in a round.
IMPLEMENTATIONS = ("ours", "torch", "read")


def parse_shape(text):
    """``"B,H,Hkv,N,M,D"`` -> a tuple of six positive ints; ValueError naming the text otherwise."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 6 or min(shape) < 1:
        raise ValueError(f"a decode shape is six positive integers B,H,Hkv,N,M,D, got {text!r}")
    B, H, Hkv, N, M, D = shape
    if H % Hkv:
        raise ValueError(f"H={H} is not a multiple of Hkv={Hkv} in shape {text!r}")
    return shape


def make_inputs(shape, dtype, seed=0):
    """Seeded ``q (B, H, N, D)``, ``k, v (B, Hkv, M, D)`` for a decode ``shape``."""
    B, H, Hkv, N, M, D = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, M, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, M, D)).astype(dtype)
    return q, k, v


class StreamingRead:
    """Sums an array of ``nbytes`` on ``threads`` threads (NumPy's sums release the GIL).

    A context manager: the thread pool is shut down on exit.
    """

    _CHUNK = 1 << 20

    def __init__(self, nbytes, threads, dtype):
        data = np.ones(max(nbytes // np.dtype(dtype).itemsize, 1), dtype=dtype)
        self.parts = np.array_split(data, threads)
        self.pool = concurrent.futures.ThreadPoolExecutor(threads)

    def _part_sum(self, x):
        return sum(float(x[i : i + self._CHUNK].sum()) for i in range(0, x.size, self._CHUNK))

    def __call__(self):
        return sum(self.pool.map(self._part_sum, self.parts))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.pool.shutdown()


def torch_decode(q, k, v):
    """A no-argument callable: torch SDPA on ``q, k, v`` with bottom-right causal alignment."""
    import torch

    tq, tk, tv = (_bench.torch_tensor(a) for a in (q, k, v))
    N, M = q.shape[2], k.shape[2]
    # query i keeps keys j <= i + M - N (all of them for N = 1)
    mask = None if N == 1 else torch.ones(N, M, dtype=torch.bool).tril(M - N)

    def run():
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                tq, tk, tv, attn_mask=mask, enable_gqa=True)

    return run


def time_block(fn, calls):
    """Best of ``calls`` timed calls of ``fn``, after two untimed ones."""
    fn()
    fn()
    best = np.inf
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(shape, dtype, *, rounds, calls, threads, with_torch=True):
    """Per-round seconds of each implementation, interleaved, and the cache's bytes.

    Returns ``(times, nbytes)``: ``times`` maps "ours", "read" and, when torch is
    installed and ``with_torch``, "torch" to a list of ``rounds`` block times.
    """
    q, k, v = make_inputs(shape, dtype)
    nbytes = k.nbytes + v.nbytes
    # as many bytes, in float32 for a half (NumPy's sums of halves are not vectorised)
    with StreamingRead(nbytes, threads, _validation.compute_dtype(dtype)) as read:
        fns = {"ours": lambda: enp.attention(q, k, v, causal=True, backend="cpu")}
        if with_torch and _bench.torch_available():
            fns["torch"] = torch_decode(q, k, v)
        fns["read"] = read
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(time_block(fn, calls))
    return times, nbytes


def summarise(shape, times, nbytes):
    """One row of results: best times (ms), per-round ratio medians and ranges, bandwidths."""
    ours = np.asarray(times["ours"])
    read = np.asarray(times["read"])
    row = {
        "shape": dict(zip(("B", "H", "Hkv", "N", "M", "D"), shape)),
        "ours_ms": 1e3 * ours.min(),
        "cache_gb_per_s": nbytes / ours.min() / 1e9,
        "read_gb_per_s": nbytes / read.min() / 1e9,
        "fraction_of_read": _spread(read / ours),
    }
    if "torch" in times:
        torch_t = np.asarray(times["torch"])
        row["torch_ms"] = 1e3 * torch_t.min()
        row["torch_over_ours"] = _spread(torch_t / ours)
    return row


def _spread(ratios):
    return {"median": float(np.median(ratios)), "min": float(ratios.min()), "max": float(ratios.max())}


def compare(shapes, dtype, *, rounds=7, calls=3, threads=None, progress=None):
    """Measure every shape; returns ``{"dtype", "threads", "thread_counts", "rounds", "calls", "rows"}``.

    ``threads`` defaults to the kernels' thread count (`elastic_np.cpu.thread_count`);
    torch and NumPy's BLAS are given the same (`_bench.thread_counts`, what it
    set in ``thread_counts``). ``progress(shape)`` is called after each shape.
    """
    dtype = _validation.numpy_dtype(dtype)
    threads = cpu.thread_count() if threads is None else threads
    rows = []
    with _bench.thread_counts(threads) as counts:
        for shape in shapes:
            times, nbytes = measure(shape, dtype, rounds=rounds, calls=calls, threads=threads)
            rows.append(summarise(shape, times, nbytes))
            if progress is not None:
                progress(shape)
    return {"dtype": dtype.name, "threads": threads, "thread_counts": counts, "rounds": rounds, "calls": calls,
            "rows": rows}


def format_table(result):
    """The rows of `compare` as text, one line per shape."""
    def spread(s):
        return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"

    lines = [
        f"decode, {result['dtype']}, causal, "
        f"{_bench.describe_threads(result['thread_counts']) if 'thread_counts' in result else result['threads']}, "
        f"{result['rounds']} rounds of blocks of {result['calls']} calls; "
        "ratios per round: median [min-max]",
        f"{'B,H,Hkv,N,M,D':>22} {'ours ms':>8} {'torch ms':>9} {'torch/ours':>18} "
        f"{'cache GB/s':>10} {'of streaming read':>18}",
    ]
    for row in result["rows"]:
        shape = ",".join(str(x) for x in row["shape"].values())
        torch_ms = f"{row['torch_ms']:.2f}" if "torch_ms" in row else "-"
        ratio = spread(row["torch_over_ours"]) if "torch_over_ours" in row else "-"
        lines.append(
            f"{shape:>22} {row['ours_ms']:8.2f} {torch_ms:>9} {ratio:>18} "
            f"{row['cache_gb_per_s']:10.1f} {spread(row['fraction_of_read']):>18}"
        )
    if result["rows"]:
        lines.append(f"streaming read: {max(r['read_gb_per_s'] for r in result['rows']):.1f} GB/s at best")
    lines.extend(_bench.unset_notes(result.get("thread_counts", {})))
    return "\n".join(lines)
