"""transformers' continuous batching (``generate_batch``): ``elastic_np.transformers.CONTINUOUS_BATCHING`` against ``"sdpa"``.

A Llama built from a config with random weights (2 layers, 32 query heads
over 8 key/value heads, head dim 128, hidden size 256, float32) generates
``--tokens`` tokens greedily for each of ``--requests`` prompts of 5 to 2,000
tokens, in one ``generate_batch`` call; the two implementations alternate
call by call in one process, each with a model of its own (the same weights).

The generation phase is timed from each request's recorded token times
(``record_timestamps``): from the moment the last request got its first token
(every prompt read) to the last token, the tokens generated in between per
second. The whole call (start-up, prefill and generation) is printed as well.
Prints each one's median, the ratio ours / SDPA's tokens a second per round
(above 1: ours is faster), median and range, and whether the greedy tokens
agree.

Usage: ``python benchmarks/transformers_continuous.py [--rounds R] [--requests S] [--tokens T] [--dtype D]
[--json PATH]``
"""

import argparse
import time

import numpy as np
import torch
import transformers

import elastic_np.transformers as enp_transformers

#: Prompt lengths, 5 to 2,000 tokens, the first ``--requests`` of them taken.
PROMPTS = (5, 2000, 100, 700, 37, 1500, 12, 300, 64, 900, 8, 1200, 250, 40, 1800, 500)


def model_for(implementation, dtype):
    """The model, random weights from a fixed seed."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                         dtype=dtype).eval()


def run(model, prompts, tokens):
    """``(seconds of the call, generation-phase tokens a second, {request: tokens})``."""
    generation = transformers.GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1,
                                               pad_token_id=0)
    cache = transformers.ContinuousBatchingConfig(page_size=256, num_blocks=len(prompts) * 10,
                                                  max_batch_tokens=2048, auto_switch_to_flash=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=cache,
                                   record_timestamps=True)
    seconds = time.perf_counter() - start
    stamps = [result.timestamps for result in out.values()]
    read = max(times[0] for times in stamps)
    later = np.sort([t for times in stamps for t in times if t > read])
    rate = (len(later) - 1) / (later[-1] - later[0]) if len(later) > 1 else float("nan")
    return seconds, rate, {name: result.generated_tokens for name, result in out.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", help="write the record here (benchmarks/_record.py)")
    args = parser.parse_args(argv)
    enp_transformers.register()
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in PROMPTS[:args.requests]]
    ways = {"elastic_np": enp_transformers.CONTINUOUS_BATCHING, "sdpa": "sdpa"}
    models = {way: model_for(name, dtype) for way, name in ways.items()}
    tokens = {way: run(models[way], prompts[:2], args.tokens)[2] for way in ways}  # warm-up: compile
    seconds, rates = {way: [] for way in ways}, {way: [] for way in ways}
    for _ in range(args.rounds):
        for way in ways:
            call, rate, tokens[way] = run(models[way], prompts, args.tokens)
            seconds[way].append(call)
            rates[way].append(rate)
    ratio = np.array(rates["elastic_np"]) / np.array(rates["sdpa"])
    for way in ways:
        print(f"{way:12s} {np.median(rates[way]):8.1f} tokens/s generating, {np.median(seconds[way]):6.2f} s a call")
    print(f"elastic_np / sdpa, tokens a second generating: {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})")
    same = tokens["elastic_np"] == tokens["sdpa"]
    print(f"greedy tokens the same as sdpa's: {same}")
    if args.json:
        import _record

        _record.write(args.json, "benchmarks/transformers_continuous.py", argv,
                      {"ours/sdpa tokens per second": _record.summary(ratio), "same tokens": same,
                       **{f"{w} tokens per second": _record.summary(rates[w]) for w in ways},
                       **{f"{w} seconds a call": _record.summary(seconds[w]) for w in ways}},
                      seconds=seconds, measured=_record.measured())


if __name__ == "__main__":
    main()
