"""The conformance kit's internals under one name, for the CLI, the benchmarks and the tests.

The kit lives in `elastic_np.testing` (``_cases``, ``_tolerances``,
``_report``, ``_battery``); this module gathers the names its users read,
so that ``from elastic_np import _conformance`` keeps working.
"""

from elastic_np.testing._battery import (  # noqa: F401
    check_oracle_gradients,
    run_battery,
    supported_options,
)
from elastic_np.testing._cases import (  # noqa: F401
    CAPABILITIES,
    CASES,
    OPTION_NAMES,
    draw_inputs,
    select_cases,
)
from elastic_np.testing._tolerances import (  # noqa: F401
    FLOOR,
    float32_allowed,
    naive_backward,
    naive_forward,
    naive_orderings,
    summation_allowance,
)
