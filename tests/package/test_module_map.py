"""The map of the modules (``docs/scripts/module_map.py``, drawn into ``docs/architecture.rst``):
every module of the package says in its docstring's first line what it holds, and the map shows them all."""

import pathlib
import runpy

import elastic_np

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULE_MAP = runpy.run_path(str(ROOT / "docs" / "scripts" / "module_map.py"))
PACKAGE = pathlib.Path(elastic_np.__file__).resolve().parent


def test_every_module_has_a_first_docstring_line():
    missing = [str(path.relative_to(PACKAGE)) for _, _, path, line in MODULE_MAP["entries"]() if not line]
    assert not missing, f"modules without a docstring line (the module map shows it): {missing}"


def test_the_map_lists_every_module_once_with_its_line():
    rows = MODULE_MAP["entries"]()
    paths = sorted(path for _, _, path, _ in rows)
    assert paths == sorted(PACKAGE.rglob("*.py"))
    text = MODULE_MAP["render"](rows)
    for depth, name, _, line in rows:
        assert f"{'  ' * depth}{name}" in text
        assert line.split()[0].replace("`", "") in text


def test_a_module_without_a_docstring_is_seen(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text('"""The package."""\n')
    (package / "sub" / "__init__.py").write_text('"""A subpackage: its line."""\n')
    (package / "sub" / "told.py").write_text('"""What it holds.\n\nMore."""\nx = 1\n')
    (package / "silent.py").write_text("x = 1\n")
    rows = MODULE_MAP["entries"](package)
    assert [(depth, name, line) for depth, name, _, line in rows] == [
        (0, "pkg/", "The package."), (1, "silent.py", ""), (1, "sub/", "A subpackage: its line."),
        (2, "told.py", "What it holds.")]
