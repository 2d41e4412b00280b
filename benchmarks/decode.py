"""Side-by-side decode benchmark: the CPU decode kernel, torch SDPA and the memory's bandwidth.

Decoding is ``N`` new queries per sequence (1 to 16) against a cache of ``M``
keys, with grouped-query heads; its floor is reading the keys and values
once. For each shape, measured in one process over interleaved rounds, this
prints the time of ``enp.attention(..., causal=True, backend="cpu")``, of
``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa``, when
torch is installed), the ratio torch / ours (> 1: faster than torch), and
the cache's bytes over our time as a fraction of a streaming read of an
array of the same size on the same threads. Each implementation runs in a
block of calls per round, as a decoding loop makes them (torch's idle
threads otherwise slow down whatever runs right after it); a round's time is
the best of its block.

Usage: ``python benchmarks/decode.py [--rounds R] [--dtype float32] [--shapes B,H,Hkv,N,M,D ...]``
"""

import argparse
import concurrent.futures
import time

import numpy as np

import elastic_np as enp
from elastic_np import _bench, cpu

#: The shapes of the CPU inference issue: (B, H, Hkv, N, M, D).
SHAPES = ((1, 32, 8, 1, 8192, 128), (4, 32, 8, 1, 4096, 128), (1, 32, 8, 16, 8192, 128), (1, 8, 8, 16, 8192, 64))


def streaming_read(nbytes, threads, dtype):
    """A function that sums an array of ``nbytes`` on ``threads`` threads (NumPy's sums release the GIL)."""
    data = np.ones(max(nbytes // np.dtype(dtype).itemsize, 1), dtype=dtype)
    parts = np.array_split(data, threads)
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    chunk = 1 << 20

    def part_sum(x):
        return sum(float(x[i : i + chunk].sum()) for i in range(0, x.size, chunk))

    return lambda: sum(pool.map(part_sum, parts))


def _torch_attention(q, k, v, N, M):
    import torch

    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

    def run():
        # bottom-right causal: query i keeps keys j <= i + M - N (all of them for N = 1)
        mask = None if N == 1 else torch.ones(N, M, dtype=torch.bool).tril(M - N)
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)

    return run


def time_block(fn, calls):
    """Best of ``calls`` timed calls, after two untimed ones."""
    fn()
    fn()
    best = np.inf
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(shape, dtype, rounds, calls, threads):
    """Per-round times (s) of ``ours``, ``torch`` (or None) and ``read``, and the cache's bytes."""
    B, H, Hkv, N, M, D = shape
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, N, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, M, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, M, D)).astype(dtype)
    fns = {"ours": lambda: enp.attention(q, k, v, causal=True, backend="cpu")}
    if _bench.torch_available():
        fns["torch"] = _torch_attention(q, k, v, N, M)
    nbytes = k.nbytes + v.nbytes
    fns["read"] = streaming_read(nbytes, threads, dtype)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(time_block(fn, calls))
    return times, nbytes


def _spread(values):
    values = np.asarray(values)
    return f"{np.median(values):.2f} [{values.min():.2f}-{values.max():.2f}]"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per block")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--shapes", nargs="*", help="B,H,Hkv,N,M,D each (default: the issue's shapes)")
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    threads = cpu.thread_count()
    if _bench.torch_available():
        import torch

        torch.set_num_threads(threads)
    print(f"decode, {args.dtype}, causal, {threads} threads, {args.rounds} rounds of blocks of {args.calls} calls")
    print("per-round ratios: median [min-max]")
    for shape in shapes:
        times, nbytes = measure(shape, np.dtype(args.dtype), args.rounds, args.calls, threads)
        ours = np.array(times["ours"])
        line = f"(B,H,Hkv,N,M,D)={shape}: ours {ours.min() * 1e3:.2f} ms"
        if "torch" in times:
            torch_t = np.array(times["torch"])
            line += f", torch {torch_t.min() * 1e3:.2f} ms, torch/ours {_spread(torch_t / ours)}"
        read = np.array(times["read"])
        line += (
            f", cache {nbytes / ours.min() / 1e9:.1f} GB/s = {_spread(read / ours)} of a streaming read"
            f" ({nbytes / read.min() / 1e9:.1f} GB/s)"
        )
        print(line, flush=True)


if __name__ == "__main__":
    main()
