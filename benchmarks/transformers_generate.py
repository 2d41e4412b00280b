"""Greedy generation with a tiny Llama in transformers: ``attn_implementation="elastic_np"`` against ``"sdpa"``.

The fixed cost of a call decides this: a tiny model's every layer of every
step is a small call. A Llama built from a config with random weights (2
layers, 8 query heads over 2 key/value heads, head dim 64, float32)
generates ``--tokens`` tokens greedily from a ``--prompt``-token prompt,
after a warm-up generation; the two implementations alternate round by
round in one process. Prints each one's median seconds and SDPA's time /
ours per round (above 1: ours is faster), median and range.

``--per-call`` also times each attention call inside the model (a timer
around each implementation's function, as transformers' registry holds
it): the median microseconds a call, and the calls' share of a generation.

Usage: ``python benchmarks/transformers_generate.py [--rounds R] [--tokens T] [--prompt P] [--per-call]
[--json PATH]``
"""

import argparse
import contextlib
import time

import numpy as np
import torch
import transformers

import elastic_np.transformers as enp_transformers


def tiny_llama():
    """The model, random weights from a fixed seed."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(config).eval()


def generate(model, implementation, prompt, tokens):
    """Seconds of one greedy generation of ``tokens`` tokens, and the tokens."""
    model.set_attn_implementation(implementation)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return time.perf_counter() - start, out


@contextlib.contextmanager
def timed_calls(ways):
    """``{way: [seconds of each attention call]}``, filled while the block runs (the registry restored after)."""
    registry = transformers.AttentionInterface._global_mapping
    kept = {way: registry[way] for way in ways}
    calls = {way: [] for way in ways}

    def timed(way, attend):
        def call(*args, **kwargs):
            start = time.perf_counter()
            result = attend(*args, **kwargs)
            calls[way].append(time.perf_counter() - start)
            return result
        return call

    for way in ways:
        transformers.AttentionInterface.register(way, timed(way, kept[way]))
    try:
        yield calls
    finally:
        for way in ways:
            transformers.AttentionInterface.register(way, kept[way])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--per-call", action="store_true", help="time each attention call inside the model")
    parser.add_argument("--json", help="write the record here (benchmarks/_record.py)")
    args = parser.parse_args(argv)
    enp_transformers.register()
    model = tiny_llama()
    prompt = torch.randint(0, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    ways = ("elastic_np", "sdpa")
    for way in ways:  # warm-up: compile, fill the caches
        generate(model, way, prompt, args.tokens)
    seconds = {way: [] for way in ways}
    with timed_calls(ways) if args.per_call else contextlib.nullcontext() as calls:
        for _ in range(args.rounds):
            for way in ways:
                seconds[way].append(generate(model, way, prompt, args.tokens)[0])
    ratio = np.array(seconds["sdpa"]) / np.array(seconds["elastic_np"])
    for way in ways:
        print(f"{way:12s} {np.median(seconds[way]) * 1e3:8.1f} ms for {args.tokens} tokens")
        if calls:
            share = sum(calls[way]) / sum(seconds[way])
            print(f"{'':12s} {np.median(calls[way]) * 1e6:8.1f} us an attention call (median of {len(calls[way])}), "
                  f"{share:.0%} of the generation")
    print(f"sdpa / elastic_np: {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})")
    if args.json:
        import _record

        _record.write(args.json, "benchmarks/transformers_generate.py", argv,
                      {"sdpa/ours": _record.summary(ratio), **{f"{w} seconds": _record.summary(seconds[w])
                                                               for w in ways}}, seconds=seconds, measured=_record.measured())


if __name__ == "__main__":
    main()
