"""The float32 property test of the CPU kernels (`test_properties_float32`) on the CUDA kernels.

The simulator runs a kernel thread by thread, so this takes a twentieth of
the CPU test's examples (``ELASTIC_NP_PROPERTY_EXAMPLES`` / 60, at least 5).
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from test_properties_float32 import assert_within_the_kits_rule, kernel_results, problems

EXAMPLES = max(5, int(os.environ.get("ELASTIC_NP_PROPERTY_EXAMPLES", "300")) // 60)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problems())
def test_every_float32_quantity_within_the_kits_rule(problem):
    q, k, v, dout, options, _ = problem
    got = kernel_results(q, k, v, dout, options, backend="cuda")
    assert_within_the_kits_rule(q, k, v, dout, options, got)
