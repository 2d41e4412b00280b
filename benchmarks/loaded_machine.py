"""A training step's attention on a loaded machine: loaded / idle time, elastic_np against torch's SDPA.

Each case is a forward and backward through `elastic_np.torch.attention`
and through ``torch.nn.functional.scaled_dot_product_attention`` (the same
tensors, bfloat16 or float32, causal): of one attention layer, or of a
whole training step of a tiny model whose other layers are PyTorch's. Both
libraries use `elastic_np.cpu.thread_count` threads (``NUMBA_NUM_THREADS``,
by default the cores). Rounds alternate idle and loaded;
in a loaded round ``--load`` other processes keep the cores busy (a Python
loop each, started before the round's calls and stopped after). Within a
round the two libraries alternate, call by call; each round gives each a
median of ``--repeat`` steps. Printed per case and library: the medians of
the idle and loaded rounds, their ratio (loaded / idle), and ours / torch's
ratio, median and range over the rounds' pairs.

Usage: ``python benchmarks/loaded_machine.py [--rounds R] [--repeat N] [--load P] [--only TEXT] [--json PATH]``
"""

import argparse
import json
import multiprocessing
import time

import numpy as np


def _busy(stop):
    while not stop.is_set():
        for _ in range(10_000):
            pass


class Load:
    """``count`` processes, each keeping a core busy while the context is open."""

    def __init__(self, count):
        self.count = count

    def __enter__(self):
        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self.processes = [context.Process(target=_busy, args=(self.stop,), daemon=True) for _ in range(self.count)]
        for p in self.processes:
            p.start()
        time.sleep(0.3)  # every one running before the first call
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.processes:
            p.join()
        time.sleep(1.0)  # the cores idle again: a pool that found its workers late has tried them again


def make_steps(torch, dtype):
    """``{case: {library: step}}``: a forward and backward of one attention layer of a small model."""
    import torch.nn.functional as F

    import elastic_np.torch as enpt

    steps = {}
    for B, H, N, D in ((4, 8, 128, 64), (1, 8, 512, 64)):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, generator=gen).to(dtype).requires_grad_() for _ in range(3))

        def step(attend, q=q, k=k, v=v):
            for t in (q, k, v):
                t.grad = None
            attend(q, k, v).sum().backward()

        steps[f"{str(dtype).split('.')[-1]} {(B, H, N, D)}"] = {
            "elastic_np": lambda step=step: step(lambda q, k, v: enpt.attention(q, k, v, causal=True)),
            "torch": lambda step=step: step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        }
    steps[f"{str(dtype).split('.')[-1]} model"] = {
        "elastic_np": model_step(torch, dtype, lambda q, k, v: enpt.attention(q, k, v, causal=True)),
        "torch": model_step(torch, dtype, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }
    return steps


def model_step(torch, dtype, attend, layers=2, width=128, heads=4, batch=2, length=64, vocab=256):
    """A training step of a tiny causal language model (``layers`` blocks of attention and an MLP)."""
    nn = torch.nn
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.ModuleDict({"qkv": nn.Linear(width, 3 * width), "out": nn.Linear(width, width),
                                          "up": nn.Linear(width, 4 * width), "down": nn.Linear(4 * width, width),
                                          "norm1": nn.LayerNorm(width), "norm2": nn.LayerNorm(width)})
                           for _ in range(layers))
    embed, head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
    model = nn.ModuleList([embed, blocks, head]).to(dtype)
    tokens = torch.randint(0, vocab, (batch, length + 1), generator=torch.Generator().manual_seed(0))

    def step():
        model.zero_grad(set_to_none=True)
        x = embed(tokens[:, :-1])
        for block in blocks:
            q, k, v = block["qkv"](block["norm1"](x)).view(batch, length, 3, heads, -1).permute(2, 0, 3, 1, 4)
            x = x + block["out"](attend(q, k, v).transpose(1, 2).reshape(batch, length, width))
            x = x + block["down"](torch.nn.functional.gelu(block["up"](block["norm2"](x))))
        loss = torch.nn.functional.cross_entropy(head(x).float().view(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()

    return step


def timed_round(steps, repeat):
    """``{case: {library: median seconds}}`` of one round, the libraries alternating call by call."""
    times = {case: {lib: [] for lib in libs} for case, libs in steps.items()}
    for case, libs in steps.items():
        for _ in range(repeat):
            for lib, step in libs.items():
                start = time.perf_counter()
                step()
                times[case][lib].append(time.perf_counter() - start)
    return {case: {lib: float(np.median(t)) for lib, t in libs.items()} for case, libs in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--load", type=int, default=2)
    parser.add_argument("--only", default="", help="the cases whose name holds this text (default: all)")
    parser.add_argument("--json", help="write every round's medians (seconds) here")
    args = parser.parse_args(argv)
    import torch

    from elastic_np import cpu

    threads = cpu.thread_count()  # not set here: numba.set_num_threads would start Numba's own OpenMP threads
    torch.set_num_threads(threads)
    steps = {case: libs for case, libs in {**make_steps(torch, torch.bfloat16), **make_steps(torch, torch.float32)}.items()
             if args.only in case}
    timed_round(steps, 2)  # compiled, warm
    idle, loaded = [], []
    for r in range(args.rounds):
        for is_loaded in ((False, True) if r % 2 == 0 else (True, False)):
            if is_loaded:
                with Load(args.load):
                    loaded.append(timed_round(steps, args.repeat))
            else:
                idle.append(timed_round(steps, args.repeat))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": threads, "load": args.load, "idle": idle, "loaded": loaded}, f, indent=1)
    print(f"{threads} threads, {args.load} busy processes in the loaded rounds, {args.rounds} rounds of "
          f"{args.repeat} steps; medians in ms; loaded / idle per library; ours / torch's")
    print(f"{'case':28s} {'library':10s} {'idle':>8} {'loaded':>8}  loaded/idle")
    for case in steps:
        ratios = {}
        for lib in steps[case]:
            i, l = (np.array([rnd[case][lib] for rnd in rounds]) for rounds in (idle, loaded))
            ratios[lib] = l / i
            print(f"{case:28s} {lib:10s} {np.median(i) * 1e3:8.2f} {np.median(l) * 1e3:8.2f}  "
                  f"{np.median(ratios[lib]):.2f} ({ratios[lib].min():.2f}-{ratios[lib].max():.2f})")
        rel = ratios["elastic_np"] / ratios["torch"]
        print(f"{'':28s} {'ours/torch':10s} {'':8s} {'':8s}  {np.median(rel):.2f} ({rel.min():.2f}-{rel.max():.2f})")


if __name__ == "__main__":
    main()
