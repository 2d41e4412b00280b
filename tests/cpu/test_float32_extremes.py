"""A fixed-seed fuzz: every float32 quantity of the CPU kernels on extreme logits within the kit's rule.

`benchmarks/float32_extremes.py` draws the problems (logits in the
thousands, ``tau`` down to 0.02, ALiBi, a bias, sinks far above every logit
of a row and tiny ones, soft-caps, NVM under any finite ``scale``, dynamic
windows, a cotangent of ``lse``, the decode kernel's 1 to 16 queries and the
prefill kernel's more, small tiles half the time). Each quantity must be
within `elastic_np.testing._tolerances.kit_allowed` with an allowance that
is finite wherever the oracle is; a failure names the problem, which
``python benchmarks/float32_extremes.py --seed 71 --problem I`` reproduces.
``ELASTIC_NP_EXTREME_PROBLEMS`` sets how many (default 400: about 20 s on two
cores, once the kernels are compiled); the benchmark runs 10,000 the same way.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import float32_extremes  # noqa: E402

SEED = 71
PROBLEMS = int(os.environ.get("ELASTIC_NP_EXTREME_PROBLEMS", "400"))


def test_every_float32_quantity_on_extreme_logits_within_the_kits_rule():
    rows, found, rejected = float32_extremes.run(SEED, PROBLEMS)
    assert not found, "\n".join(
        f"--seed {SEED} --problem {index}: {name} {kind}: {note}\n    "
        f"{float32_extremes.describe(*float32_extremes.problem(SEED, index))}"
        for index, name, kind, note in found)
    # the draw reaches what it is for: both forward kernels, every option, rows far below a sink
    drawn = [float32_extremes.problem(SEED, i) for i in range(PROBLEMS)]
    options = [p[5] for p in drawn]
    assert sum(p[0].shape[2] <= 16 for p in drawn) > PROBLEMS // 4
    assert sum(p[0].shape[2] > 16 for p in drawn) > PROBLEMS // 4
    for name in ("dynamic_window", "nvm", "bias", "beta", "softcap", "alibi_slopes", "scale", "kv_lengths"):
        assert any(name in o for o in options), name
    assert any(o.get("nvm") and o.get("scale", 1.0) <= 0 for o in options)
    assert min(np.min(o.get("tau", 1.0)) for o in options) < 0.03
    assert len(rows["dsigma"]) > PROBLEMS // 10 and len(rows["dbias"]) > PROBLEMS // 10
    assert rejected < PROBLEMS // 10


def test_findings_name_what_is_outside_the_rule_and_what_it_cannot_judge():
    result = {
        "out": (2e-6, 1e-6, 4e-6, ""),  # within
        "lse": (5e-6, 1e-6, 4e-6, ""),  # outside
        "dq": (1.0, np.inf, np.inf, ""),  # unjudged: an infinite allowance passes anything
        "dbeta": (np.inf, 0.0, 1.0, "NaN in result"),  # outside, with worst_error's note
        "raised": (np.inf, 0.0, 0.0, "the kernels raised ValueError: x"),
    }
    found = float32_extremes.findings(result)
    assert [(name, kind) for name, kind, _ in found] == [
        ("lse", "outside"), ("dq", "unjudged"), ("dbeta", "outside"), ("raised", "outside")]
    assert "NaN in result" in found[2][2] and "ValueError" in found[3][2]
