"""elastic_np.transformers in bfloat16: tiny models (random weights) against "eager" in bfloat16.

The rule of `test_transformers` with bfloat16's epsilon: logits and the
gradient of every parameter (the sinks included) at most twice the error of
eager bfloat16 (relative, in norm) against the model in float64, or a few
bfloat16 ulps; greedy generation gives eager's tokens up to a near-tie.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("ml_dtypes")

from transformers_models import CONFIGS, tiny_models, within_the_rule  # noqa: E402


def _within_the_bfloat16_rule(ours, eager, exact, what):
    within_the_rule(ours, eager, exact, what, dtype=torch.bfloat16, ulps=4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_gradients(name):
    models = tiny_models(name, dtype=torch.bfloat16)
    ids = torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(2))
    padding = torch.ones_like(ids)
    padding[1, :5] = 0
    logits = {key: models[key](ids, attention_mask=padding).logits for key in ("elastic_np", "eager", "float64")}
    assert logits["elastic_np"].dtype == torch.bfloat16
    kept = padding.bool()
    _within_the_bfloat16_rule(logits["elastic_np"][kept], logits["eager"][kept], logits["float64"][kept],
                              f"{name} logits")
    for key in ("elastic_np", "eager", "float64"):
        models[key].train()
        models[key](ids, labels=ids).loss.backward()
    named = [dict(models[key].named_parameters()) for key in ("elastic_np", "eager", "float64")]
    for pname, p in named[0].items():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16, pname
        _within_the_bfloat16_rule(p.grad, named[1][pname].grad, named[2][pname].grad, f"{name} d{pname}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_generation_gives_the_same_tokens_up_to_a_tie(name):
    """Eager's tokens; where they part, the two tokens tie within eager bfloat16's own error of that step's logits.

    Rounding to bfloat16 (8 bits) makes near-ties of random-weight logits a
    coin toss for either implementation: at the first token they differ in,
    the float64 model's logits of the two tokens must be closer than the
    largest error of eager's bfloat16 logits there.
    """
    models = tiny_models(name, dtype=torch.bfloat16)
    prompt = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(3))
    eager, ours = (models[key].generate(prompt, max_new_tokens=32, do_sample=False)[0]
                   for key in ("eager", "elastic_np"))
    differ = (eager != ours).nonzero()
    if differ.numel() == 0:
        return
    t = int(differ[0])
    prefix = eager[None, :t]
    with torch.no_grad():
        exact = models["float64"](prefix).logits[0, -1]
        eager_error = float((models["eager"](prefix).logits[0, -1].double() - exact).abs().max())
    gap = float((exact[eager[t]] - exact[ours[t]]).abs())
    assert gap <= eager_error, f"{name}: token {t} differs, float64 gap {gap:.3g} > eager's error {eager_error:.3g}"
