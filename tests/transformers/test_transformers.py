"""elastic_np.transformers: tiny models from configs (random weights, nothing downloaded) against "eager".

A Llama-style model (grouped-query heads), a Gemma-2-style one (soft-capping,
sliding windows) and a gpt-oss-style one (per-head sinks, sliding windows):
logits and the gradient of every parameter within the float32 rule (at most
twice the error, relative in norm, of transformers' own eager attention in
float32, or a few float32 ulps where eager is closer than that, both measured
against the model in float64 through elastic_np's float64 oracle. That model
matches eager in float64 to float32 precision, not more: eager's softmax runs
in float32 even there, and a padded row turns into NaN, which reaches the
other rows through their masked keys). Then greedy generation token for
token, with a dynamic and a static cache, and packed sequences (transformers'
padding-free path, ``cu_seq_lens_q``) against each sequence alone.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import elastic_np.transformers as enp_transformers  # noqa: E402
from transformers_models import CONFIGS, tiny_models, within_the_rule  # noqa: E402


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_with_and_without_padding(name):
    models = tiny_models(name)
    ids = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1))
    padding = torch.ones_like(ids)
    padding[1, :6] = 0  # left padding, as batched generation has
    for mask in (None, padding):
        out = {key: model(ids, attention_mask=mask).logits for key, model in models.items()}
        if mask is None:
            torch.testing.assert_close(out["float64"], out["eager64"], rtol=1e-5, atol=1e-6)
        kept = slice(None) if mask is None else mask.bool()
        within_the_rule(out["elastic_np"][kept], out["eager"][kept], out["float64"][kept],
                                 f"{name} logits, mask {mask is not None}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradient_of_every_parameter_sinks_included(name):
    models = tiny_models(name)
    ids = torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(2))
    for model in models.values():
        model.train()
        model(ids, labels=ids).loss.backward()
    named = [dict(model.named_parameters()) for model in (models["elastic_np"], models["eager"], models["float64"])]
    checked = 0
    for pname, p in named[0].items():
        if named[2][pname].grad is None:
            continue
        within_the_rule(p.grad, named[1][pname].grad, named[2][pname].grad, f"{name} d{pname}")
        checked += 1
    assert checked == sum(p.requires_grad for p in named[0].values())
    if name == "gpt_oss":
        assert all(float(layer.self_attn.sinks.grad.abs().max()) > 0 for layer in models["elastic_np"].model.layers)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_gives_the_same_tokens(name, cache, monkeypatch):
    models = tiny_models(name)
    prompt = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(3))
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    calls, attention = [], enp_transformers.enpt.attention

    def recorded(q, k, v, **options):
        calls.append((q.shape[2], k.shape[2], {n for n, x in options.items() if x is not None}))
        return attention(q, k, v, **options)

    monkeypatch.setattr(enp_transformers.enpt, "attention", recorded)
    tokens = [models[key].generate(prompt, max_new_tokens=32, do_sample=False, **extra)
              for key in ("eager", "elastic_np")]
    assert torch.equal(*tokens)
    steps = [(n, m, used) for n, m, used in calls if n == 1]
    assert len(steps) == 31 * models["elastic_np"].config.num_hidden_layers
    if cache == "static" and name == "llama":  # the empty slots of the static cache are never read
        layers = models["elastic_np"].config.num_hidden_layers
        assert all("mask" not in used for _, m, used in steps)
        # kv_lengths until the cache is full (its last step, every slot filled, needs no option)
        assert all("kv_lengths" in used for _, m, used in steps[:-layers])
        assert {m for _, m, _ in steps} == {max(m for _, m, _ in steps)}  # the whole preallocated cache


def test_a_static_cache_decoding_step_reads_only_the_filled_slots():
    mask = torch.zeros(2, 1, 1, 50, dtype=torch.bool)
    mask[0, ..., :17] = True
    mask[1, ..., :30] = True
    options = enp_transformers._mask_options(mask, B=2, N=1, M=50)
    assert options.keys() == {"kv_lengths"} and options["kv_lengths"].tolist() == [17, 30]
    mask[1, ..., 3] = False  # a hole (left padding, a window): the mask itself
    assert enp_transformers._mask_options(mask, B=2, N=1, M=50).keys() == {"mask"}
    mask[:] = True  # every key (a dynamic cache's step): no option, the call of the same problem
    assert enp_transformers._mask_options(mask, B=2, N=1, M=50) == {}
    wrong_batch = torch.ones(3, 1, 1, 50, dtype=torch.bool)  # neither 1 nor B: the mask, which the call rejects
    assert enp_transformers._mask_options(wrong_batch, B=2, N=1, M=50).keys() == {"mask"}


def test_what_the_attention_cannot_honour_is_an_error_naming_it():
    model = tiny_models("llama")["elastic_np"]
    ids = torch.randint(0, 96, (1, 5))
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="attention dropout"):
        model(ids)
    model.eval()
    model(ids)  # dropout is off at evaluation
    with pytest.raises(ValueError, match="output_attentions=True"):
        model(ids, output_attentions=True)
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="both cu_seq_lens_q and cu_seq_lens_k, got no cu_seq_lens_k"):
        enp_transformers.attention_forward(model.model.layers[0].self_attn, q, q, q, None,
                                           cu_seq_lens_q=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="boolean \\(B, 1, N, M\\) mask"):
        enp_transformers.attention_forward(model.model.layers[0].self_attn, q, q, q, torch.zeros(1, 1, 3, 3))
    with pytest.raises(TypeError, match="^elastic_np attention cannot honour head_mask, sinks$"):  # sorted
        enp_transformers.attention_forward(model.model.layers[0].self_attn, q, q, q, None, use_cache=True,
                                           sinks=None, head_mask=None)


def _close_in_norm(ours, want, tolerance, what):
    error = float((ours - want).detach().norm() / want.detach().norm())
    assert error <= tolerance, f"{what}: relative error {error:.3g}"


LENGTHS = [7, 13, 10]  # longer and shorter than the sliding window (8)


def _packed_batch():
    """Three sequences packed by transformers' DataCollatorWithFlattening, with the cu_seq_lens it gives."""
    generator = torch.Generator().manual_seed(4)
    sequences = [torch.randint(0, 96, (n,), generator=generator) for n in LENGTHS]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collator([{"input_ids": ids.tolist()} for ids in sequences])
    batch.pop("labels")
    return sequences, batch


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_sequences_give_each_sequence_alone(name, monkeypatch):
    models = tiny_models(name)
    sequences, batch = _packed_batch()
    assert batch["cu_seq_lens_q"].tolist() == [0, 7, 20, 30] and batch["position_ids"].shape == (1, 30)
    weights = torch.randn(1, sum(LENGTHS), 96, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    calls, varlen = [], enp_transformers.enpt.varlen_attention

    def recorded(q, k, v, cu_q, cu_k, **options):
        calls.append((tuple(q.shape), cu_q.tolist()))
        return varlen(q, k, v, cu_q, cu_k, **options)

    monkeypatch.setattr(enp_transformers.enpt, "varlen_attention", recorded)
    logits, grads = {}, {}
    for key, model in models.items():
        model.train()
        model.zero_grad()
        if key in ("elastic_np", "float64"):  # packed; "packed" and "packed64"
            out = model(**batch).logits
            (out * weights.to(out.dtype)).sum().backward()
            key = "packed" if key == "elastic_np" else "packed64"
        else:  # each sequence alone
            parts = [model(ids[None]).logits for ids in sequences]
            out = torch.cat(parts, dim=1)
            (out * weights.to(out.dtype)).sum().backward()
        logits[key] = out
        grads[key] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    layers = models["elastic_np"].config.num_hidden_layers
    assert calls == [((30, 8 if name != "gemma2" else 4, 16 if name != "llama" else 8), [0, 7, 20, 30])] * 2 * layers
    for key in ("elastic_np", "float64"):  # each sequence alone, through the same attention
        models[key].zero_grad()
        alone = torch.cat([models[key](ids[None]).logits for ids in sequences], dim=1)
        (alone * weights.to(alone.dtype)).sum().backward()
        # the attention gives each sequence's bits; the other layers sum over the tokens in other orders, in
        # float32 where they compute in it even in a float64 model (Gemma's RMSNorm)
        tolerance = 8 * torch.finfo(torch.float32).eps
        packed = "packed" if key == "elastic_np" else "packed64"
        _close_in_norm(logits[packed], alone, tolerance, f"{name} {packed} logits")
        for pname, p in models[key].named_parameters():
            if p.grad is not None:
                _close_in_norm(grads[packed][pname], p.grad, tolerance, f"{name} {packed} d{pname}")
    within_the_rule(logits["packed"], logits["eager"], logits["eager64"], f"{name} packed logits")
    assert grads["packed"].keys() == grads["eager"].keys()
    assert len(grads["packed"]) == sum(p.requires_grad for p in models["elastic_np"].parameters())
    for pname, grad in grads["packed"].items():
        within_the_rule(grad, grads["eager"][pname], grads["eager64"][pname], f"{name} packed d{pname}")


def test_a_packed_batch_with_a_padding_mask_is_an_error():
    model = tiny_models("llama")["elastic_np"]
    _, batch = _packed_batch()
    batch["attention_mask"] = torch.ones(1, 30, dtype=torch.long)
    model(**batch)  # a mask that pads nothing: the packed sequences
    batch["attention_mask"][0, 3] = 0
    with pytest.raises(ValueError, match="differs \\(padding\\?\\): packed sequences carry no padding"):
        model(**batch)


def test_a_packed_mask_is_checked_within_each_sequence_only():
    cu = torch.tensor([0, 3, 8])
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    position = torch.arange(8) - cu[seq]
    causal = (seq[:, None] == seq[None, :]) & (position[None, :] <= position[:, None])
    check = enp_transformers._check_packed_mask
    check(causal[None, None], cu, cu, True, (-1, -1), 8, 8)
    check(torch.ones(8, 8, dtype=torch.bool).tril()[None, None], cu, cu, True, (-1, -1), 8, 8)  # across: not read
    window = causal & (position[:, None] - position[None, :] < 2)
    check(window[None, None], cu, cu, True, (1, 0), 8, 8)
    for mask, window_size in ((causal, (1, 0)), (window, (-1, -1)), (torch.ones(8, 8, dtype=torch.bool), (-1, -1))):
        with pytest.raises(ValueError, match="within each sequence, what causality and the sliding window keep"):
            check(mask[None, None].clone(), cu, cu, True, window_size, 8, 8)
    with pytest.raises(ValueError, match="boolean mask of one row, \\(1, 1, 8, 8\\)"):
        check(causal[None, None].float(), cu, cu, True, (-1, -1), 8, 8)


def test_packed_offsets_that_do_not_fit_are_named_with_a_mask_too():
    module = tiny_models("llama")["elastic_np"].model.layers[0].self_attn
    q = torch.zeros(1, 8, 6, 8)
    k = torch.zeros(1, 2, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    for cu in ([0, 4, 9], [0, 4, 2, 6], [1, 6]):
        with pytest.raises(ValueError, match="packed sequences \\(cu_seq_lens_q, .*\\): `cu_seqlens_q` must rise "
                                             "from 0 to the packed length 6"):
            enp_transformers.attention_forward(module, q, k, k, mask, cu_seq_lens_q=torch.tensor(cu),
                                               cu_seq_lens_k=torch.tensor(cu))


def test_packed_sequences_in_bfloat16():
    """A bfloat16 model packed: logits and every gradient within bfloat16's rule against eager on each sequence."""
    pytest.importorskip("ml_dtypes")
    models = tiny_models("llama", dtype=torch.bfloat16)
    sequences, batch = _packed_batch()
    weights = torch.randn(1, sum(LENGTHS), 96, generator=torch.Generator().manual_seed(5))
    logits, grads = {}, {}
    for key in ("elastic_np", "eager", "float64"):
        model = models[key].train()
        out = model(**batch).logits if key == "elastic_np" else \
            torch.cat([model(ids[None]).logits for ids in sequences], dim=1)
        (out * weights.to(out.dtype)).sum().backward()
        logits[key], grads[key] = out, {n: p.grad for n, p in model.named_parameters()}
    assert logits["elastic_np"].dtype == torch.bfloat16
    eps = torch.finfo(torch.bfloat16).eps
    for what, ours, eager, exact in [("logits", logits["elastic_np"], logits["eager"], logits["float64"])] + [
            (f"d{n}", g, grads["eager"][n], grads["float64"][n]) for n, g in grads["elastic_np"].items()]:
        error, naive = (float((a.detach().double() - exact.detach()).norm() / exact.norm()) for a in (ours, eager))
        assert error <= 2 * naive + 4 * eps, f"packed bfloat16 {what}: error {error:.3g}, eager's {naive:.3g}"
