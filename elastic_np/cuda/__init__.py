"""The numba.cuda backend: tiled attention kernels, forward, backward and decoding, on NVIDIA GPUs.

Selected with ``backend="cuda"`` (or ``"auto"`` when a GPU is usable); this
module is its face, what the dispatcher reads (``dtypes``, `is_available`,
`check_available`, `prepare`, `check_backward_arrays`, `forward`,
`backward`), and the compile-only reports (`ptx`, `resources`,
`dynamic_shared_bytes`, no GPU needed). Importing it never imports
``numba.cuda``; the kernels are compiled on first use, one specialisation per
dtype (float32, float64). NumPy inputs are copied to the GPU and the results
come back as NumPy arrays; device arrays (``__cuda_array_interface__``,
C-contiguous) are used in place and give device arrays back. Its groups:

- ``_simt``: the SIMT kernels (flash forward, backward, decoding);
- ``_tensor_core``: the tensor-core kernels (forward, backward on ``mma.sync``);
- ``_device``: the device functions every kernel shares (score pipeline,
  online softmax, tiles, option indices);
- ``_launch``: the host side (entry points, option arrays, kernel plan, launches);
- ``_runtime``: tunables, ``numba.cuda`` on first use, the GPU's limits, the simulator;
- ``_compile``: every kernel by name, its PTX and resource report.

``python -m elastic_np.cuda`` (`elastic_np.cli._cuda`) prints the PTX and the
resources and times the kernels against torch; the package imports that tool
only for the deprecated names of its benchmark.
"""

import importlib
import warnings

from elastic_np.cuda._compile.report import dynamic_shared_bytes, ptx, resources
from elastic_np.cuda._launch.api import backward, forward
from elastic_np.cuda._launch.arrays import check_backward_arrays, dtypes, prepare
from elastic_np.cuda._runtime.gpu import check_available, is_available

__all__ = [
    "dtypes",
    "is_available",
    "check_available",
    "prepare",
    "check_backward_arrays",
    "forward",
    "backward",
    "ptx",
    "resources",
    "dynamic_shared_bytes",
]

#: Names that moved to the benchmark tool, `elastic_np.cli._cuda_bench`, and still resolve here, deprecated.
_MOVED_TO_THE_BENCHMARK = ("bench", "bench_decode", "bench_record", "BENCH_BIAS_SHAPES", "DECODE_SHAPES")
#: Other names of the flat module this package replaced, deprecated: name -> (module, attribute or None, use).
_DEPRECATED = {
    "BackendUnavailableError": ("elastic_np._contract._errors", "BackendUnavailableError", "elastic_np.BackendUnavailableError"),
    "config": ("elastic_np.cuda._runtime.config", None, "the tunables' module, elastic_np.cuda._runtime.config"),
}


def __getattr__(name):
    """The names that moved, deprecated: the GPU benchmark is a tool now (``elastic-np bench --gpu``)."""
    if name in _MOVED_TO_THE_BENCHMARK:
        # the one import of the tools from this package, for the deprecated names only
        module, attribute = "elastic_np.cli._cuda_bench", name
        use = (f"the GPU benchmark moved to the command-line tool (`elastic-np bench --gpu` or "
               f"`python -m elastic_np.cuda --bench`; the function is elastic_np.cli._cuda_bench.{name})")
    elif name in _DEPRECATED:
        module, attribute, use = _DEPRECATED[name]
        use = f"use {use}"
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"elastic_np.cuda.{name} is deprecated: {use}", DeprecationWarning, stacklevel=2)
    found = importlib.import_module(module)
    return found if attribute is None else getattr(found, attribute)
