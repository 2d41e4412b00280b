"""How long a new user's ``elastic-np check --quick`` takes: in a fresh Numba cache, and again on the filled cache.

Each round makes a new, empty cache (``NUMBA_CACHE_DIR``), runs ``python -m
elastic_np check --quick`` in a new process (it compiles every kernel the
battery runs), then runs it again in another process that loads them from
that cache. It prints the wall seconds of both per round, and the CPU
seconds of the processes (the check's and the one compiling float64 beside
it: the fairer figure on a loaded machine), and their median and range, and
the machine's load average after each round;
``--json PATH`` writes them to a results file (``benchmarks/_record.py``).
The time of ``pip install .`` is not included.

Usage: ``python benchmarks/first_check.py [--rounds R] [--json PATH]``
"""

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

import _record


def _children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_check(cache):
    """Wall and CPU seconds of one ``elastic-np check --quick`` in a new process, Numba's cache in ``cache``."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    start, start_cpu = time.perf_counter(), _children_cpu()
    subprocess.run([sys.executable, "-m", "elastic_np", "check", "--quick"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start, _children_cpu() - start_cpu


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write every round's seconds and their medians here")
    args = parser.parse_args(argv)
    seconds = {"fresh cache": [], "filled cache": [], "fresh cache cpu": [], "filled cache cpu": []}
    load = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            for name in ("fresh cache", "filled cache"):
                wall, cpu = timed_check(cache)
                seconds[name].append(wall)
                seconds[f"{name} cpu"].append(cpu)
        load.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + ", ".join(f"{name} {values[-1]:.1f} s" for name, values in seconds.items()),
              flush=True)
    figures = {name: _record.summary(values) for name, values in seconds.items()}
    for name, figure in figures.items():
        print(f"{name}: median {figure['median']:.1f} s ({figure['min']:.1f}-{figure['max']:.1f}) "
              f"over {args.rounds} rounds")
    if args.json:
        _record.write(args.json, "benchmarks/first_check.py", argv, figures, seconds=seconds,
                      load_after_each_round=load)


if __name__ == "__main__":
    main()
