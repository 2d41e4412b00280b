"""Docstring examples and the examples in the documentation pages run as doctests.

Every module of the package is imported and its examples run. A CUDA module
whose optional package is missing is skipped; any other import error fails.
"""

import doctest
import gc
import importlib
import pathlib
import pkgutil
import sys

import numpy as np
import pytest

import elastic_np

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Every module of the package and its subpackages (``__main__`` would run the tool).
MODULES = ["elastic_np"] + sorted(
    m.name for m in pkgutil.walk_packages(elastic_np.__path__, "elastic_np.")
    if m.name != "elastic_np.__main__"
)


def _optional(modname):
    """The CUDA modules, the framework adapters (and their private parts) and `elastic_np.dask` need an optional extra."""
    name = modname.rpartition(".")[2]
    return "cuda" in modname or name in ("torch", "jax", "dask", "transformers") or name.startswith("_torch_")


FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


#: Packages a module's examples import beyond those the module itself does (it imports them lazily).
EXAMPLES_NEED = {"elastic_np.transformers": ("transformers",)}


def _import(modname):
    for package in EXAMPLES_NEED.get(modname, ()):
        pytest.importorskip(package, reason=f"{modname}'s examples need {package}")
    try:
        return importlib.import_module(modname)
    except ImportError as exc:
        if not _optional(modname):
            raise
        pytest.skip(f"{modname} needs an optional package that is missing: {exc}")


def _run(tests):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    printopts = np.get_printoptions()
    try:
        for test in tests:
            runner.run(test)
    finally:
        np.set_printoptions(**printopts)
    return runner.summarize(verbose=False)


@pytest.mark.parametrize("modname", MODULES)
def test_module_docstring_examples(modname):
    module = _import(modname)
    tests = [t for t in doctest.DocTestFinder().find(module, modname) if t.examples]
    result = _run(tests)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {modname}"


def test_public_functions_have_examples():
    """Every public function of the documented modules shows an example."""
    missing = []
    for modname in ("elastic_np", "elastic_np.reference", "elastic_np.testing"):
        module = importlib.import_module(modname)
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and not isinstance(obj, type):
                if ">>>" not in (obj.__doc__ or ""):
                    missing.append(f"{modname}.{name}")
    assert elastic_np.reference.__all__
    assert not missing, f"public functions without an example: {missing}"


def test_public_functions_document_parameters_and_returns():
    """numpydoc sections that the API pages render for every public function."""
    docscrape = pytest.importorskip("numpydoc.docscrape")
    incomplete = []
    for modname in ("elastic_np", "elastic_np.reference", "elastic_np.testing"):
        module = importlib.import_module(modname)
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and not isinstance(obj, type):
                doc = docscrape.FunctionDoc(obj)
                lacking = [s for s in ("Parameters", "Returns", "Examples") if not doc[s]]
                if lacking:
                    incomplete.append(f"{modname}.{name}: {lacking}")
    assert not incomplete, f"docstrings without required sections: {incomplete}"


PAGES = sorted(p.name for p in DOCS.glob("*.rst"))
#: Pages whose examples need optional packages: skipped without them.
PAGE_NEEDS = {"frameworks.rst": ("torch", "jax"), "dask.rst": ("dask", "distributed"),
              "models.rst": ("torch", "transformers")}
#: Examples of other pages marked ``# doctest: +NEEDS_TORCH`` need torch: left out without it, the rest runs.
EXAMPLE_NEEDS = {doctest.register_optionflag("NEEDS_TORCH"): "torch"}


def _missing(package):
    try:
        importlib.import_module(package)
    except ImportError:
        return True
    return False


@pytest.mark.parametrize("page", PAGES)
def test_documentation_page_examples(page):
    for package in PAGE_NEEDS.get(page, ()):
        pytest.importorskip(package)
    text = (DOCS / page).read_text()
    parser = doctest.DocTestParser()
    test = parser.get_doctest(text, {}, page, str(DOCS / page), 0)
    absent = [flag for flag, package in EXAMPLE_NEEDS.items() if _missing(package)]
    test.examples = [e for e in test.examples if not any(e.options.get(flag) for flag in absent)]
    try:
        result = _run([test])
    finally:  # the page's objects released here: a model torch.compile traced, collected later, runs dynamo's
        if "torch._dynamo" in sys.modules:  # weakref callbacks in whatever test then runs (one raised
            sys.modules["torch._dynamo"].reset()  # inside another test's ast.parse, a SystemError there)
        test.globs.clear()
        gc.collect()
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in docs/{page}"
