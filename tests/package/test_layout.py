"""The package's layout: one face per backend, imports that go one way, the tools apart.

- `elastic_np.reference`, `elastic_np.cpu` and `elastic_np.cuda` show the
  dispatcher the same functions (`FACE`).
- A backend imports, from the rest of the package, only the contract
  (`SHARED`, ``elastic_np._contract`` and the user variants of ``elastic_np._variants``) and, for the kernels, the reference (its
  check of ``dout``, ``out`` and ``lse``); checked by parsing every module's
  imports, so no import inside a function escapes.
- The tools (`elastic_np.cli`) use the library from the top: nothing of the
  library imports them, apart from the entry scripts and the deprecated
  names of `elastic_np.cuda` (`TOOL_IMPORTS_ALLOWED`).
"""

import ast
import inspect
import os
import pathlib
import subprocess
import sys

import pytest

import elastic_np
from elastic_np import cpu, cuda, reference
from elastic_np._contract._backend import FACE, Backend
from elastic_np.cli import _cuda_bench

PACKAGE = pathlib.Path(elastic_np.__file__).resolve().parent
REPO_ROOT = PACKAGE.parent

#: The packages every backend may import: the contract, and the user variants it carries (`elastic_np._variants`).
SHARED = {"elastic_np._contract", "elastic_np._variants"}
#: What each backend may import besides its own package and `SHARED`.
BACKEND_EXTRA = {"reference": set(), "cpu": {"elastic_np.reference"}, "cuda": {"elastic_np.reference"}}
#: Library files that import the tools: the entry scripts, and the deprecated `elastic_np.cuda.bench`.
TOOL_IMPORTS_ALLOWED = {
    "__main__.py": {"elastic_np.cli"},
    "cuda/__main__.py": {"elastic_np.cli._cuda"},
    "cuda/__init__.py": {"elastic_np.cli._cuda_bench"},
}


def _imports(path):
    """Every ``elastic_np`` module that the file at ``path`` imports, anywhere in it, by ``import``,
    ``from ... import`` or ``importlib.import_module`` with a literal name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            if node.module == "elastic_np":  # ``from elastic_np import _problem``: elastic_np._contract._problem
                found.update(f"elastic_np.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(node.args[0].value)
    return {name for name in found if name == "elastic_np" or name.startswith("elastic_np.")}


def _within(name, packages):
    return any(name == p or name.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("backend", sorted(BACKEND_EXTRA))
def test_backends_import_nothing_above_them(backend):
    allowed = SHARED | BACKEND_EXTRA[backend] | {f"elastic_np.{backend}"}
    reaching_up = {}
    for path in sorted((PACKAGE / backend).rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        names = _imports(path) - TOOL_IMPORTS_ALLOWED.get(rel, set())
        bad = sorted(n for n in names if not _within(n, allowed))
        if bad:
            reaching_up[rel] = bad
    assert not reaching_up, f"backend modules importing above their layer: {reaching_up}"


def test_nothing_of_the_library_imports_the_tools():
    importers = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("cli/"):
            continue
        names = _imports(path) - TOOL_IMPORTS_ALLOWED.get(rel, set())
        bad = sorted(n for n in names if _within(n, {"elastic_np.cli"}))
        if bad:
            importers[rel] = bad
    assert not importers, f"library modules importing the tools: {importers}"


def test_the_import_check_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import numpy\n\ndef f():\n    from elastic_np import _bench, reference\n"
                      "    import elastic_np.cli\n    importlib.import_module('elastic_np.cli._cuda')\n")
    assert _imports(source) == {"elastic_np._bench", "elastic_np.reference", "elastic_np.cli",
                                "elastic_np.cli._cuda"}


@pytest.mark.parametrize("module", [reference, cpu, cuda], ids=lambda m: m.__name__)
def test_every_backend_shows_the_same_face(module):
    assert isinstance(module, Backend), f"{module.__name__} lacks {[n for n in FACE if not hasattr(module, n)]}"
    assert module.dtypes is None or all(isinstance(d, str) for d in module.dtypes)  # names: bfloat16 is ml_dtypes'
    for name in FACE[1:]:
        assert callable(getattr(module, name)), f"{module.__name__}.{name}"
    # the parameters after the first (the problem, ``p`` or ``problem``)
    same = {"is_available": None, "check_available": None, "forward": [],
            "backward": ["dout", "out", "lse", "dlse"], "check_backward_arrays": ["dout", "out", "lse", "dtype", "dlse"]}
    for name, params in same.items():
        got = list(inspect.signature(getattr(module, name)).parameters)
        assert (got == [] if params is None else got[1:] == params), f"{module.__name__}.{name}{got}"
    prepare = inspect.signature(module.prepare).parameters
    assert list(prepare)[:3] == ["q", "k", "v"]
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in prepare.values())


def test_the_reference_face_stays_out_of_its_public_names():
    assert not set(FACE) & set(reference.__all__)
    assert reference.is_available() and reference.check_available() is None
    assert elastic_np._api.dispatch.get_backend("reference") is reference


def test_the_dispatcher_gets_each_backend_module():
    assert elastic_np._api.dispatch.get_backend("cpu") is cpu


@pytest.mark.parametrize("name", ["bench", "bench_decode", "bench_record", "BENCH_BIAS_SHAPES", "DECODE_SHAPES"])
def test_the_gpu_benchmark_names_of_elastic_np_cuda_are_deprecated(name):
    with pytest.warns(DeprecationWarning, match="elastic-np bench --gpu"):
        value = getattr(cuda, name)
    assert value is getattr(_cuda_bench, name)
    assert name not in cuda.__all__


def test_the_other_public_names_of_the_flat_cuda_module_are_deprecated():
    from elastic_np.cuda._runtime import config as _config

    with pytest.warns(DeprecationWarning, match="use elastic_np.BackendUnavailableError"):
        assert cuda.BackendUnavailableError is elastic_np.BackendUnavailableError
    with pytest.warns(DeprecationWarning, match="elastic_np.cuda._runtime.config"):
        assert cuda.config is _config


def test_elastic_np_cuda_has_no_other_missing_names():
    with pytest.raises(AttributeError, match="no attribute '_tiles'"):
        cuda._tiles  # noqa: B018  (the private names it re-exported are gone)


def test_importing_the_package_and_its_tools_imports_no_optional_dependency():
    optional = ["torch", "jax", "dask", "transformers", "numba.cuda", "numba_cuda", "matplotlib"]
    code = ("import sys, elastic_np; tools_before = 'elastic_np.cli' in sys.modules; "
            "import elastic_np.cli, elastic_np.cuda; "
            f"loaded = [m for m in {optional!r} if m in sys.modules]; "
            "sys.exit(f'{tools_before} {loaded}' if tools_before or loaded else 0)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _package_of(module):
    """The dotted package a module name (or a package's own name) belongs to."""
    path = REPO_ROOT / module.replace(".", "/")
    return module if path.is_dir() else module.rsplit(".", 1)[0]


def private_names_across_packages(path):
    """``"line: what"`` for each private name (leading underscore) that the module at ``path`` takes from
    another package than its own, by import or as an attribute of a module it imported, other than from
    the contract (`SHARED`), which is the package's private core."""
    own = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts[:-1])
    tree, found, foreign = ast.parse(path.read_text(), str(path)), [], {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("elastic_np")):
            continue
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            is_module = (REPO_ROOT / full.replace(".", "/")).with_suffix(".py").exists() or (
                REPO_ROOT / full.replace(".", "/")).is_dir()
            home = _package_of(full) if is_module else _package_of(node.module)
            if home == own or _within(home, SHARED):
                continue
            if alias.name.startswith("_"):
                found.append(f"{node.lineno}: from {node.module} import {alias.name}")
            if is_module:
                foreign[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in foreign
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_packages_share_no_private_names_but_the_contract():
    found = {path.relative_to(PACKAGE).as_posix(): names for path in sorted(PACKAGE.rglob("*.py"))
             if (names := private_names_across_packages(path))}
    assert not found, f"private names taken from another package: {found}"


def test_the_private_name_check_sees_imports_and_attributes(tmp_path, monkeypatch):
    module = PACKAGE / "torch" / "_probe_module.py"
    source = ("from elastic_np._api import dispatch\nfrom elastic_np.cpu import _runtime\n"
              "from elastic_np._contract import _spec\nfrom elastic_np.torch import _arrays\n"
              "dispatch._problem\n_spec._private\n_arrays._x\n")
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: source if self == module else "")
    assert private_names_across_packages(module) == [
        "2: from elastic_np.cpu import _runtime", "5: dispatch._problem"]
