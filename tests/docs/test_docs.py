"""The documentation builds strictly and covers every public name."""

import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import elastic_np

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PUBLIC_MODULES = ("elastic_np", "elastic_np.reference", "elastic_np.testing")
#: Documented modules that need an optional extra, and the package each imports.
OPTIONAL_MODULES = {"elastic_np.torch": "torch", "elastic_np.jax": "jax", "elastic_np.dask": "dask",
                    "elastic_np.transformers": "transformers", "elastic_np.transformers.flash": "transformers"}


def _api_names():
    """Fully qualified names listed in autosummary blocks of the API pages."""
    names = set()
    for page in DOCS.glob("*.rst"):
        module = None
        in_summary = False
        for line in page.read_text().splitlines():
            current = re.match(r"\.\. currentmodule:: (\S+)", line)
            if current:
                module = current.group(1)
                continue
            if line.startswith(".. autosummary::"):
                in_summary = True
                continue
            if in_summary:
                if not line.strip() or line.strip().startswith(":"):
                    continue
                if not line.startswith("   "):
                    in_summary = False
                    continue
                name = line.strip()
                names.add(name if module is None else f"{module}.{name}")
    return names


def _public_names():
    expected = set()
    for modname in PUBLIC_MODULES:
        module = importlib.import_module(modname)
        for name in module.__all__:
            if isinstance(getattr(module, name), type(sys)):  # a submodule: its own page section
                continue
            expected.add(f"{modname}.{name}")
    return expected


def test_api_pages_cover_every_public_name():
    missing = _public_names() - _api_names()
    assert not missing, f"public names missing from the API pages: {sorted(missing)}"


def test_api_pages_list_only_names_that_exist():
    for qualified in sorted(_api_names()):
        modname, _, name = qualified.rpartition(".")
        extra = OPTIONAL_MODULES.get(modname)
        if extra is not None and importlib.util.find_spec(extra) is None:
            continue  # its extra is not installed here
        module = importlib.import_module(modname)
        assert hasattr(module, name), f"{qualified} is listed in the API pages but does not exist"


def test_public_submodules_are_documented():
    text = (DOCS / "api.rst").read_text()
    for name in elastic_np.__all__:
        if isinstance(getattr(elastic_np, name), type(sys)):
            assert f".. automodule:: elastic_np.{name}" in text


def _cited_tests():
    """Every ``tests/folder/test_x.py::Name[::name]`` cited in the pages."""
    cited = set()
    for page in DOCS.glob("*.rst"):
        cited.update(re.findall(r"(tests/(?:\w+/)*test_\w+\.py)::([\w:]+)", page.read_text()))
    return sorted(cited)


@pytest.mark.parametrize("path, name", _cited_tests())
def test_cited_tests_exist(path, name):
    """A derivation cites the test that checks its formula; that test must exist."""
    source = ROOT / path
    assert source.is_file(), f"{path} is cited but is not a test file"
    text = source.read_text()
    for part in name.split("::"):
        assert re.search(rf"^\s*(class|def) {part}\b", text, re.MULTILINE), f"{path}::{name} not found"


def test_sphinx_build_is_clean(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("numpydoc")
    pytest.importorskip("pydata_sphinx_theme")
    pytest.importorskip("matplotlib")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "html" / "_images" / "window_gate.png").exists()
    assert (tmp_path / "html" / "api.html").exists()


def test_performance_hook_renders_saved_results(tmp_path):
    """A results file becomes a plot and a table; no file, no figures."""
    pytest.importorskip("matplotlib")
    import json
    import runpy

    script = runpy.run_path(str(DOCS / "scripts" / "performance.py"))
    empty = tmp_path / "empty"
    empty.mkdir()
    text = pathlib.Path(script["main"](str(tmp_path / "out0"), results_dir=str(empty))).read_text()
    assert "No CPU benchmark results" in text

    results = tmp_path / "results"
    results.mkdir()
    from elastic_np.cli import _bench

    impls = {"naive numpy": _bench.implementations(False)["naive numpy"]}
    run = _bench.compare([16, 32], batch=1, heads=1, dim=8, dtype=np.dtype(np.float32),
                         causal=False, repeat=1, min_time=0.0, matmul_n=64, impls=impls)
    run = {"machine": {"cpu": "test"}, "command": "elastic-np bench --seq 16 32", **run}
    (results / "machine-x.json").write_text(json.dumps(run))
    out = tmp_path / "out1"
    text = pathlib.Path(script["main"](str(out), results_dir=str(results))).read_text()
    assert "performance_0.png" in text and (out / "performance_0.png").exists()
    assert ".. code-block:: text" in text and "naive numpy" in text and '"cpu": "test"' in text
    assert "elastic-np bench --seq 16 32" in text


def cuda_record(modifiers=False):
    """A CUDA results dict as ``python -m elastic_np.cuda --bench --json`` writes it, with made-up timings."""
    from elastic_np.cli import _cuda_bench as cuda_bench

    timings = {"elastic_np": {"forward": 0.02, "forward+backward": 0.09},
               "torch": {"forward": 0.01, "forward+backward": 0.045}}
    if modifiers:
        timings["elastic_np plain"] = {"forward": 0.016, "forward+backward": 0.06}
    timings["tflops"] = {who: {what: 1.0 / t for what, t in runs.items()} for who, runs in timings.items()}
    machine = {"gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "driver": "13.0",
               "numba_cuda": "0.30.4", "torch": "2.13.0+cu130", "torch_cuda": "13.0"}
    options = {"causal": True, "softcap": 2.0 if modifiers else None, "alibi": False, "bias": None}
    decode = [(shape, {"elastic_np": 4e-4, "torch": 1e-4}) for shape in cuda_bench.DECODE_SHAPES]
    return cuda_bench.bench_record((4, 16, 4096, 64), options, timings, decode, machine,
                                   command="python -m elastic_np.cuda --bench --json h100.json")


@pytest.mark.parametrize("modifiers", [False, True])
def test_performance_hook_renders_cuda_results(tmp_path, modifiers):
    """A CUDA results file becomes its GPU, command and table; no file, a note that nothing was measured."""
    import runpy

    from elastic_np.cli import _cuda_bench as cuda_bench

    script = runpy.run_path(str(DOCS / "scripts" / "performance.py"))
    empty = tmp_path / "empty"
    empty.mkdir()
    script["main"](str(tmp_path / "out0"), results_dir=str(empty))
    text = (tmp_path / "out0" / "performance_cuda.inc").read_text()
    assert "unmeasured" in text and "code-block" not in text

    results = tmp_path / "results"
    results.mkdir()
    cuda_bench.write_json(cuda_record(modifiers), str(results / "h100-cuda.json"))
    out = tmp_path / "out1"
    cpu_text = pathlib.Path(script["main"](str(out), results_dir=str(results))).read_text()
    assert "No CPU benchmark results" in cpu_text  # a CUDA file is not drawn as a CPU one
    text = (out / "performance_cuda.inc").read_text()
    assert "``h100-cuda``\n" + "^" * 13 + "\n" in text and "unmeasured" not in text
    assert "NVIDIA H100 80GB HBM3 (compute capability 9.0), driver 13.0, numba-cuda 0.30.4" in text
    assert "torch 2.13.0+cu130 (CUDA 13.0)" in text
    assert "Command: ``python -m elastic_np.cuda --bench --json h100.json``" in text
    assert "B=4 H=16 N=4096 M=4096 D=64, causal=True" in text
    lines = text.splitlines()
    forward = [line.split() for line in lines if line.split()[:2] == ["elastic_np", "forward"]]
    assert forward == [["elastic_np", "forward", "20.000", "50.00", "0.50"]]
    assert ["torch", "forward+backward", "45.000", "22.22"] in [line.split() for line in lines]
    assert any(line.split() == ["1,", "32/8,", "1,", "8192,", "128", "0.400", "0.100", "0.25"] for line in lines)
    plain = [line for line in lines if "elastic_np plain" in line]
    assert len(plain) == (2 if modifiers else 0)
    assert ("modifiers cost x1.25 over plain attention (forward)" in text) == modifiers


def _extras():
    """``{extra: [package names]}`` of setup.cfg, without versions, extras or comments."""
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = {}
    for name, value in config["options.extras_require"].items():
        lines = [line.split("#")[0].strip() for line in value.splitlines()]
        extras[name] = [re.match(r"[A-Za-z0-9_.-]+(\[[^\]]*\])?", line).group(0) for line in lines if line]
    return extras


def test_the_extras_table_lists_every_extra_with_what_it_installs():
    text = (DOCS / "getting_started.rst").read_text()
    rows = dict(re.findall(r"   \* - ``(\w+)``\n     - ([^\n]+)", text))
    extras = _extras()
    assert set(rows) == set(extras), "the extras table and setup.cfg name different extras"
    for name, packages in extras.items():
        for package in packages:
            if package != "numpy":  # a pin of numpy, not something the extra adds
                assert package.split("[")[0] in rows[name], f"extra {name!r}: {package} missing from the table"


def test_generated_text_in_the_pages_is_current():
    """The CLI help and performance tables kept in the pages are what their generators write now."""
    import runpy

    if sys.version_info[:2] != (3, 11):
        pytest.skip("the committed --help text is argparse's of Python 3.11, the project's version")
    script = runpy.run_path(str(DOCS / "scripts" / "rendered_blocks.py"))
    assert {page.name for page in script["pages"]()} == {"getting_started.rst", "performance.rst"}
    assert script["stale"]() == []
    text = (DOCS / "getting_started.rst").read_text()
    assert "elastic-np warmup --help" in text
    edited = text.replace("elastic-np warmup --help", "elastic-np warmup --hlp", 1)
    assert script["rendered"](edited) != edited  # a hand edit inside a block is caught
