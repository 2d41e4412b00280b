"""Tiny transformers models from configs (random weights, nothing downloaded) under each attention, and the rule
they are held to: shared by ``test_transformers`` (float32) and ``test_transformers_halves`` (bfloat16).

Importing this registers elastic_np's attention with transformers, as ``"elastic_np"`` (the CPU kernels) and
``"elastic_np_reference"`` (the float64 oracle). Import it after ``pytest.importorskip("transformers")``.
"""

import copy

import torch
import transformers

import elastic_np.transformers as enp_transformers

enp_transformers.register()
enp_transformers.register("elastic_np_reference", backend="reference")

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2),
    "gemma2": lambda: transformers.Gemma2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, attn_logit_softcapping=20.0,
        final_logit_softcapping=None),
    "gpt_oss": lambda: transformers.GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
        experts_implementation="eager"),  # grouped_mm takes no float64
}


def tiny_models(name, dtype=torch.float32):
    """One set of random weights under each attention: ``eager``, ``elastic_np`` in ``dtype``, and in float64
    ``float64`` (elastic_np's oracle) and ``eager64``."""
    torch.manual_seed(0)
    config = CONFIGS[name]()
    built = {}
    for key, implementation in (("eager", "eager"), ("elastic_np", "elastic_np"),
                                ("float64", "elastic_np_reference"), ("eager64", "eager")):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                              attn_implementation=implementation)
        if built:
            model.load_state_dict(built["eager"].state_dict())
        built[key] = model.to(torch.float64 if key in ("float64", "eager64") else dtype)
    if name == "gpt_oss":  # sinks start at zero: make them differ per head, so their gradient means something
        with torch.no_grad():
            for model in built.values():
                for layer in model.model.layers:
                    layer.self_attn.sinks.copy_(torch.linspace(-1.0, 1.5, layer.self_attn.sinks.numel()))
    return built


def within_the_rule(ours, eager, exact, what, dtype=torch.float32, ulps=8):
    """At most twice eager's error in ``dtype`` (relative, in norm), or ``ulps`` of its epsilon where eager's is below that."""
    exact = exact.detach()
    error, naive = (float((a.detach().double() - exact).norm() / exact.norm()) for a in (ours, eager))
    assert error <= 2 * naive + ulps * torch.finfo(dtype).eps, f"{what}: error {error:.3g}, eager's {naive:.3g}"
