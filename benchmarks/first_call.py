"""How long a new user's first calls wait for Numba, and which functions the wait goes to.

Each run is a new process with an empty Numba cache (``NUMBA_CACHE_DIR``, a
fresh temporary directory) that makes the first calls of a new user in
order, float32: a prefill forward (``(1, 4, 256, 64)``, causal), a backward
after it, a decode call (one query against those keys), and with
``--check`` the whole ``elastic-np check --quick``. It prints the seconds of
each step; with ``--breakdown``, also the compile time of each jitted
function, exclusive of the functions it compiled in turn (Numba's event API,
``numba:compile``). Given several source trees (directories holding the
``elastic_np`` package), the runs alternate between them, round by round,
so that each sees the same load.

Usage: ``python benchmarks/first_call.py [TREE ...] [--rounds R] [--check] [--breakdown N]``
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np


class CompileTimes:
    """Seconds each jitted function took to compile, exclusive of what it compiled in turn.

    A `numba.core.event.Listener` of ``numba:compile``; ``seconds`` maps a
    function's qualified name to its total over all its specialisations.
    """

    def __init__(self):
        from numba.core import event

        class Listener(event.Listener):
            def on_start(inner, event):
                self._stack.append([event.data["dispatcher"], time.perf_counter(), 0.0])

            def on_end(inner, event):
                dispatcher, start, nested = self._stack.pop()
                spent = time.perf_counter() - start
                name = getattr(dispatcher, "py_func", dispatcher).__qualname__
                self.seconds[name] += spent - nested
                if self._stack:
                    self._stack[-1][2] += spent

        self._stack = []
        self.seconds = defaultdict(float)
        self.listener = Listener()

    def __enter__(self):
        from numba.core import event

        event.register("numba:compile", self.listener)
        return self

    def __exit__(self, *exc):
        from numba.core import event

        event.unregister("numba:compile", self.listener)


def first_calls(check):
    """The steps of a new user, timed in this process: ``{step: seconds}``."""
    import elastic_np as enp

    steps = {}
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 256, 64)).astype(np.float32) for _ in range(3))

    def timed(name, fn):
        start = time.perf_counter()
        result = fn()
        steps[name] = time.perf_counter() - start
        return result

    out, lse = timed("forward", lambda: enp.attention(q, k, v, causal=True, return_lse=True, backend="cpu"))
    timed("backward", lambda: enp.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True, backend="cpu"))
    timed("decode", lambda: enp.attention(q[:, :, :1], k, v, backend="cpu"))
    if check:
        from elastic_np import cli

        timed("check --quick", lambda: cli.main(["check", "--quick", "--progress-delay", "1e9"]))
    return steps


def worker(check, breakdown):
    """One run (in its own process): print ``{"steps": ..., "compile": ...}`` as JSON."""
    with CompileTimes() as times:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            steps = first_calls(check)
    top = sorted(times.seconds.items(), key=lambda item: -item[1])[:breakdown]
    print(json.dumps({"steps": steps, "compile": top, "total": sum(times.seconds.values())}))


def run(tree, check, breakdown):
    """One fresh-cache run of ``tree`` in a new process: the worker's JSON."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        if tree is not None:
            env["PYTHONPATH"] = os.path.abspath(tree)
        command = [sys.executable, os.path.abspath(__file__), "--worker", str(int(check)), str(breakdown)]
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=True,
                                cwd=tree or os.getcwd())
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", help="source trees to compare (default: the installed package)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--check", action="store_true", help="also time elastic-np check --quick")
    parser.add_argument("--breakdown", type=int, default=0, metavar="N",
                        help="print the N functions that took longest to compile (last round)")
    args = parser.parse_args(argv)
    trees = args.trees or [None]
    results = {tree: [] for tree in trees}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            result = run(tree, args.check, args.breakdown)
            results[tree].append(result)
            steps = "  ".join(f"{name} {s:.2f}" for name, s in result["steps"].items())
            print(f"round {r + 1} {tree or 'installed'}: {steps}  (compile {result['total']:.1f} s)", flush=True)
    for tree, runs in results.items():
        medians = {name: np.median([run["steps"][name] for run in runs]) for name in runs[0]["steps"]}
        print(f"\n{tree or 'installed'}, median of {len(runs)}: "
              + "  ".join(f"{name} {s:.2f} s" for name, s in medians.items()))
        if args.breakdown:
            print("  compile, exclusive (last round):")
            for name, seconds in runs[-1]["compile"]:
                print(f"  {seconds:7.2f} s  {name}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2] == "1", int(sys.argv[3]))
    else:
        main()
