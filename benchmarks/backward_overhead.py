"""The fixed cost of a small backward: the compiled sink gradient and the plan's check of its arrays, on and off.

`elastic_np.attention_backward` of a layout met before runs through its
`elastic_np._api.plans.BackwardPlan`, which checks ``dout``, ``out`` and
``lse`` of its own shapes and dtypes with a few NumPy calls, and the CPU
backward takes ``dbeta`` from a compiled pass (`elastic_np.cpu._prefill.sink`).
This benchmark times the backward (and forward + backward) of small causal
problems, float32, ``B = 1``, with each of the two on and off (off: the
contract's NumPy ``sink_gradient``, and the check a call in full makes),
interleaved round by round in one process. Prints the median over the rounds
of each way's median, and the ratio off / on per round (above 1: on is
faster), median and range.

Usage: ``python benchmarks/backward_overhead.py [--rounds R] [--calls N] [--json PATH]``
"""

import argparse

import numpy as np
from call_overhead import timed

import elastic_np as enp
from elastic_np._api import plans
from elastic_np.cpu._prefill import backward as prefill_backward

#: ``name: (H, N, D)``, causal, ``M = N``.
CASES = {"8 heads, 16 x 16, D = 64": (8, 16, 64), "8 heads, 64 x 64, D = 64": (8, 64, 64)}


def _ways():
    """``{way: (sink_gradient, expected)}``: the functions the backward and its plan use, each way."""
    compiled, checked = prefill_backward.sink_gradient, plans.BackwardPlan._expected
    numpy_sink = lambda problem, delta, lse: problem.sink_gradient(delta, lse)  # noqa: E731
    full_check = lambda *arrays: False  # noqa: E731 (every call checks as one in full)
    return {"on": (compiled, checked), "off": (numpy_sink, full_check)}


def calls(H, N, D):
    """``{"backward": f, "forward + backward": g}`` of one case."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, H, N, D)).astype(np.float32) for _ in range(3))
    dout = np.ones_like(q)
    out, lse = enp.attention(q, k, v, causal=True, return_lse=True, backend="cpu")

    def both():
        o, l = enp.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
        enp.attention_backward(dout, q, k, v, o, l, causal=True, backend="cpu")

    return {"backward": lambda: enp.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cpu"),
            "forward + backward": both}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", help="write every round's medians here")
    args = parser.parse_args(argv)
    ways = _ways()
    rows = {f"{case}: {part}": call for case, shape in CASES.items() for part, call in calls(*shape).items()}
    rounds = {name: {way: [] for way in ways} for name in rows}
    try:
        for _ in range(args.rounds):
            for name, call in rows.items():
                for way, (sink, expected) in ways.items():
                    prefill_backward.sink_gradient, plans.BackwardPlan._expected = sink, expected
                    timed(call, 10)  # the other way's caches out
                    rounds[name][way].append(timed(call, args.calls))
    finally:
        prefill_backward.sink_gradient, plans.BackwardPlan._expected = ways["on"]
    if args.json:
        import _record

        figures = {f"{name}: {way} us": _record.summary(times) for name, by_way in rounds.items()
                   for way, times in by_way.items()}
        for name, by_way in rounds.items():
            figures[f"{name}: off / on"] = _record.summary(np.divide(by_way["off"], by_way["on"]))
        _record.write(args.json, "benchmarks/backward_overhead.py", argv, figures, rounds=rounds,
                      calls=args.calls, measured=_record.measured())
    from elastic_np.cpu import thread_count

    print(f"float32, B = 1, causal, {thread_count()} threads; medians over {args.rounds} rounds of {args.calls} calls, us")
    print(f"{'call':48s} {'off':>8} {'on':>8}  off / on")
    for name, by_way in rounds.items():
        ratio = np.divide(by_way["off"], by_way["on"])
        print(f"{name:48s} {np.median(by_way['off']):8.1f} {np.median(by_way['on']):8.1f}  "
              f"{np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})")


if __name__ == "__main__":
    main()
