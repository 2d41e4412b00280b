"""Tools for testing numerical code against elastic_np's oracles.

`gradcheck` compares a claimed gradient with central finite differences for any
function of NumPy arrays and scalars. `check_attention` runs any attention
implementation (a PyTorch or JAX kernel wrapped in a few lines) through the
conformance battery against the float64 oracles; `backend_functions` gives a
backend of `elastic_np.attention` in the form it takes; `dequantize` gives
the values a quantized cache holds (its cases' ``k * k_scale``).

The package: ``_gradcheck`` (finite differences), ``_cases`` (the battery's
cases and inputs), ``_tolerances`` (the floors and the naive evaluation that
sets the float32 rule), ``_report`` (errors, rows, the report), ``_battery``
(running an implementation and the oracle's own gradients through the cases)
and ``_adapter`` (`backend_functions`).
"""

from elastic_np.testing._adapter import backend_functions
from elastic_np.testing._battery import check_attention
from elastic_np.testing._cases import dequantize
from elastic_np.testing._gradcheck import GradcheckError, GradcheckReport, gradcheck
from elastic_np.testing._report import ConformanceReport

__all__ = ["gradcheck", "GradcheckError", "GradcheckReport", "check_attention", "ConformanceReport",
           "backend_functions", "dequantize"]
