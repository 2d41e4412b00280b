"""The score-modifier benchmark for two source trees of elastic_np, side by side in one run.

One warm worker process per tree (``PYTHONPATH=TREE``) builds the cases of
``score_modifiers.make_cases`` and two decoding calls, 1 and 16 new queries
per sequence against a long cache (`decode_cases`; fixed seeds: the same
work in both); the
driver then asks the workers in turn, case by case and round by round, for
the best of ``--repeat`` calls, so that both trees see the same load.
Printed per case: each tree's median time and ratio to its own plain
attention, and the ratio of the second tree's time to the first's, per round.

Usage: ``python benchmarks/compare_trees.py BEFORE_TREE AFTER_TREE [--rounds R] [--cases SUBSTRING ...]``
(the trees are directories holding the ``elastic_np`` package).
"""

import argparse
import functools
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def decode_cases(dtype):
    """Decoding calls, ``cases[(name, "fwd")]``: 1 and 16 queries, (4, 32/8, 16384, 128) K/V.

    The arrays (over 0.5 GB in float32) are drawn on a case's first call, so a
    run that selects no decoding case never allocates them.
    """
    import elastic_np as enp

    @functools.cache
    def cache():
        rng = np.random.default_rng(3)
        return tuple(rng.standard_normal((4, 8, 16384, 128)).astype(dtype) for _ in range(2))

    @functools.cache
    def inputs(n):
        return (np.random.default_rng(4 + n).standard_normal((4, 32, n, 128)).astype(dtype), *cache())

    return {
        (f"decode {n} quer{'y' if n == 1 else 'ies'}", "fwd"): (
            lambda n=n: enp.attention(*inputs(n), causal=True, backend="cpu")
        )
        for n in (1, 16)
    }


def worker(argv):
    """Serve ``["time", name, pass, repeat]`` requests on stdin, one JSON line each."""
    sys.path.insert(0, HERE)
    import elastic_np
    import score_modifiers
    try:
        import elastic_np.cli._bench as _bench
    except ImportError:  # a tree from before the tools moved to elastic_np.cli
        from elastic_np import _bench

    n, heads, dtype, backward = int(argv[0]), int(argv[1]), argv[2], argv[3] == "1"
    _, _, cases = score_modifiers.make_cases(n, heads, 64, dtype, backward=backward)
    cases.update(decode_cases(dtype))
    print(json.dumps({"file": elastic_np.__file__, "cases": [list(k) for k in cases]}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        fn = cases[tuple(request["case"])]
        if request.get("warm"):
            fn()
            print(json.dumps({"ok": True}), flush=True)
        else:
            print(json.dumps({"t": _bench.best_time(fn, repeat=request["repeat"])}), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--cases", nargs="*", default=None, help="variant names containing any of these (plain always)")
    args = parser.parse_args(argv)

    workers = []
    for tree in (args.before, args.after):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", str(args.n), str(args.heads),
             args.dtype, "0" if args.no_backward else "1"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree,
        )
        workers.append(proc)
    hello = [json.loads(w.stdout.readline()) for w in workers]
    for tree, h in zip((args.before, args.after), hello):
        print(f"{tree}: {h['file']}")
    keys = [tuple(k) for k in hello[0]["cases"]]
    if args.cases is not None:
        keys = [k for k in keys if k[0] == "plain" or any(s in k[0] for s in args.cases)]

    def ask(w, request):
        w.stdin.write(json.dumps(request) + "\n")
        w.stdin.flush()
        return json.loads(w.stdout.readline())

    for key in keys:  # compile and warm up
        for w in workers:
            ask(w, {"case": key, "warm": True})
    times = {key: ([], []) for key in keys}
    for r in range(args.rounds):
        for key in keys:
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for i in order:
                times[key][i].append(ask(workers[i], {"case": key, "repeat": args.repeat})["t"])
    for w in workers:
        w.stdin.close()
        w.wait()

    print(
        f"\nB=1 H={args.heads} N=M={args.n} D=64 {args.dtype}, {args.rounds} rounds, best of {args.repeat}"
    )
    print(f"{'case':<30} {'before s':>9} {'after s':>9} {'before/plain':>13} {'after/plain':>12}  after/before per round")
    for key in keys:
        before, after = (np.array(t) for t in times[key])
        label = f"{key[0]} {key[1]}"
        plain = times.get(("plain", key[1]))
        if plain is not None:
            rb = np.median(before / np.array(plain[0]))
            ra = np.median(after / np.array(plain[1]))
            ratios = f"{rb:>13.3f} {ra:>12.3f}"
        else:
            ratios = f"{'':>13} {'':>12}"
        per_round = " ".join(f"{x:.3f}" for x in after / before)
        print(f"{label:<30} {np.median(before):>9.4f} {np.median(after):>9.4f} {ratios}  {per_round}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
