"""The asv suite: it imports, has what a dashboard needs, and never times a compilation.

The suite lives in ``asv_benchmarks/benchmarks`` (not an installed package);
it is imported here with the ``quick`` profile, the one CI's dry run uses.
"""

import importlib
import importlib.util
import inspect
import itertools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import elastic_np
from elastic_np._contract import _problem
from elastic_np.cli import _bench
from elastic_np import reference as ref

ASV_DIR = pathlib.Path(__file__).resolve().parents[2] / "asv_benchmarks"
MODULES = ["bench_vector", "bench_reference", "bench_cpu", "bench_compare", "bench_cuda", "bench_fixed_cost"]
KINDS = ("time_", "peakmem_", "track_")


@pytest.fixture(scope="module")
def suite():
    """The benchmark modules, imported fresh under the quick profile."""
    previous = os.environ.get("ELASTIC_NP_ASV_PROFILE")
    os.environ["ELASTIC_NP_ASV_PROFILE"] = "quick"
    sys.path.insert(0, str(ASV_DIR))
    for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
        del sys.modules[name]
    try:
        modules = {name: importlib.import_module(f"benchmarks.{name}") for name in MODULES}
        yield modules
    finally:
        sys.path.remove(str(ASV_DIR))
        if previous is None:
            del os.environ["ELASTIC_NP_ASV_PROFILE"]
        else:
            os.environ["ELASTIC_NP_ASV_PROFILE"] = previous


def benchmark_methods(suite):
    """``(class, method name)`` for every benchmark the suite defines."""
    found = []
    for module in suite.values():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            for name, _ in inspect.getmembers(cls, inspect.isfunction):
                if name.startswith(KINDS):
                    found.append((cls, name))
    return found


def param_sets(cls):
    return list(itertools.product(*cls.params)) if hasattr(cls, "params") else [()]


def test_suite_has_at_least_ten_benchmarks_of_three_kinds(suite):
    methods = benchmark_methods(suite)
    assert len(methods) >= 10
    kinds = {kind for _, name in methods for kind in KINDS if name.startswith(kind)}
    assert kinds == set(KINDS)


def test_every_track_benchmark_has_a_unit(suite):
    units = {
        name: getattr(cls, name).unit
        for cls, name in benchmark_methods(suite)
        if name.startswith("track_")
    }
    assert units
    assert set(units.values()) <= {"GFLOP/s", "relative error"}
    assert {"GFLOP/s", "relative error"} <= set(units.values())


def test_quick_profile_keeps_grids_small(suite):
    common = suite["bench_cpu"].common
    assert common.PROFILE == "quick"
    runs = sum(len(param_sets(cls)) for cls, _ in benchmark_methods(suite))
    assert runs <= 150, runs


def test_unknown_profile_is_rejected(monkeypatch):
    monkeypatch.setenv("ELASTIC_NP_ASV_PROFILE", "fast")
    monkeypatch.syspath_prepend(str(ASV_DIR))
    spec = importlib.util.spec_from_file_location(
        "_profile_check", ASV_DIR / "benchmarks" / "common.py"
    )
    with pytest.raises(ValueError, match="ELASTIC_NP_ASV_PROFILE"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


# Runs every benchmark of one class in a fresh interpreter, as asv does, and
# records each Numba specialisation added (compiled, or loaded from the on-disk
# cache) while a benchmark is measured.
_COLD_RUN = """
import itertools, json, sys
from numba.core.dispatcher import Dispatcher
sys.path.insert(0, sys.argv[1])
module_name, class_name = sys.argv[2], sys.argv[3]
added = []
add_overload = Dispatcher.add_overload
def recording_add_overload(self, cres):
    added.append(self.py_func.__qualname__ + str(tuple(cres.signature.args)))
    return add_overload(self, cres)
Dispatcher.add_overload = recording_add_overload
module = __import__("benchmarks." + module_name, fromlist=[class_name])
cls = getattr(module, class_name)
report = {"ran": [], "skipped": [], "compiled": []}
methods = sorted(n for n in dir(cls) if n.startswith(("time_", "peakmem_", "track_")))
for name in methods:
    for params in itertools.product(*getattr(cls, "params", [])):
        instance = cls()
        cache = (instance.setup_cache(),) if hasattr(cls, "setup_cache") else ()
        try:
            if hasattr(instance, "setup"):
                instance.setup(*cache, *params)
        except NotImplementedError:
            report["skipped"].append(name)
            continue
        added.clear()
        getattr(instance, name)(*cache, *params)
        if added:
            report["compiled"].append([name, repr(params), list(added)])
        report["ran"].append(name)
print(json.dumps(report))
"""


def test_no_benchmark_compiles_while_measured(suite):
    """After ``setup``, a benchmark call neither compiles nor loads a Numba kernel.

    asv runs each benchmark in a fresh process, so every one must warm its
    kernels up itself. Each class runs here in a fresh interpreter, every
    benchmark and parameter set once, and any specialisation added during a
    measured call (compiled, or loaded from Numba's on-disk cache) fails the
    test. A benchmark that skips in ``setup`` (backend or torch unavailable) is
    left out; the oracles always run.
    """
    package_root = str(pathlib.Path(elastic_np.__file__).resolve().parents[1])
    env = dict(os.environ, ELASTIC_NP_ASV_PROFILE="quick")
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    classes = sorted({(cls.__module__.split(".")[-1], cls.__name__)
                      for cls, _ in benchmark_methods(suite)})
    ran = set()
    for module_name, class_name in classes:
        result = subprocess.run(
            [sys.executable, "-c", _COLD_RUN, str(ASV_DIR), module_name, class_name],
            capture_output=True, text=True, env=env, check=False,
        )
        assert result.returncode == 0, f"{class_name}:\n{result.stderr[-3000:]}"
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert not report["compiled"], f"{class_name}: {report['compiled']}"
        ran.update((class_name, name) for name in report["ran"])
    assert ("VectorOracles", "time_softmax") in ran
    assert ("ReferenceAttention", "time_backward") in ran
    if importlib.util.find_spec("elastic_np.cpu") is not None:
        assert ("CPUForward", "time_forward") in ran
        assert ("CPUBackward", "time_forward_backward") in ran
        assert ("CPUThroughput", "track_forward_gflops") in ran
        assert ("LongSequenceMemory", "peakmem_forward") in ran


class TestFlops:
    def common(self, suite):
        return suite["bench_cpu"].common

    @pytest.mark.parametrize(("N", "M"), [(7, 7), (5, 9), (9, 5)])
    def test_matches_the_package_count(self, suite, N, M):
        common = self.common(suite)
        for causal in (False, True):
            expected = _bench.attention_flops(1, 4, N, M, 64, causal=causal)
            assert common.flops(N, M, causal=causal) == expected
            assert common.flops(N, M, causal=causal, backward=True) == 3.5 * expected

    @pytest.mark.parametrize("variant", ["plain", "causal", "window", "dynamic_window"])
    @pytest.mark.parametrize(("N", "M"), [(100, 100), (37, 100)])
    def test_kept_pairs_match_the_oracle(self, suite, variant, N, M):
        """The count equals the entries the oracle keeps structurally and by the gate."""
        common = self.common(suite)
        options = common.variant_options(variant)
        q, k, v = (np.zeros((1, 1, n, 4)) for n in (N, M, M))
        p = _problem.prepare(q, k, v, **options)
        keep = ref.structural_keep(p)
        if p.sigma is not None:
            keep = keep & (ref.window_gate(p)[0] > 0)
        assert common.kept_pairs(N, M, **options) == int(keep.sum())

    def test_window_is_cheaper_than_causal(self, suite):
        common = self.common(suite)
        causal = common.flops(1024, **common.variant_options("causal"))
        window = common.flops(1024, **common.variant_options("window"))
        assert window < causal / 4


class TestRelativeError:
    def test_normwise(self, suite):
        common = suite["bench_cpu"].common
        assert common.relative_error([1.0, -4.0], [1.0, -2.0]) == 1.0
        assert common.relative_error(2.0, 2.0) == 0.0

    def test_shape_mismatch_is_an_error(self, suite):
        common = suite["bench_cpu"].common
        with pytest.raises(ValueError, match="shape"):
            common.relative_error(np.zeros(3), np.zeros(4))


def test_cuda_benchmarks_skip_without_a_gpu(suite):
    from elastic_np._api import dispatch

    try:
        dispatch.get_backend("cuda")
    except dispatch.BackendUnavailableError:
        pass
    else:
        pytest.skip("a usable GPU is present")
    bench_cuda = suite["bench_cuda"]
    for cls in (bench_cuda.CUDAForward, bench_cuda.CUDAForwardBackward):
        with pytest.raises(NotImplementedError, match="cuda"):
            cls().setup(*param_sets(cls)[0])


def test_comparison_covers_kernel_numpy_and_torch(suite):
    compare = suite["bench_compare"]
    implementations = {"cpu kernel", "naive numpy", "torch sdpa"}
    assert set(compare.Forward.params[0]) == implementations
    assert set(compare.LongSequenceMemory.params[0]) == implementations
    assert set(compare.ForwardBackward.params[0]) == {"cpu kernel", "torch sdpa"}
