"""How long a new user's first calls wait for Numba, and which functions the wait goes to.

Each run is a new process with an empty Numba cache (``NUMBA_CACHE_DIR``, a
fresh temporary directory) that makes the first calls of a new user in
order, float32: a prefill forward (``(1, 4, 256, 64)``, causal), a backward
after it, a decode call (one query against those keys), and with
``--check`` the whole ``elastic-np check --quick``. With ``--after-warmup``,
a process running `elastic_np.warmup` fills the cache first, and the timed
process calls `elastic_np.warmup` (loading every kernel) before its first
calls, as a Docker image's container or a warmed Dask worker does. It prints the seconds of
each step, wall and process CPU time (the fairer figure on a loaded machine);
with ``--breakdown``, also the compile time of each jitted
function, exclusive of the functions it compiled in turn (Numba's event API,
``numba:compile``). Given several source trees (directories holding the
``elastic_np`` package), the runs alternate between them, round by round,
so that each sees the same load; ``--public SETTING`` (repeatable) runs each
tree once per value of ``ELASTIC_NP_PUBLIC_NUMBA`` (``""``: every private
path of ``elastic_np/cpu/_runtime/numba_private.py`` on, ``1``: none, or the names of
those to turn off), alternated the same way. With ``--json PATH``, the seconds of every step
(wall and CPU) of each round, and their median and range per variant, go to a
results file (``benchmarks/_record.py``).

Usage: ``python benchmarks/first_call.py [TREE ...] [--rounds R] [--check] [--after-warmup] [--breakdown N]
[--public SETTING ...] [--json PATH]``
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

import _record


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


def first_calls(check, warm=False):
    """The steps of a new user, timed in this process: ``{step: seconds}`` (after `elastic_np.warmup` if ``warm``)."""
    import elastic_np as enp

    steps, cpu = {}, {}
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 256, 64)).astype(np.float32) for _ in range(3))

    def timed(name, fn):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        steps[name] = time.perf_counter() - start
        cpu[name] = time.process_time() - start_cpu
        return result

    if warm:
        timed("warmup", enp.warmup)
    out, lse = timed("forward", lambda: enp.attention(q, k, v, causal=True, return_lse=True, backend="cpu"))
    timed("backward", lambda: enp.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True, backend="cpu"))
    timed("decode", lambda: enp.attention(q[:, :, :1], k, v, backend="cpu"))
    if check:
        from elastic_np import cli

        timed("check --quick", lambda: cli.main(["check", "--quick", "--progress-delay", "1e9"]))
    return steps, cpu


def worker(check, breakdown, warm):
    """One run (in its own process): print ``{"steps": ..., "compile": ...}`` as JSON."""
    with CompileTimes() as times:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            steps, cpu = first_calls(check, warm)
    top = sorted(times.seconds.items(), key=lambda item: -item[1])[:breakdown]
    print(json.dumps({"steps": steps, "cpu": cpu, "compile": top, "total": sum(times.seconds.values())}))


def run(tree, check, breakdown, public=None, warm=False):
    """One fresh-cache run of ``tree`` (``ELASTIC_NP_PUBLIC_NUMBA=public`` unless None) in a new process: its JSON.

    With ``warm``, another process fills the cache with `elastic_np.warmup` first.
    """
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        if public is not None:
            env["ELASTIC_NP_PUBLIC_NUMBA"] = public
        if tree is not None:
            env["PYTHONPATH"] = os.path.abspath(tree)
        if warm:
            subprocess.run([sys.executable, "-c", "import elastic_np; elastic_np.warmup()"], env=env, check=True,
                           cwd=tree or os.getcwd())
        command = [sys.executable, os.path.abspath(__file__), "--worker", str(int(check)), str(breakdown), str(int(warm))]
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=True,
                                cwd=tree or os.getcwd())
    return json.loads(result.stdout.strip().splitlines()[-1])


def write_json(path, argv, results):
    """Write the results file of ``results`` (label -> its rounds' JSON): each step's median and range."""
    figures = {label: {name: _record.summary([run["steps"][name] for run in runs]) for name in runs[0]["steps"]}
               for label, runs in results.items()}
    _record.write(path, "benchmarks/first_call.py", argv, figures, rounds=results)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", help="source trees to compare (default: the installed package)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--check", action="store_true", help="also time elastic-np check --quick")
    parser.add_argument("--breakdown", type=int, default=0, metavar="N",
                        help="print the N functions that took longest to compile (last round)")
    parser.add_argument("--after-warmup", action="store_true",
                        help="fill the cache with elastic_np.warmup() first; time a warmup() that loads it")
    parser.add_argument("--public", action="append", metavar="SETTING",
                        help="a value of ELASTIC_NP_PUBLIC_NUMBA to run each tree with (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="write every round's seconds and their medians here")
    args = parser.parse_args(argv)
    variants = [(tree, public) for tree in args.trees or [None] for public in args.public or [None]]
    results = {variant: [] for variant in variants}

    def label(variant):
        tree, public = variant
        return (tree or "installed") + ("" if public is None else f" ELASTIC_NP_PUBLIC_NUMBA={public!r}")

    for r in range(args.rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            result = run(variant[0], args.check, args.breakdown, variant[1], args.after_warmup)
            results[variant].append(result)
            steps = "  ".join(f"{name} {s:.3f} (cpu {result['cpu'][name]:.3f})" for name, s in result["steps"].items())
            print(f"round {r + 1} {label(variant)}: {steps}  (compile {result['total']:.1f} s)", flush=True)
    for variant, runs in results.items():
        medians = {name: np.median([run["steps"][name] for run in runs]) for name in runs[0]["steps"]}
        cpu = {name: np.median([run["cpu"][name] for run in runs]) for name in runs[0]["steps"]}
        print(f"\n{label(variant)}, median of {len(runs)}: "
              + "  ".join(f"{name} {s:.3f} s (cpu {cpu[name]:.3f} s)" for name, s in medians.items()))
        if args.breakdown:
            print("  compile, exclusive (last round):")
            for name, seconds in runs[-1]["compile"]:
                print(f"  {seconds:7.2f} s  {name}")
    if args.json:
        write_json(args.json, argv, {label(variant): runs for variant, runs in results.items()})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4] == "1")
    else:
        main()
