"""Sphinx configuration for the elastic_np documentation.

The build is strict (``sphinx-build -W --keep-going``) and works offline: no
intersphinx. Figures are drawn at build time by the scripts in
``docs/scripts`` into ``docs/generated`` (not committed); generated text (the
CLI's help, the performance tables) is kept in the pages themselves
(``docs/scripts/rendered_blocks.py``), and a stale block fails the build.
"""

import importlib.util
import os
import runpy
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
# Document the package of this checkout, not whichever one is installed.
sys.path.insert(0, ROOT)

import elastic_np  # noqa: E402

project = "elastic_np"
author = "The elastic_np developers"
copyright = "the elastic_np developers"
version = release = elastic_np.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
]

exclude_patterns = ["_build", "scripts", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

# `name` in a docstring links to the object when it is documented and is set
# in monospace otherwise (as in NumPy and SciPy).
default_role = "autolink"

autosummary_generate = True
autosummary_imported_members = False
autodoc_typehints = "none"
autodoc_default_options = {"members": False}
# The framework adapters' pages build without the frameworks installed.
autodoc_mock_imports = [name for name in ("torch", "jax") if importlib.util.find_spec(name) is None]

numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

html_theme = "pydata_sphinx_theme"
html_title = f"elastic_np {release}"
html_static_path = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_sidebars = {"**": ["sidebar-nav-bs"]}

# MathJax is loaded from its default URL by the browser; the build itself
# needs no network.
mathjax3_config = {"tex": {"macros": {"lse": r"\operatorname{lse}"}}}


def _draw_figures(app):
    """Run every figure script in docs/scripts into docs/generated."""
    out = os.path.join(DOCS, "generated")
    os.makedirs(out, exist_ok=True)
    for name in ("plot_window_gate.py", "performance.py", "module_map.py"):
        module = runpy.run_path(os.path.join(DOCS, "scripts", name))
        module["main"](out)
    stale = runpy.run_path(os.path.join(DOCS, "scripts", "rendered_blocks.py"))["stale"]()
    if stale:
        raise RuntimeError(f"stale generated text in {', '.join(stale)}: run python docs/scripts/rendered_blocks.py")


def _remove_stale_stubs(app):
    """Delete autosummary stubs of earlier builds (a removed name would warn)."""
    out = os.path.join(DOCS, "generated")
    if os.path.isdir(out):
        for name in os.listdir(out):
            if name.endswith(".rst"):
                os.remove(os.path.join(out, name))


def setup(app):
    # Runs before autosummary writes the stubs of this build (priority 500).
    app.connect("builder-inited", _remove_stale_stubs, priority=100)
    app.connect("builder-inited", _draw_figures)
