"""Write the map of the package's modules, each with the first line of its docstring.

Run by ``docs/conf.py`` at build time (``docs/architecture.rst`` includes the
result), so the map is the checked-out tree's; ``python docs/scripts/module_map.py``
prints it. `entries` is what ``tests/package/test_module_map.py`` checks: every
module has a first docstring line.
"""

import ast
import os
import pathlib
import sys
import textwrap

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "elastic_np"
#: Where the description starts, and the width it wraps to.
COLUMN, WIDTH = 34, 108


def first_line(path):
    """The first line of the module's docstring ("" without one)."""
    docstring = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    return docstring.strip().splitlines()[0].strip() if docstring and docstring.strip() else ""


def _modules(folder):
    """The folder's ``__init__.py``, then its modules, then its subpackages, each sorted by name."""
    files = sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")
    packages = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    return files, packages


def entries(folder=PACKAGE, depth=0):
    """``(depth, name, path, first line)`` for every module and package under ``folder``, in map order
    (a package's line is its ``__init__.py``'s)."""
    rows = [(depth, folder.name + "/", folder / "__init__.py", first_line(folder / "__init__.py"))]
    files, packages = _modules(folder)
    rows += [(depth + 1, path.name, path, first_line(path)) for path in files]
    for package in packages:
        rows += entries(package, depth + 1)
    return rows


def render(rows):
    """The map as an reStructuredText text block."""
    lines = [".. code-block:: text", ""]
    for depth, name, _, line in rows:
        label = "   " + "  " * depth + name
        text = line.rstrip(".").replace("``", "").replace("`", "")
        wrapped = textwrap.wrap(text, WIDTH - COLUMN) or [""]
        if len(label) >= COLUMN:
            lines.append(label)
            lines += [" " * COLUMN + part for part in wrapped]
        else:
            lines.append(label.ljust(COLUMN) + wrapped[0])
            lines += [" " * COLUMN + part for part in wrapped[1:]]
    return "\n".join(lines) + "\n"


def main(outdir):
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "module_map.inc")
    with open(path, "w") as f:
        f.write(render(entries()))
    return path


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(main(sys.argv[1]))
    else:
        sys.stdout.write(render(entries()))
