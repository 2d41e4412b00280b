"""The kernels' thread pool against a plain ``ThreadPoolExecutor`` hand-off, in one process.

The executor is how the kernels ran their parts until 2026-11-28: every
part submitted to it, the calling thread waiting on the futures. Both run
the same kernels (each kernel module's ``run_tasks`` is switched before
each call): decode calls (bfloat16 over ``--keys`` keys, float32 over the
last), a causal prefill forward and a backward, each case's two timed side
by side (best of ``--repeat``, their order alternating, ``--rounds``
rounds). With ``--gap`` seconds of busy Python before every call (not
timed), as a model's other work would leave between attention calls, the
pool's worker has gone to sleep when a call comes (``THREAD_SPIN_SECONDS``
is 0.3 ms), and the median of the calls is taken instead.
Printed per case: median times, executor / pool, median and range.

Usage: ``python benchmarks/thread_pool.py [--rounds R] [--repeat N] [--gap S] [--keys M ...] [--threads T]``
"""

import argparse
import concurrent.futures
import time

import ml_dtypes
import numpy as np

import elastic_np as enp
from elastic_np.cli import _bench
from elastic_np.cpu._decode import decode as _decode
from elastic_np.cpu._prefill import backward as _backward, forward as _forward
from elastic_np.cpu._runtime import config as _config, threads as _threads

_KERNEL_MODULES = (_decode, _forward, _backward)


def executor_runner(threads):
    """``run_tasks`` as it was: each part submitted to a ``ThreadPoolExecutor``, the caller waiting."""
    executor = concurrent.futures.ThreadPoolExecutor(threads)

    def run_tasks(kernel, *args, work=None, tasks=None):
        if tasks is not None:
            args = (*args, tasks)
        parts = _threads.thread_count()
        if parts == 1 or (work is not None and work < _config.SERIAL_WORK):
            kernel(*args, 0, 1)
            return
        for future in [executor.submit(kernel, *args, part, parts) for part in range(parts)]:
            future.result()

    return run_tasks


def timed(run_tasks, call, repeat, gap):
    """Seconds of ``call`` with the kernels on ``run_tasks``: the best of ``repeat`` calls, or with a ``gap`` of
    busy Python before each (not timed), their median (every call then finds the worker asleep)."""
    for module in _KERNEL_MODULES:
        module.run_tasks = run_tasks
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        while time.perf_counter() - start < gap:
            pass
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds)) if gap else min(seconds)


def make_calls(keys, seed=0):
    """``{case: call}``: decode, prefill and backward calls."""
    rng = np.random.default_rng(seed)

    def arrays(shapes, dtype):
        return [rng.standard_normal(s, dtype=np.float32).astype(dtype) for s in shapes]

    calls = {}
    for M in keys:
        a = arrays(((1, 32, 1, 128), (1, 8, M, 128), (1, 8, M, 128)), ml_dtypes.bfloat16)
        calls[f"decode bfloat16 M={M}"] = lambda a=a: enp.attention(*a, backend="cpu")
    a = arrays(((1, 32, 1, 128), (1, 8, keys[-1], 128), (1, 8, keys[-1], 128)), np.float32)
    calls[f"decode float32 M={keys[-1]}"] = lambda: enp.attention(*a, backend="cpu")
    p = arrays(((1, 8, 1024, 64),) * 3, np.float32)
    calls["prefill (1, 8, 1024, 64)"] = lambda: enp.attention(*p, backend="cpu", causal=True)
    b = arrays(((1, 8, 256, 64),) * 4, np.float32)
    out, lse = enp.attention(*b[:3], backend="cpu", causal=True, return_lse=True)
    calls["backward (1, 8, 256, 64)"] = lambda: enp.attention_backward(b[3], *b[:3], out, lse, backend="cpu",
                                                                       causal=True)
    return calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--gap", type=float, default=0.0)
    parser.add_argument("--keys", type=int, nargs="+", default=[512, 1024, 2048, 8192])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    with _bench.thread_counts(args.threads) as counts:
        runners = {"executor": executor_runner(args.threads), "pool": _threads.run_tasks}
        calls = make_calls(args.keys)
        times = {case: {label: [] for label in runners} for case in calls}
        try:
            for call in calls.values():
                for run in runners.values():
                    timed(run, call, 2, 0.0)  # compiled, warm
            for r in range(args.rounds):
                for case, call in calls.items():
                    for label in list(runners) if r % 2 == 0 else list(runners)[::-1]:
                        times[case][label].append(timed(runners[label], call, args.repeat, args.gap))
        finally:
            for module in _KERNEL_MODULES:
                module.run_tasks = _threads.run_tasks
    print(f"{_bench.describe_threads(counts)}; {args.gap * 1e3:g} ms of Python before each call; "
          f"{args.rounds} rounds, {'median' if args.gap else 'best'} of {args.repeat}")
    print(f"{'case':26s} {'executor ms':>11} {'pool ms':>8}  executor/pool")
    for case, by_label in times.items():
        e, p = np.array(by_label["executor"]), np.array(by_label["pool"])
        ratio = e / p
        print(f"{case:26s} {np.median(e) * 1e3:>11.3f} {np.median(p) * 1e3:>8.3f}  "
              f"{np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})")


if __name__ == "__main__":
    main()
