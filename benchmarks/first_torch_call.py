"""A first call through `elastic_np.torch` in a fresh process, Numba's cache filled: the import and the call.

Each round is a new process that imports torch, then ``elastic_np.torch``,
then calls `elastic_np.torch.attention` on a filled cache (a decode: one
query, 8 over 2 heads, 1,024 keys, D = 64, float32) and times it, then a
second call; with ``--train``, a first forward + backward of 16 queries over
16 keys (causal, 8 heads) follows. A process run before the rounds fills
Numba's cache, so that the rounds load the kernels and compile nothing.
Given several source trees (directories holding the ``elastic_np``
package), the rounds alternate between them. Prints per tree the median
(and range) of each step in seconds; ``--json PATH`` records them
(``benchmarks/_record.py``).

Usage: ``python benchmarks/first_torch_call.py [TREE ...] [--rounds R] [--train] [--json PATH]``
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

#: The timed process: prints a JSON object of seconds.
_PROCESS = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import elastic_np.torch as enpt
t2 = time.perf_counter()
torch.manual_seed(0)
q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 1024, 64), torch.randn(1, 2, 1024, 64)
t3 = time.perf_counter()
enpt.attention(q, k, v)
t4 = time.perf_counter()
enpt.attention(q, k, v)
t5 = time.perf_counter()
times = {"import torch": t1 - t0, "import elastic_np.torch": t2 - t1, "first call": t4 - t3, "second call": t5 - t4}
if sys.argv[1] == "train":
    q, k, v = (torch.randn(1, 8, 16, 64, requires_grad=True) for _ in range(3))
    t6 = time.perf_counter()
    enpt.attention(q, k, v, causal=True).sum().backward()
    times["first forward + backward"] = time.perf_counter() - t6
print(json.dumps(times))
"""


def _run(tree, train):
    """The seconds of one fresh process's steps, importing elastic_np from ``tree`` (None: as installed)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.path.abspath(tree)
    done = subprocess.run([sys.executable, "-c", _PROCESS, "train" if train else "call"], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _label(tree):
    """``tree``'s name in the output: its git commit where it has one (``-dirty`` with changes), else its path."""
    if tree is None:
        return "installed"
    try:
        head = subprocess.run(["git", "-C", tree, "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return tree
    return f"{head} ({tree})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", help="source trees to alternate (default: the installed elastic_np)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train", action="store_true", help="also a first forward + backward")
    parser.add_argument("--json", help="write every round's seconds here")
    args = parser.parse_args(argv)
    trees = args.trees or [None]
    for tree in trees:  # Numba's cache filled: the rounds load, never compile
        _run(tree, args.train)
    rounds = {_label(tree): [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            rounds[_label(tree)].append(_run(tree, args.train))
    figures = {}
    for tree, runs in rounds.items():
        print(f"{tree}: median (range) of {args.rounds} processes, s")
        for step in runs[0]:
            values = [run[step] for run in runs]
            figures[f"{tree}: {step}"] = values
            print(f"  {step:28s} {np.median(values):7.3f} ({min(values):.3f}-{max(values):.3f})")
    if args.json:
        import _record

        _record.write(args.json, "benchmarks/first_torch_call.py", argv,
                      {name: _record.summary(values) for name, values in figures.items()}, rounds=rounds)


if __name__ == "__main__":
    main()
