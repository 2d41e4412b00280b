"""Prefill over an int8 cache (per-head and per-group scales) against the same call on a float32 cache, in one process.

``N`` causal queries (512 by default) over ``M`` keys (4,096), 8 query heads
on 2 kv heads, head dim 64, ``q`` float32; the int8 caches hold the float32
one quantized (`elastic_np.quantize_kv`), with one scale per kv head and one
per group of 32 columns. The prefill kernel reads a quantized cache in
place, a key tile's bytes dequantized into its scratch as it reads them.
Every call is timed in each round (best of ``--repeat``), the order
reversed every other round; printed: each call's median milliseconds and
its time over the float32 call's (< 1: the int8 cache faster), median and
range over the rounds.

Usage: ``python benchmarks/quantized_prefill.py [--rounds R] [--repeat N] [--queries N] [--keys M] [--threads T]``
"""

import argparse

import numpy as np

import elastic_np as enp
from elastic_np.cli import _bench


def prefill_calls(N, M):
    """``{label: fn}``: the float32 cache's call and the int8 caches'."""
    q, k, v = _bench.make_inputs(1, 8, N, M, 64, Hkv=2, dtype=np.float32, seed=3)
    calls = {"float32": lambda: enp.attention(q, k, v, causal=True, backend="cpu")}
    for label, scale, group in (("int8/head", "head", None), ("int8/group", "group", 32)):
        (kq, ks), (vq, vs) = (enp.quantize_kv(a, "int8", scale=scale, group_size=group) for a in (k, v))
        calls[label] = (lambda a=(q, kq, vq), s=(ks, vs): enp.attention(*a, k_scale=s[0], v_scale=s[1], causal=True,
                                                                          backend="cpu"))
    return calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    with _bench.thread_counts(args.threads) as counts:
        times = _bench.interleaved({"prefill": prefill_calls(args.queries, args.keys)}, args.rounds,
                                   args.repeat)["prefill"]
    print(f"{_bench.describe_threads(counts)}; {args.rounds} rounds, best of {args.repeat}; "
          f"prefill (1, 8/2, {args.queries}, {args.keys}, 64), causal")
    base = np.array(times["float32"])
    for label, seconds in times.items():
        ratio = np.array(seconds) / base
        print(f"  {label:<12} {np.median(seconds) * 1e3:8.2f} ms  / float32: {np.median(ratio):.2f} "
              f"({ratio.min():.2f}-{ratio.max():.2f})")


if __name__ == "__main__":
    main()
