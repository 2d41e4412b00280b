"""Kernel calls beside PyTorch's OpenMP threads: with and without asking them to let their idle workers go.

PyTorch's libgomp workers spin for a while after each parallel region. A
decode call (``B=1``, 32 query heads on 8 key/value heads, head dim 128,
``--cache`` keys, float32, through `elastic_np.torch`) is timed, together
with the small ``torch.mm`` that follows it (where PyTorch starts its
threads again if they were let go), in two situations:

- ``after torch``: right after a ``torch.mm`` (its workers still spinning),
  as in a model, where the attention follows the projections;
- ``after a gap``: ``--gap`` seconds after it (its workers asleep): what
  asking costs where it cannot help.

In each, with the pool asking (`elastic_np.cpu._runtime.openmp.quiet`, the default)
and with it turned off (``QUIET_OPENMP_WORK = inf``). The four alternate
call by call over ``--rounds`` rounds; printed: the median milliseconds of
each, and off / on per situation, the median and range over the rounds.

Usage: ``python benchmarks/openmp_neighbours.py [--cache M ...] [--rounds R] [--gap S]``
"""

import argparse
import math
import time

import numpy as np
import torch

import elastic_np.torch as enpt
from elastic_np.cpu._runtime import config as _config


def _timed(call, before, gap, quiet):
    before()
    if gap:
        time.sleep(gap)
    saved = _config.QUIET_OPENMP_WORK
    if not quiet:
        _config.QUIET_OPENMP_WORK = math.inf
    try:
        start = time.perf_counter()
        call()
        before()
        return time.perf_counter() - start
    finally:
        _config.QUIET_OPENMP_WORK = saved


def run(cache, rounds, gap):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=gen)
    k, v = (torch.randn(1, 8, cache, 128, generator=gen) for _ in range(2))
    a, b = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)

    def call():
        return enpt.attention(q, k, v)

    def mm():
        return torch.mm(a, b)

    call(), mm()
    cases = [(where, quiet) for where in ("after torch", "after a gap") for quiet in (True, False)]
    times = {case: [] for case in cases}
    for r in range(rounds):
        for where, quiet in cases[:: 1 if r % 2 == 0 else -1]:
            times[where, quiet].append(_timed(call, mm, gap if where == "after a gap" else 0.0, quiet))
    print(f"decode 32/8 heads x 128, {cache} keys, float32 (+ a 256^3 torch.mm after); {torch.get_num_threads()} "
          f"torch threads; {rounds} rounds")
    for where in ("after torch", "after a gap"):
        on, off = np.array(times[where, True]), np.array(times[where, False])
        ratio = off / on
        print(f"  {where:<12} asking {1e3 * np.median(on):7.3f} ms   not asking {1e3 * np.median(off):7.3f} ms   "
              f"not / asking {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--gap", type=float, default=0.03)
    args = parser.parse_args(argv)
    for cache in args.cache:
        run(cache, args.rounds, args.gap)


if __name__ == "__main__":
    main()
