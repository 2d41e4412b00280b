"""Decoding on an int8 or float8 cache against the same call on a bfloat16 and a float32 cache, in one process.

The shape of issue #68: one query, ``B=1``, 32 query heads on 8 key/value
heads, a cache of ``--cache`` keys (8,192; ``--long`` adds 32,768), head dim
128. The caches hold the same values: the float32 one quantized per kv head
(`elastic_np.quantize_kv`) for int8 and float8_e4m3fn (``k_scale``,
``v_scale``, ``q`` in float32), rounded for bfloat16 (``q`` too: a float
cache takes ``q`` in its dtype).

``--scale token`` or ``--scale group`` quantizes with one scale per token
(and kv head) or per group of 32 columns instead (float32 scales, counted in
the cache's bytes), and times the per-head int8 call beside them
(``int8/head``).

Every call of a cache length is timed in each round (best of ``--repeat``),
the order alternating from round to round; printed per length: each call's
median milliseconds, the cache's bytes over that time (its read rate), and
the ratios the issue sets goals on (> 1: the quantized cache is faster),
their median and range over the rounds; a streaming read of the int8
cache's bytes on the same threads (``read``, timed with the rest) and the
fraction of it each cache's call reaches (its bytes over its time, over the
read's rate: 1 is the memory's limit); then the peak memory a quantized
call allocates (``tracemalloc``: NumPy's arrays, the kernels' scratch is
Numba's) against the 2 MiB the issue allows.

Usage: ``python benchmarks/quantized_decode.py [--rounds R] [--repeat N] [--cache M] [--long] [--threads T]
[--scale {head,token,group}]``
"""

import argparse
import contextlib

import ml_dtypes
import numpy as np

import elastic_np as enp
from elastic_np.cli import _bench
from elastic_np.cli._bench_decode import StreamingRead

#: The quantized formats timed, and the float caches they are held against.
QUANTIZED = ("int8", "float8_e4m3fn")
FLOATS = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
#: The issue's goals: (numerator, denominator, least ratio) of seconds, so > 1 means the denominator is faster.
GOALS = [("float32", "int8", 1.6), ("bfloat16", "int8", 1.1), ("bfloat16", "float8_e4m3fn", 0.9)]


def decode_calls(cache, scale="head"):
    """``{label: (fn, cache bytes)}`` for a cache of ``cache`` keys, the quantized ones with ``scale``'s scales
    (and ``int8/head`` beside them, for any other)."""
    q, k, v = _bench.make_inputs(1, 32, 1, cache, 128, Hkv=8, dtype=np.float32, seed=2)
    calls = {}
    for name, dtype in FLOATS.items():
        qf, kf, vf = q.astype(dtype), k.astype(dtype), v.astype(dtype)  # a float cache takes q in its dtype
        calls[name] = (lambda a=(qf, kf, vf): enp.attention(*a, backend="cpu"), kf.nbytes + vf.nbytes)
    group = 32 if scale == "group" else None
    for label, name, granularity in [(n, n, scale) for n in QUANTIZED] + (
            [("int8/head", "int8", "head")] if scale != "head" else []):
        size = group if granularity == "group" else None
        (kq, ks), (vq, vs) = (enp.quantize_kv(a, name, scale=granularity, group_size=size) for a in (k, v))
        calls[label] = (lambda a=(q, kq, vq), s=(ks, vs): enp.attention(*a, k_scale=s[0], v_scale=s[1],
                                                                          backend="cpu"),
                        kq.nbytes + vq.nbytes + ks.nbytes + vs.nbytes)
    return calls


def peak_extra_mib(fn):
    """The peak of what ``fn()`` allocates through Python's allocator (NumPy's arrays), in MiB."""
    fn()
    return _bench.traced_peak_bytes(fn) / 2**20


def report(cache, seconds, sizes):
    """Print one cache length's times, read rates, fractions of the streaming read and goal ratios."""
    print(f"decode (1, 32/8, 1, {cache}, 128):")
    read_rate = sizes["read"] / np.array(seconds["read"])
    for label, times in seconds.items():
        ms = np.median(times) * 1e3
        fraction = sizes[label] / np.array(times) / read_rate
        print(f"  {label:<14} {ms:9.3f} ms  {sizes[label] / 2**20:7.1f} MiB  {sizes[label] / ms / 1e6:6.2f} GB/s  "
              f"{np.median(fraction):.2f} ({fraction.min():.2f}-{fraction.max():.2f}) of the read")
    extra = [("int8/head", "int8", None)] if "int8/head" in seconds else []
    for num, den, goal in GOALS + extra:
        ratio = np.array(seconds[num]) / np.array(seconds[den])
        wanted = "" if goal is None else f" (goal >= {goal})"
        print(f"  {num} / {den}: {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f}){wanted}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cache", type=int, default=8192)
    parser.add_argument("--long", action="store_true", help="also a cache of 32,768 keys")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scale", choices=("head", "token", "group"), default="head",
                        help="the quantized caches' scales: per kv head, per token, per group of 32 columns")
    args = parser.parse_args(argv)
    lengths = [args.cache] + ([32768] if args.long else [])
    with _bench.thread_counts(args.threads) as counts, contextlib.ExitStack() as reads:
        cases = {cache: decode_calls(cache, args.scale) for cache in lengths}
        for calls in cases.values():
            nbytes = calls["int8"][1]
            calls["read"] = (reads.enter_context(StreamingRead(nbytes, args.threads, np.float32)), nbytes)
        times = _bench.interleaved({cache: {label: fn for label, (fn, _) in calls.items()}
                                    for cache, calls in cases.items()}, args.rounds, args.repeat)
        peaks = {cache: {name: peak_extra_mib(cases[cache][name][0]) for name in QUANTIZED} for cache in lengths}
    print(f"{_bench.describe_threads(counts)}; {args.rounds} rounds, best of {args.repeat}")
    for cache in lengths:
        report(cache, times[cache], {label: size for label, (_, size) in cases[cache].items()})
        print("  peak extra memory (tracemalloc): "
              + ", ".join(f"{name} {mib:.3f} MiB" for name, mib in peaks[cache].items()) + " (goal < 2 MiB)")


if __name__ == "__main__":
    main()
