"""The host side of a launch, with no kernel run: what numba-cuda keeps from one call to the next."""

import pytest

pytest.importorskip("numba_cuda", reason="needs the cuda extra (numba-cuda)")

from numba import cuda  # noqa: E402

from elastic_np.cuda._runtime import config as _config, gpu as _host  # noqa: E402


def test_the_shared_memory_opt_in_is_added_once_per_launch_configuration():
    # numba-cuda returns the same configuration object for the same launch, call after call: a callback
    # appended per call piled up (thousands after a benchmark) and each one ran at every launch
    @cuda.jit
    def kernel(x):
        pass

    shared = _config.DEFAULT_SHARED_BYTES + 1024
    launches = [_host.configured(kernel, 256, 32, shared) for _ in range(3)]
    assert launches[-1].pre_launch_callbacks.count(_host._allow_shared) == 1
    assert _host.configured(kernel, 256, 32, 1024).pre_launch_callbacks == []
