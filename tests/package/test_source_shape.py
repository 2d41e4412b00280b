"""The package's functions stay small enough to hold in one's head.

Outside the kernels, no function over 60 lines of code or of cyclomatic
complexity over 15 (radon's measure); a kernel (a function compiled by Numba
or numba.cuda, or an intrinsic's code generator) at most 80 lines. Lines of
code leave out the docstring, blank lines, comments and nested functions
(measured on their own).
"""

import ast
import pathlib

import pytest

import elastic_np

radon_complexity = pytest.importorskip("radon.complexity")

PACKAGE = pathlib.Path(elastic_np.__file__).parent
KERNEL_DECORATORS = {"njit", "jit", "_typed", "inner", "intrinsic", "overload", "cfunc"}
MAX_LINES, MAX_KERNEL_LINES, MAX_COMPLEXITY = 60, 80, 15


def code_lines(node, lines):
    """Lines of code of function ``node``: no docstring, blank or comment line, no nested function."""
    skip = set()
    if ast.get_docstring(node, clean=False) is not None:
        skip |= set(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    for inner in ast.walk(node):
        if inner is not node and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skip |= set(range(inner.lineno, inner.end_lineno + 1))
    return sum(1 for i in range(node.lineno, node.end_lineno + 1)
               if i not in skip and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))


def is_kernel(node):
    if node.name == "codegen":  # a Numba intrinsic's code generator
        return True
    for decorator in node.decorator_list:
        f = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) in KERNEL_DECORATORS:
            return True
    return False


def _complexities(source):
    found = {}
    for block in radon_complexity.cc_visit(source):
        for b in [block, *getattr(block, "methods", ()), *getattr(block, "closures", ())]:
            found[(b.name, b.lineno)] = b.complexity
    return found


def oversized(path, root=PACKAGE):
    """``"path:line name: why"`` for each function of ``path`` over the limits."""
    source = path.read_text()
    lines, complexity = source.splitlines(), _complexities(source)
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        n, kernel = code_lines(node, lines), is_kernel(node)
        cc = complexity.get((node.name, node.lineno), 0)
        if n > (MAX_KERNEL_LINES if kernel else MAX_LINES) or (not kernel and cc > MAX_COMPLEXITY):
            found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {n} lines, complexity {cc}"
                         + (" (kernel)" if kernel else ""))
    return found


def test_no_function_is_over_the_limits():
    found = [entry for path in sorted(PACKAGE.rglob("*.py")) for entry in oversized(path)]
    assert not found, "functions over the limits:\n" + "\n".join(found)


def test_the_measure_sees_a_long_and_a_branchy_function(tmp_path):
    long = "def f():\n    '''doc'''\n" + "".join(f"    x{i} = {i}\n" for i in range(60))
    branchy = "def g(x):\n" + "".join(f"    if x == {i}:\n        return {i}\n" for i in range(15))
    kernel = "@njit\ndef h():\n" + "".join(f"    x{i} = {i}\n" for i in range(70))
    path = tmp_path / "probe.py"
    path.write_text(long + "\n\n" + branchy + "\n\n" + kernel)
    found = oversized(path, tmp_path)
    assert [entry.split(": ")[0].split(" ")[1] for entry in found] == ["f", "g"]
    assert "61 lines" in found[0] and "complexity 16" in found[1]


#: No module of the package is longer than this (lines, everything counted).
MAX_MODULE_LINES = 600


def test_no_module_is_over_the_limit():
    long = {path.relative_to(PACKAGE).as_posix(): n for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
