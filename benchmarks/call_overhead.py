"""The fixed cost of a small call: `elastic_np.attention`, `elastic_np.torch.attention` and torch's SDPA.

The calls of the fixed-cost issue, float32, B = 1, timed side by side in one
process over interleaved rounds (each round: every call ``--calls`` times in
a row, the median kept): a 64-key and a 1,024-key decode (8 query heads over
2 kv heads, D = 64), 16 queries over 16 keys causal (forward, and forward +
backward), and a 4,096-key decode (32 over 8 heads, D = 128). Prints per
call the median over the rounds of each way's median, in microseconds, and
SDPA's time / ours (above 1: ours is faster), median and range. Beside a
forward + backward, "floor" times an ``autograd.Function`` shaped like the
torch operator's short way that computes nothing (`autograd_floor`): what a
step through autograd costs before any attention.

Usage: ``python benchmarks/call_overhead.py [--rounds R] [--calls N] [--threads T] [--only TEXT] [--json PATH]``
"""

import argparse
import time

import numpy as np

import elastic_np as enp

#: ``name: (H, Hkv, N, M, D, causal, backward)``.
CASES = {
    "decode, 8/2 heads, 64 keys": (8, 2, 1, 64, 64, False, False),
    "decode, 8/2 heads, 1,024 keys": (8, 2, 1, 1024, 64, False, False),
    "16 x 16 causal": (8, 8, 16, 16, 64, True, False),
    "16 x 16 causal, fwd + bwd": (8, 8, 16, 16, 64, True, True),
    "decode, 32/8 heads, 4,096 keys, D=128": (32, 8, 1, 4096, 128, False, False),
}


def calls(case, torch):
    """``{"numpy" | "torch op" | "sdpa": callable}`` for one case (torch's only with ``torch``)."""
    H, Hkv, N, M, D, causal, backward = case
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, H, N, D)).astype(np.float32)
    k, v = (rng.standard_normal((1, Hkv, M, D)).astype(np.float32) for _ in range(2))
    dout = np.ones_like(q)

    def numpy_call():
        out, lse = enp.attention(q, k, v, causal=causal, return_lse=True, backend="cpu")
        if backward:
            enp.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="cpu")

    ways = {"numpy": numpy_call}
    if torch is None:
        return ways
    import elastic_np.torch as enpt

    qt, kt, vt = (torch.from_numpy(a).requires_grad_(backward) for a in (q, k, v))
    doutt = torch.from_numpy(dout)

    def torch_call(attend):
        def call():
            if backward:
                for t in (qt, kt, vt):
                    t.grad = None
                attend().backward(doutt)
            else:
                with torch.no_grad():
                    attend()
        return call

    ways["torch op"] = torch_call(lambda: enpt.attention(qt, kt, vt, causal=causal, backend="cpu"))
    ways["sdpa"] = torch_call(lambda: torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, is_causal=causal, enable_gqa=H != Hkv))
    if backward:
        floor = autograd_floor(torch, (q, np.zeros((1, H, N), np.float32)), (q, k, v))
        ways["floor"] = torch_call(lambda: floor.apply(qt, kt, vt, None)[0])
    return ways


def autograd_floor(torch, outputs, grads):
    """An ``autograd.Function`` shaped like the short way's (`elastic_np.torch._fast._Trained`) that computes
    nothing: the inputs' NumPy views, ``(out, lse)`` from NumPy arrays, five saved tensors, the gradients from NumPy
    arrays. What autograd and the tensors' handling cost a forward + backward with no attention in it."""

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, call):
            q.detach().numpy(), k.detach().numpy(), v.detach().numpy()
            out, lse = (torch.from_numpy(a) for a in outputs)
            ctx.set_materialize_grads(False)
            ctx.call = call
            ctx.save_for_backward(q, k, v, out, lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            for x in (dout, *ctx.saved_tensors):
                x.detach().numpy()
            return (*(torch.from_numpy(g) for g in grads), None)

    return Floor


def timed(call, n):
    """The median of ``n`` timed calls, in microseconds."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's threads (default: ours, NUMBA_NUM_THREADS; numba.set_num_threads would start "
                             "Numba's OpenMP layer beside torch's, which slows torch)")
    parser.add_argument("--only", default="", help="the cases whose name holds this text")
    parser.add_argument("--no-torch", action="store_true", help="time the NumPy calls only")
    parser.add_argument("--json", help="write every round's medians here")
    args = parser.parse_args(argv)
    from elastic_np.cpu import thread_count

    threads = args.threads or thread_count()
    torch = None
    if not args.no_torch:
        import torch
        torch.set_num_threads(threads)
    cases = {name: calls(case, torch) for name, case in CASES.items() if args.only in name}
    for ways in cases.values():  # compile, warm the allocators
        for call in ways.values():
            timed(call, 5)
    rounds = {name: {way: [] for way in ways} for name, ways in cases.items()}
    for _ in range(args.rounds):
        for name, ways in cases.items():
            for way, call in ways.items():
                rounds[name][way].append(timed(call, args.calls))
    if args.json:
        import _record

        figures = {f"{name}: {way} us": _record.summary(times) for name, ways in rounds.items()
                   for way, times in ways.items()}
        _record.write(args.json, "benchmarks/call_overhead.py", argv, figures, rounds=rounds, threads=threads,
                      ours=thread_count(), calls=args.calls, measured=_record.measured())
    print(f"float32, B = 1, {thread_count()} threads (torch's: {threads}); medians over {args.rounds} rounds of {args.calls} calls, us")
    print(f"{'call':40s} {'numpy':>8} {'torch op':>9} {'sdpa':>8} {'floor':>8}  sdpa / torch op")
    for name, times in rounds.items():
        row = [f"{np.median(times[way]):8.1f}" if way in times else f"{'-':>8}"
               for way in ("numpy", "torch op", "sdpa", "floor")]
        ratio = ""
        if "sdpa" in times:
            r = np.array(times["sdpa"]) / np.array(times["torch op"])
            ratio = f"{np.median(r):.2f} ({r.min():.2f}-{r.max():.2f})"
        print(f"{name:40s} {row[0]} {row[1]:>9} {row[2]} {row[3]}  {ratio}")


if __name__ == "__main__":
    main()
