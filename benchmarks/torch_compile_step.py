"""A training step of a layer using elastic_np.torch, compiled (fullgraph) against eager, side by side.

The layer projects ``x`` to ``q, k, v`` in FlashAttention's layout, runs
`elastic_np.torch.ElasticAttention` (learned ``tau`` and sink, causal) and
projects back; a step is its forward and backward. Both versions run in this
process over interleaved rounds; printed: each one's median step time and the
compiled/eager ratio per round (median and range); with ``--json PATH``
also a results file of them (``benchmarks/_record.py``).

Usage: ``python benchmarks/torch_compile_step.py [--seq N] [--rounds R] [--steps S] [--json PATH]``
"""

import argparse
import time

import numpy as np
import torch

import _record
import elastic_np.torch as enpt


class Layer(torch.nn.Module):
    def __init__(self, heads, dim):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)
        self.out = torch.nn.Linear(heads * dim, heads * dim)
        self.attn = enpt.ElasticAttention(heads, causal=True, learn_tau=True, beta=1.0, learn_beta=True)

    def forward(self, x):
        B, N, _ = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, self.dim).unbind(2)
        y = self.attn(q, k, v, layout="bnhd")
        return self.out(y.reshape(B, N, -1)).square().mean()


def step_time(model, x, steps):
    start = time.perf_counter()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        model(x).backward()
    return (time.perf_counter() - start) / steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="write the step times and their ratio here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    layer = Layer(8, 64)
    x = torch.randn(1, args.seq, 8 * 64)
    compiled = torch.compile(layer, fullgraph=True)
    for model in (layer, compiled):  # compile, and the kernels' first calls
        step_time(model, x, 1)
    times = {"eager": [], "compiled": []}
    for r in range(args.rounds):
        for name, model in (("eager", layer), ("compiled", compiled))[:: 1 if r % 2 == 0 else -1]:
            times[name].append(step_time(model, x, args.steps))
    ratio = np.array(times["compiled"]) / np.array(times["eager"])
    print(f"step (1, {args.seq}, 8 heads x 64), {torch.get_num_threads()} torch threads, "
          f"{args.rounds} rounds of {args.steps} steps")
    for name, t in times.items():
        print(f"  {name:<9} {1e3 * np.median(t):8.2f} ms")
    print(f"  compiled / eager: {np.median(ratio):.3f} [{ratio.min():.3f}-{ratio.max():.3f}]")
    if args.json:
        figures = {"compiled/eager": _record.summary(ratio),
                   **{f"{name} step seconds": _record.summary(t) for name, t in times.items()}}
        _record.write(args.json, "benchmarks/torch_compile_step.py", argv, figures,
                      shape={"B": 1, "N": args.seq, "H": 8, "D": 64}, rounds=args.rounds, steps=args.steps,
                      torch_threads=torch.get_num_threads(), seconds=times)


if __name__ == "__main__":
    main()
