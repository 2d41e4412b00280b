"""A serving step's paged decoding call, looked up (every layer after the first) against checked in full.

`elastic_np.varlen_attention` over a paged cache (``block_table``,
``seqused_k``), float32, 8 query heads over 2 kv heads, D = 64, pages of 16
keys, one new query per sequence: the call as every layer of a step after
the first makes it (the plan of the step's layout looked up,
`elastic_np._api.paged_plans`), and as the first makes it (checked in full:
the plans cleared as each timed call starts, a dictionary's ``clear``),
interleaved in one process (`call_overhead.timed`). Prints the
median of each round's median in microseconds, and in full / looked up,
median and range.

Usage: ``python benchmarks/paged_step.py [--rounds R] [--calls N] [--sequences S]``
"""

import argparse

import numpy as np

import elastic_np as enp
from elastic_np._api import paged_plans

from call_overhead import timed  # a script beside this one


def make_step(sequences, seed=0):
    """``call()`` of one paged decoding step of ``sequences`` sequences of 37 to 300 keys."""
    rng = np.random.default_rng(seed)
    used = rng.integers(37, 300, sequences)
    pages = -(-used.max() // 16)
    k, v = (rng.standard_normal((sequences * pages, 16, 2, 64), dtype=np.float32) for _ in range(2))
    table = rng.permutation(sequences * pages).astype(np.int32).reshape(sequences, pages)
    q = rng.standard_normal((sequences, 8, 64), dtype=np.float32)
    cu = np.arange(sequences + 1, dtype=np.int32)
    return lambda: enp.varlen_attention(q, k, v, cu, None, block_table=table, seqused_k=used, backend="cpu")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sequences", type=int, default=4)
    args = parser.parse_args(argv)
    call = make_step(args.sequences)
    call()
    call()  # the plan made, its kernels' entry points found
    def in_full():
        paged_plans.PLANS.clear()
        call()

    full, looked = [], []
    for _ in range(args.rounds):
        full.append(timed(in_full, args.calls))
        looked.append(timed(call, args.calls))
    ratio = np.array(full) / np.array(looked)
    print(f"paged decoding step, {args.sequences} sequences: in full {np.median(full):.1f} us, looked up "
          f"{np.median(looked):.1f} us; in full / looked up {np.median(ratio):.2f} "
          f"({ratio.min():.2f}-{ratio.max():.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
