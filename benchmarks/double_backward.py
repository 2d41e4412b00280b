"""A Hessian-vector product with the CPU kernels against a forward and backward, in one process (issue #42).

The HVP is what a second-order step pays: the forward, the backward and the
double backward (`elastic_np.attention_double_backward`, its direction
``(ddq, ddk, ddv)``). The goal of the issue is an HVP at most four times a
forward plus backward, with memory linear in ``N``.

Timing: ``(1, --heads, --n, --dim)`` float32 (2,048 by default, ``--causal``
for the causal case); the forward + backward, the HVP and the double
backward alone, each the best of ``--repeat`` calls per round, over
``--rounds`` rounds in alternating order (`_bench.interleaved`); printed:
each call's median and range, and the ratio HVP / (forward + backward), its
median and range over the rounds. Memory: the peak of one double backward
and of one forward + backward (`_bench.peak_memory_mib`) at each of
``--memory-n`` (1,024, 2,048, 4,096), and per 1,024 queries.

Usage: ``python benchmarks/double_backward.py [--n N] [--heads H] [--dim D] [--causal] [--rounds R]
[--repeat N] [--threads T] [--memory-n N ...]``
"""

import argparse

import numpy as np

import elastic_np as enp
from elastic_np.cli import _bench


def make_calls(n, heads, dim, causal):
    """``{label: fn}``: the forward + backward, the HVP, and the double backward of the same inputs alone."""
    q, k, v = _bench.make_inputs(1, heads, n, n, dim, dtype=np.float32)
    rng = np.random.default_rng(1)
    dout, ddq, ddk, ddv = (rng.standard_normal(a.shape).astype(np.float32) for a in (q, q, k, v))

    def forward_backward():
        out, lse = enp.attention(q, k, v, return_lse=True, causal=causal, backend="cpu")
        return out, lse, enp.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="cpu")

    def double_backward(out, lse):
        return enp.attention_double_backward(ddq, ddk, ddv, dout, q, k, v, out, lse, causal=causal, backend="cpu")

    def hvp():
        out, lse, grads = forward_backward()
        return grads, double_backward(out, lse)

    out, lse = enp.attention(q, k, v, return_lse=True, causal=causal, backend="cpu")
    return {"forward+backward": forward_backward, "hvp": hvp,
            "double backward": lambda: double_backward(out, lse)}


def memory(ns, heads, dim, causal):
    """``{n: (double backward MiB, forward + backward MiB)}``, each call once first (compiled, warm)."""
    peaks = {}
    for n in ns:
        calls = make_calls(n, heads, dim, causal)
        for label in ("double backward", "forward+backward"):
            calls[label]()
        peaks[n] = tuple(_bench.peak_memory_mib(calls[label]) for label in ("double backward", "forward+backward"))
    return peaks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-n", type=int, nargs="*", default=[1024, 2048, 4096])
    args = parser.parse_args(argv)

    with _bench.thread_counts(args.threads) as counts:
        calls = make_calls(args.n, args.heads, args.dim, args.causal)
        times = _bench.interleaved({"hvp": calls}, args.rounds, args.repeat)["hvp"]
        peaks = memory(args.memory_n, args.heads, args.dim, args.causal)
    print(f"(1, {args.heads}, {args.n}, {args.dim}) float32{' causal' if args.causal else ''}; "
          f"{_bench.describe_threads(counts)}; {args.rounds} rounds, best of {args.repeat}")
    for label, seconds in times.items():
        seconds = np.array(seconds) * 1e3
        print(f"  {label:<18} {np.median(seconds):9.1f} ms ({seconds.min():.1f}-{seconds.max():.1f})")
    ratio = np.array(times["hvp"]) / np.array(times["forward+backward"])
    print(f"  hvp / forward+backward: {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f}); goal <= 4")
    print("peak memory, MiB (per 1,024 queries):")
    for n, (second, first) in peaks.items():
        print(f"  N = {n:>6}: double backward {second:8.1f} ({second * 1024 / n:6.1f}), "
              f"forward+backward {first:8.1f} ({first * 1024 / n:6.1f})")


if __name__ == "__main__":
    main()
