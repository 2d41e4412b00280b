"""Ctrl-C during a long CPU call: how long until the call raises KeyboardInterrupt.

Each run is a process of its own that compiles (or loads) the kernels on a
small problem, says it is ready, and starts one long call (a float32 causal
prefill forward or a backward of ``(1, 8, N, 64)``, sized to take twice
``--seconds`` seconds); the parent sends it SIGINT, as a terminal's Ctrl-C
does, at a random moment between 1 and ``--seconds`` seconds into the call,
and reads the moment the child's call raised (both on the system's
monotonic clock).
Printed per thread count and call: the runs interrupted out of those run,
and the latency from the signal to the exception, median and maximum.

Usage: ``python benchmarks/interrupts.py [--runs R] [--threads T ...] [--seconds S]``
"""

import argparse
import subprocess
import sys
import textwrap
import time

import numpy as np

_CHILD = """
import signal, sys, time
import numba, numpy as np
import elastic_np as enp

signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, even where the parent ignores SIGINT

threads, kind, N = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
numba.set_num_threads(threads)
rng = np.random.default_rng(0)

def call(N):
    q, k, v, dout = (rng.standard_normal((1, 8, N, 64), dtype=np.float32) for _ in range(4))
    if kind == "forward":
        return lambda: enp.attention(q, k, v, causal=True, backend="cpu")
    zeros = np.zeros_like(q), np.zeros(q.shape[:3], np.float32)
    return lambda: enp.attention_backward(dout, q, k, v, *zeros, causal=True, backend="cpu")

call(300)()
long_call = call(N)
start = time.monotonic()
print("ready", flush=True)
try:
    long_call()
    print("finished", time.monotonic() - start, flush=True)
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), flush=True)
"""


def keys_for(seconds, threads, kind):
    """Keys ``N`` of a call that takes about ``seconds``: timed at a quarter of the length, scaled by N^2."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), str(threads), kind, "8192"],
                         capture_output=True, text=True, check=True).stdout.split()
    return int(8192 * (seconds / float(out[2])) ** 0.5)


def one_run(threads, kind, N, seconds, rng):
    """``(interrupted, latency)`` of one process's call, interrupted at a random moment."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_CHILD), str(threads), kind, str(N)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(rng.uniform(1.0, seconds))
    sent = time.monotonic()
    child.send_signal(subprocess.signal.SIGINT)
    words = child.stdout.read().split()
    child.wait()
    if words[0] != "interrupted":
        print(f"not interrupted: {' '.join(words)}")
        return False, float("nan")
    return True, float(words[1]) - sent


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"SIGINT at a random moment of the first {args.seconds:g} s of a call of about twice that; "
          f"{args.runs} runs each")
    print(f"{'threads':>7} {'call':9s} {'N':>6} {'interrupted':>11} {'median s':>9} {'max s':>7}")
    for threads in args.threads:
        for kind in ("forward", "backward"):
            N = keys_for(2 * args.seconds, threads, kind)
            runs = [one_run(threads, kind, N, args.seconds, rng) for _ in range(args.runs)]
            latency = np.array([seconds for stopped, seconds in runs if stopped])
            print(f"{threads:>7} {kind:9s} {N:>6} {len(latency):>5} of {args.runs:<3} "
                  f"{np.median(latency) if latency.size else float('nan'):9.3f} "
                  f"{latency.max() if latency.size else float('nan'):7.3f}")


if __name__ == "__main__":
    main()
