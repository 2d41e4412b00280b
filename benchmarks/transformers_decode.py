"""Decoding steps of transformers models through elastic_np against "eager" and "sdpa", side by side.

Two tiny models built from configs (random weights):

- gpt-oss-style: 32 query heads, 8 key/value heads, head_dim 64, 2 layers
  (one sliding, one full), per-head sinks; a whole decoding step at a
  ``--context``-token cache (12,288 by default), "elastic_np" against "eager"
  (SDPA has no sinks);
- Llama-style: 32/8 heads, head_dim 128, 2 layers, a static (preallocated)
  cache of ``2 * --llama-context`` slots filled to ``--llama-context``
  (8,192): a whole step, and the attention functions of the step alone
  (transformers' registry entries, timed), against "sdpa".

The cache is filled once (by elastic_np's prefill); every timed step starts
from a copy of it, made outside the timing. The implementations alternate
round by round; printed: each one's median and the ratios per round (median
and range).

Usage: ``python benchmarks/transformers_decode.py [--context N] [--llama-context N] [--rounds R]``
"""

import argparse
import copy
import time

import numpy as np
import torch
import transformers

import elastic_np.transformers as enp_transformers


def _model(config, implementation, state=None):
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def _attention_seconds(implementations):
    """Wrap the attention functions of ``implementations`` in transformers' registry to time them.

    Returns ``{implementation: list}``: each call adds its seconds to its list.
    """
    from transformers import AttentionInterface

    spent = {}
    for name in implementations:
        inner = AttentionInterface._global_mapping[name]
        spent[name] = []

        def timed(*args, inner=inner, into=spent[name], **kwargs):
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            into.append(time.perf_counter() - start)
            return result

        AttentionInterface.register(name, timed)
    return spent


def _prefill(model, tokens, cache):
    with torch.no_grad():
        for start in range(0, tokens.shape[1], 2048):  # in pieces: bounded memory
            model(tokens[:, start:start + 2048], past_key_values=cache, use_cache=True)
    return cache


def _step(model, cache, token):
    cache = copy.deepcopy(cache)
    start = time.perf_counter()
    with torch.no_grad():
        model(token, past_key_values=cache, use_cache=True)
    return time.perf_counter() - start


def _compare(models, cache, token, rounds, attention=None):
    times = {name: [] for name in models}
    parts = {name: [] for name in models}
    for r in range(rounds):
        for name, model in list(models.items())[:: 1 if r % 2 == 0 else -1]:
            if attention is not None:
                attention[name].clear()
            times[name].append(_step(model, cache, token))
            if attention is not None:
                parts[name].append(sum(attention[name]))
    return times, parts


def _report(title, times, ours="elastic_np"):
    print(title)
    for name, t in times.items():
        print(f"  {name:<11} {1e3 * np.median(t):9.2f} ms")
    for name, t in times.items():
        if name != ours:
            ratio = np.array(t) / np.array(times[ours])
            print(f"  {name} / {ours}: {np.median(ratio):.2f} [{ratio.min():.2f}-{ratio.max():.2f}]")


def gpt_oss(context, rounds):
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, sliding_window=128, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2 * context)
    torch.manual_seed(0)
    ours = _model(config, "elastic_np")
    eager = _model(config, "eager", ours.state_dict())
    tokens = torch.randint(0, 256, (1, context))
    cache = _prefill(ours, tokens, transformers.DynamicCache(config=config))
    times, _ = _compare({"elastic_np": ours, "eager": eager}, cache, tokens[:, :1], rounds)
    _report(f"gpt-oss-style, 2 layers, 32/8 heads x 64, decoding step at {context} tokens", times)


def llama(context, rounds):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=4 * context)
    torch.manual_seed(0)
    ours = _model(config, "elastic_np")
    sdpa = _model(config, "sdpa", ours.state_dict())
    tokens = torch.randint(0, 256, (1, context))
    cache = transformers.StaticCache(config=config, max_cache_len=2 * context)
    cache = _prefill(ours, tokens, cache)
    attention = _attention_seconds(("elastic_np", "sdpa"))
    times, parts = _compare({"elastic_np": ours, "sdpa": sdpa}, cache, tokens[:, :1], rounds, attention)
    _report(f"Llama-style, 2 layers, 32/8 heads x 128, static cache of {2 * context} slots filled to "
            f"{context}: whole step", times)
    _report("  the step's attention calls", parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=12288)
    parser.add_argument("--llama-context", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    enp_transformers.register()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    gpt_oss(args.context, args.rounds)
    llama(args.llama_context, args.rounds)


if __name__ == "__main__":
    main()
