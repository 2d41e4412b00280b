"""Property test: every float32 quantity of the CPU kernels within the conformance kit's rule.

The corners an outside comparison found over the rule, widened: ``tau`` in
[0.02, 50], soft-caps from 5 up, ALiBi with ``N > M``, per-head ``tau`` and
``beta``, sinks, with the masks, grouped-query heads and a bias drawn on top.
Each of ``out``, ``lse``, ``dq``, ``dk``, ``dv``, ``dtau``, ``dbeta`` and
``dbias`` is held to `elastic_np.testing._tolerances.kit_allowed`: twice the
worst error of four naive float32 evaluations, plus the rounding allowance
of large logits and cancelling sums, or the float32 floor. Inputs are unit-scale normals
(the rule's floor is relative to the oracle); half the examples run with
small tiles, so that the sizes span several of them. The problems and the rule are
`float32_rule`'s (``tests/support``), shared with the CUDA kernels' test.

``ELASTIC_NP_PROPERTY_EXAMPLES`` sets the examples (default 300, of which
this test runs a third: each example evaluates the naive formula four times).
"""

import os

import pytest
from hypothesis import HealthCheck, given, settings

from elastic_np import cpu
from float32_rule import assert_within_the_kits_rule, kernel_results, problems

EXAMPLES = max(1, int(os.environ.get("ELASTIC_NP_PROPERTY_EXAMPLES", "300")) // 3)
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@SETTINGS
@given(problems())
def test_every_float32_quantity_within_the_kits_rule(problem):
    q, k, v, dout, options, small_tiles = problem
    with pytest.MonkeyPatch.context() as patch:
        if small_tiles:  # several tiles of queries and keys, each thread busy
            patch.setattr(cpu._runtime.config, "BLOCK_Q", 8)
            patch.setattr(cpu._runtime.config, "BLOCK_K", 5)
            patch.setattr(cpu._runtime.config, "SERIAL_WORK", 0)
        got = kernel_results(q, k, v, dout, options)
    assert_within_the_kits_rule(q, k, v, dout, options, got)
