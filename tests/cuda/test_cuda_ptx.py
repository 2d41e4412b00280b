"""Every kernel compiles to PTX, for each dtype, for sm_80 and sm_90 (no GPU needed)."""

import re

import numpy as np

import pytest

pytest.importorskip("numba_cuda", reason="needs the cuda extra (numba-cuda)")


def _nvrtc_found():
    """Whether the CUDA toolkit's NVRTC is here (numba-cuda's ``cu13`` extra brings it; numba-cuda alone does not)."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        load_nvidia_dynamic_lib("nvrtc")
    except Exception:  # noqa: BLE001 (any failure to find or load it)
        return False
    return True


pytestmark = pytest.mark.skipif(not _nvrtc_found(), reason='needs the CUDA toolkit\'s NVRTC: pip install "elastic_np[cuda]"')

from elastic_np import cuda  # noqa: E402
from elastic_np.cuda._compile import kernels as _cuda_kernels  # noqa: E402


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_ptx_for_every_kernel(cc):
    code = cuda.ptx(cc=cc)
    expected = {f"{name}[{dtype}]" for name in _cuda_kernels.KERNELS for dtype in cuda.dtypes}
    assert set(code) == expected
    for name, text in code.items():
        assert re.search(rf"^\.target sm_{cc[0]}{cc[1]}\b", text, re.M), name
        assert ".entry" in text, name
        if "float32" in name:
            # a float32 kernel computes in float32 throughout
            assert ".f64" not in text, name


def test_resource_report_from_the_compiled_code():
    """Registers, stack, spills and shared memory read back from the assembler (nvJitLink, no GPU)."""
    pytest.importorskip("cuda.core", reason="needs cuda.core with nvJitLink")
    report = cuda.resources(cc=(9, 0))
    assert set(report) == {f"{name}[{dtype}]" for name in _cuda_kernels.KERNELS for dtype in cuda.dtypes}
    for name, entry in report.items():
        assert 1 <= entry["registers"] <= 255, name
        assert entry["spills"] == (entry["spill_store_bytes"] + entry["spill_load_bytes"] > 0), name
    # the float32 flash forward keeps its score and output micro-tiles in registers: no local memory at all
    forward = report["_forward_kernel[float32]"]
    assert forward["stack_bytes"] == 0 and not forward["spills"], forward
    # the float64 tensor-core forward (32-key tiles, 64 value columns) keeps its fragments in registers too; the
    # float32 ones spill 56 B and more (docs/performance.rst)
    tensor_cores = report["_forward_tc_k32_v64_simple[float64]"]
    assert tensor_cores["stack_bytes"] == 0 and not tensor_cores["spills"], tensor_cores


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_tensor_core_forward_uses_the_tensor_cores(cc):
    """Its products are ``mma.sync`` (TF32 for float32; float64 as m16n8k4 on sm_90, m8n8k4 before), its copies ``cp.async``."""
    code = cuda.ptx(cc=cc)
    names = [name for name in _cuda_kernels.KERNELS if name.startswith("_forward_tc_")]
    assert len(names) == 8
    f64_shape = "m16n8k4" if cc >= (9, 0) else "m8n8k4"
    for name in names:
        f32, f64 = code[f"{name}[float32]"], code[f"{name}[float64]"]
        assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in f32 and "cvt.rna.tf32.f32" in f32, name
        assert f"mma.sync.aligned.{f64_shape}.row.col.f64.f64.f64.f64" in f64 and ".tf32" not in f64, name
        assert "m8n8k4" not in f64 if cc >= (9, 0) else "m16n8k4" not in f64, name
        for text in (f32, f64):
            assert "cp.async.cg.shared.global" in text and "cp.async.wait_group 1" in text, name


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_tensor_core_backward_uses_the_tensor_cores(cc):
    """Its products are ``mma.sync`` in every kernel of the config's tiles; Q/dO and K/V arrive by ``cp.async``."""
    from elastic_np.cuda._runtime import config as _cuda_config

    code = cuda.ptx(cc=cc)
    names = sorted(name for name in _cuda_kernels.KERNELS if name.startswith("_backward_tc_"))
    assert names == sorted(f"_backward_tc_{kind}_t{tile}_w{width}"
                           for (kind, _, width), tile in _cuda_config.TC_BACKWARD_TILES.items())
    f64_shape = "m16n8k4" if cc >= (9, 0) else "m8n8k4"
    for name in names:
        f32, f64 = code[f"{name}[float32]"], code[f"{name}[float64]"]
        assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in f32 and "cvt.rna.tf32.f32" in f32, name
        assert f"mma.sync.aligned.{f64_shape}.row.col.f64.f64.f64.f64" in f64 and ".tf32" not in f64, name
        for text in (f32, f64):
            assert "cp.async.cg.shared.global" in text and "cp.async.wait_group 1" in text, name


def test_float32_tensor_core_backward_keeps_its_fragments_in_registers():
    """The float32 kernels the config uses spill nothing on sm_90 (the float64 ones spill: docs/performance.rst)."""
    pytest.importorskip("cuda.core", reason="needs cuda.core with nvJitLink")
    from elastic_np.cuda._runtime import config as _cuda_config

    report = cuda.resources(cc=(9, 0))
    for (kind, itemsize, width), tile in _cuda_config.TC_BACKWARD_TILES.items():
        if itemsize == 4:
            entry = report[f"_backward_tc_{kind}_t{tile}_w{width}[float32]"]
            assert entry["stack_bytes"] == 0 and not entry["spills"], (kind, width, entry)


def test_dynamic_shared_memory_fits_the_limit():
    from elastic_np.cuda._runtime.gpu import shared_limit

    for dtype in cuda.dtypes:
        for D in (16, 64, 128, 256):
            for name, (threads, tile, size) in cuda.dynamic_shared_bytes(D, D, np.dtype(dtype)).items():
                assert size <= shared_limit(), (name, D, dtype)
                assert threads >= 1 and tile >= 1
