"""A training step of a transformers model on packed sequences through elastic_np, against the padded batch.

A Llama-style model built from a config (random weights): 8 query heads, 8
key/value heads, head_dim 64, hidden size 512, ``--layers`` layers (2).
Eight sequences whose padded batch is half padding (``--lengths``, by default
1024, 768, 512, 512, 384, 384, 256, 256), one training step each way
(forward, a loss on the logits, backward; float32):

- packed: one row of the tokens with ``DataCollatorWithFlattening``'s
  ``cu_seq_lens`` (transformers' padding-free path), through elastic_np's
  varlen attention;
- padded: the sequences right-padded to the longest with an
  ``attention_mask``, through elastic_np (the kernels under the mask) and
  through "sdpa".

The ways alternate round by round in this process; printed: each one's
median and the ratios per round (median and range).

Usage: ``python benchmarks/transformers_packed.py [--lengths L ...] [--layers N] [--rounds R]``
"""

import argparse
import copy
import time

import numpy as np
import torch
import transformers

import elastic_np.transformers as enp_transformers


def steps(lengths, layers=2, hidden=512, heads=8, vocab=1024, seed=0):
    """``{name: step}``: one training step on the same tokens, packed or padded, each through its model."""
    torch.manual_seed(seed)
    enp_transformers.register()
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=heads, max_position_embeddings=max(lengths))
    models = {}
    for name in ("elastic_np", "sdpa"):
        models[name] = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                                     attn_implementation=name).train()
        if name != "elastic_np":
            models[name].load_state_dict(models["elastic_np"].state_dict())
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
    packed = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": ids.tolist()} for ids in sequences])
    packed.pop("labels")
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for s, seq in enumerate(sequences):
        ids[s, :seq.numel()], mask[s, :seq.numel()] = seq, 1

    def step(model, **batch):
        def run():
            model.zero_grad()
            model(**batch, use_cache=False).logits.float().square().mean().backward()
        return run

    return {
        "packed elastic_np": step(models["elastic_np"], **packed),
        "padded elastic_np": step(models["elastic_np"], input_ids=ids, attention_mask=mask),
        "padded sdpa": step(models["sdpa"], input_ids=ids, attention_mask=mask),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 768, 512, 512, 384, 384, 256, 256])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    cases = steps(args.lengths, layers=args.layers)
    for run in cases.values():
        run()  # compile or load the kernels
    times = {name: [] for name in cases}
    for r in range(args.rounds):
        for name in list(cases)[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - start)
    padding = 1 - sum(args.lengths) / (len(args.lengths) * max(args.lengths))
    print(f"{len(args.lengths)} sequences {args.lengths}, {padding:.0%} padding, Llama-style, {args.layers} layers, "
          f"8 heads x 64, float32, training step, {args.rounds} rounds")
    packed = np.array(times["packed elastic_np"])
    for name, seconds in times.items():
        ratio = np.array(seconds) / packed
        print(f"  {name:<18} {1e3 * np.median(seconds):9.1f} ms   / packed elastic_np {np.median(ratio):.2f} "
              f"[{ratio.min():.2f}-{ratio.max():.2f}]")


if __name__ == "__main__":
    main()
