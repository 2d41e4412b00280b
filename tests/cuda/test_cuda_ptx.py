"""Every kernel compiles to PTX, for each dtype, for sm_80 and sm_90 (no GPU needed)."""

import re

import pytest

pytest.importorskip("numba_cuda", reason="needs the cuda extra (numba-cuda)")

from elastic_np import _cuda_kernels, cuda  # noqa: E402


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_ptx_for_every_kernel(cc):
    code = cuda.ptx(cc=cc)
    expected = {f"{name}[{dtype.name}]" for name in _cuda_kernels.KERNELS for dtype in cuda.dtypes}
    assert set(code) == expected
    for name, text in code.items():
        assert re.search(rf"^\.target sm_{cc[0]}{cc[1]}\b", text, re.M), name
        assert ".entry" in text, name
        if "float32" in name:
            # a float32 kernel computes in float32 throughout
            assert ".f64" not in text, name
