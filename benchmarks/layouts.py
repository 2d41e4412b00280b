"""The CPU kernels on ``(B, N, H, D)`` inputs, read in place, against the same values ``(B, H, N, D)``, in one process.

``bnhd`` inputs are the ``transpose(0, 2, 1, 3)`` views of C-contiguous
``(B, N, H, D)`` arrays (FlashAttention's layout), ``bhnd`` inputs
C-contiguous ``(B, H, N, D)`` arrays holding the same values. Cases: a prefill
forward and its backward (``(1, H, N, N, D)``) and a decode call (one query,
``(1, 32, 1, M, 128)`` with 8 key/value heads). Each round times both layouts
(best of ``--repeat`` calls), in alternating order; printed per case: each
layout's median time and the ratio bnhd / bhnd of every round, with its
median and range.

Usage: ``python benchmarks/layouts.py [--rounds R] [--repeat N] [--n N] [--heads H] [--dim D] [--cache M] [--dtype float32]``
"""

import argparse

import numpy as np

import elastic_np as enp
from elastic_np.cli import _bench

LAYOUTS = ("bhnd", "bnhd")


def bnhd(a):
    """``a``'s values as the ``(B, H, N, D)`` view of a C-contiguous ``(B, N, H, D)`` array."""
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def make_cases(n, heads, dim, cache, dtype):
    """``{(case, layout): fn}``: the calls to time, the same values in both layouts."""
    q, k, v = _bench.make_inputs(1, heads, n, n, dim, dtype=dtype)
    dout = np.random.default_rng(1).standard_normal(q.shape).astype(dtype)
    decode = _bench.make_inputs(1, 32, 1, cache, 128, Hkv=8, dtype=dtype, seed=2)
    cases = {}
    for layout in LAYOUTS:
        lay = bnhd if layout == "bnhd" else np.ascontiguousarray
        pq, pk, pv, pdout = (lay(a) for a in (q, k, v, dout))
        out, lse = enp.attention(pq, pk, pv, return_lse=True, backend="cpu")  # out in q's layout
        dq, dk, dv = (lay(a) for a in decode)
        cases["prefill fwd", layout] = lambda a=(pq, pk, pv): enp.attention(*a, backend="cpu")
        cases["prefill bwd", layout] = lambda a=(pdout, pq, pk, pv, out, lse): enp.attention_backward(
            *a, backend="cpu"
        )
        cases["decode fwd", layout] = lambda a=(dq, dk, dv): enp.attention(*a, backend="cpu")
    return cases


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--cache", type=int, default=8192)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    cases = make_cases(args.n, args.heads, args.dim, args.cache, np.dtype(args.dtype))
    names = list(dict.fromkeys(name for name, _ in cases))
    by_name = {name: {layout: cases[name, layout] for layout in LAYOUTS} for name in names}
    times = _bench.interleaved(by_name, args.rounds, args.repeat)
    print(f"prefill (1, {args.heads}, {args.n}, {args.dim}), decode (1, 32/8, 1, {args.cache}, 128), "
          f"{args.dtype}, {args.rounds} rounds, best of {args.repeat}")
    print(f"{'case':<14} {'bhnd s':>9} {'bnhd s':>9}  bnhd/bhnd: median (range) per round")
    for name in names:
        before, after = (np.array(times[name][layout]) for layout in LAYOUTS)
        ratio = after / before
        per_round = " ".join(f"{x:.3f}" for x in ratio)
        print(f"{name:<14} {np.median(before):>9.4f} {np.median(after):>9.4f}  "
              f"{np.median(ratio):.3f} ({ratio.min():.3f}-{ratio.max():.3f})  {per_round}")


if __name__ == "__main__":
    main()
