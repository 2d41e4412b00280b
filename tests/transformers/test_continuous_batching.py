"""elastic_np in transformers' continuous batching (``generate_batch``), through its FlashAttention path.

`register` offers `CONTINUOUS_BATCHING`, a kernel of the ``kernels``
package in this package's folder: the kernel loads through ``kernels`` as a
Hub kernel does, its digest matches its file, and a model made with that
name gives, in ``generate_batch``, the greedy tokens of transformers' own
``"paged|eager"`` (the tiny Llama, and Gemma-2 with its soft-cap and
window), chunked prefills included; plain
``generate`` with padding gives eager's tokens; a bfloat16 model's attention
calls hold bfloat16's error against the float64 oracle on their own inputs.
"""

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")

from transformers_models import CONFIGS  # noqa: E402  (registers elastic_np with transformers)

import elastic_np.transformers as enp_transformers  # noqa: E402
from elastic_np import torch as enpt  # noqa: E402

BUILD = enp_transformers.KERNEL_PATH / "torch-universal"


def test_the_kernel_build_matches_its_digest():
    from kernels._rust import Digest, DigestAlgorithm

    recorded = json.loads((BUILD / "metadata.json").read_text())["digest"]
    files = Digest.hash_variant(DigestAlgorithm.SHA256, BUILD).files
    assert recorded["files"] == files, f"update metadata.json's digest to {files}"


def test_register_offers_the_kernel_and_keeps_other_overrides(monkeypatch):
    monkeypatch.setenv("LOCAL_KERNELS", f"someone/kernel=/x:{enp_transformers.CONTINUOUS_BATCHING}=/old")
    enp_transformers.register()
    assert os.environ["LOCAL_KERNELS"] == (f"someone/kernel=/x:{enp_transformers.CONTINUOUS_BATCHING}="
                                           f"{enp_transformers.KERNEL_PATH}")
    kernel = kernels.get_kernel(enp_transformers.CONTINUOUS_BATCHING, version=1)
    from elastic_np.transformers import flash

    for name in flash.__all__:
        assert getattr(kernel, name) is getattr(flash, name)


def _models(name, *implementations, dtype=torch.float32):
    torch.manual_seed(0)
    built = []
    for implementation in implementations:
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation=implementation)
        if built:
            model.load_state_dict(built[0].state_dict())
        built.append(model.to(dtype).eval())
    return built


def _generate_batch(model, prompts, tokens=8):
    generation = transformers.GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1,
                                               pad_token_id=0)
    cache = transformers.ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=48)
    with torch.no_grad():
        out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=cache)
    return [out[key].generated_tokens for key in sorted(out, key=lambda key: int(key.split("_")[-1]))]


PROMPTS = [[5, 9, 2], [int(t) for t in torch.randint(1, 96, (70,), generator=torch.Generator().manual_seed(4))],
           [7] * 20, [11, 3, 40, 8, 1, 60, 22, 5, 9]]


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_generate_batch_gives_the_tokens_of_paged_eager(name):
    """The 70-token prompt over ``max_batch_tokens=48``: a prefill in chunks, the second over a cached prefix."""
    ours, eager = _models(name, enp_transformers.CONTINUOUS_BATCHING, "paged|eager")
    assert _generate_batch(ours, PROMPTS) == _generate_batch(eager, PROMPTS)


def test_a_model_that_lists_its_flash_kernels_takes_its_own():
    """gpt-oss names the FlashAttention kernels it runs with (its sinks): transformers puts its first in the place
    of any other flash name, ours included, and would download it."""
    assert transformers.GptOssForCausalLM._compatible_flash_implementations[0] == "kernels-community/vllm-flash-attn3"


@pytest.mark.parametrize("padded", [False, True])
def test_generate_gives_eager_tokens(padded):
    """FlashAttention's paths of ``generate``: ``flash_attn_func`` without padding; with left padding, the batch
    unpadded into packed sequences (``flash_attn_varlen_func``) at every step."""
    ours, eager = _models("llama", enp_transformers.CONTINUOUS_BATCHING, "eager")
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
    with torch.no_grad():
        tokens = [model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
                  for model in (ours, eager)]
    assert torch.equal(tokens[0], tokens[1])


def test_a_bfloat16_model_runs_the_kernels_within_bfloat16s_error(monkeypatch):
    """Each call checked as it returns: transformers reuses its batch's tensors from step to step."""
    errors, varlen = [], enpt.varlen_attention

    def checked(q, k, v, *args, **kwargs):
        out = varlen(q, k, v, *args, **kwargs)
        assert q.dtype == k.dtype == out.dtype == torch.bfloat16
        exact = varlen(q.double(), k.double(), v.double(), *args, **kwargs)
        errors.append(float((out.double() - exact).abs().max()) / float(exact.abs().max()))
        return out

    monkeypatch.setattr(enpt, "varlen_attention", checked)
    (model,) = _models("llama", enp_transformers.CONTINUOUS_BATCHING, dtype=torch.bfloat16)
    tokens = _generate_batch(model, PROMPTS[:2], tokens=4)
    assert [len(t) for t in tokens] == [4, 4] and errors
    assert max(errors) <= 4 * 2.0 ** -8, errors
