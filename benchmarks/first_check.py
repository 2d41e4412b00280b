"""How long a new user's ``elastic-np check --quick`` takes: in a fresh Numba cache, and again on the filled cache.

Each round makes a new, empty cache (``NUMBA_CACHE_DIR``), runs ``python -m
elastic_np check --quick`` in a new process (it compiles every kernel the
battery runs), then runs it again in another process that loads them from
that cache. It prints the wall seconds of both per round and their median
and range; ``--json PATH`` writes them to a results file
(``benchmarks/_record.py``). The time of ``pip install .`` is not included.

Usage: ``python benchmarks/first_check.py [--rounds R] [--json PATH]``
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import _record


def timed_check(cache):
    """Wall seconds of one ``elastic-np check --quick`` in a new process with Numba's cache in ``cache``."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "elastic_np", "check", "--quick"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write every round's seconds and their medians here")
    args = parser.parse_args(argv)
    seconds = {"fresh cache": [], "filled cache": []}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            seconds["fresh cache"].append(timed_check(cache))
            seconds["filled cache"].append(timed_check(cache))
        print(f"round {r + 1}: fresh cache {seconds['fresh cache'][-1]:.1f} s, "
              f"filled cache {seconds['filled cache'][-1]:.1f} s", flush=True)
    figures = {name: _record.summary(values) for name, values in seconds.items()}
    for name, figure in figures.items():
        print(f"{name}: median {figure['median']:.1f} s ({figure['min']:.1f}-{figure['max']:.1f}) "
              f"over {args.rounds} rounds")
    if args.json:
        _record.write(args.json, "benchmarks/first_check.py", argv, figures, seconds=seconds)


if __name__ == "__main__":
    main()
