"""Generated text kept in the pages themselves, so that they read whole on GitHub as in the built docs.

A block of a page between the comment lines ::

    .. rendered: NAME
    .. end rendered

holds what generator ``NAME`` (`GENERATORS`) writes: the ``--help`` of every
``elastic-np`` subcommand, taken from the tool, and the performance tables,
rendered from the results files of ``docs/performance/``. Nothing between
the markers is typed by hand::

    python docs/scripts/rendered_blocks.py           # rewrite the blocks
    python docs/scripts/rendered_blocks.py --check   # exit 1 when a block is stale

``tests/docs/test_docs.py`` runs the check.
"""

import pathlib
import re
import runpy
import sys
import tempfile

DOCS = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = DOCS / "scripts"
BLOCK = re.compile(r"(^\.\. rendered: (?P<name>\w+)\n)(?P<body>.*?)(^\.\. end rendered$)", re.S | re.M)


def _generated(script, filename, **kwargs):
    def generate():
        with tempfile.TemporaryDirectory() as out:
            runpy.run_path(str(SCRIPTS / script))["main"](out, **kwargs)
            return (pathlib.Path(out) / filename).read_text()

    return generate


#: Block name -> a function returning its text.
GENERATORS = {
    "cli_help": _generated("cli_help.py", "cli_help.inc"),
    "performance_results": _generated("performance.py", "performance_results.inc", plots=False),
    "performance_cuda": _generated("performance.py", "performance_cuda.inc", plots=False),
}


def rendered(text, cache=None):
    """``text`` with every block rendered by its generator (``cache``: name -> text already generated)."""
    cache = {} if cache is None else cache

    def block(match):
        name = match["name"]
        if name not in cache:
            cache[name] = GENERATORS[name]()
        return f"{match.group(1)}\n{cache[name].strip()}\n\n{match.group(4)}"

    return BLOCK.sub(block, text)


def pages():
    """The pages that hold a block."""
    return [page for page in sorted(DOCS.glob("*.rst")) if BLOCK.search(page.read_text())]


def stale():
    """``"page: block"`` for each block that differs from its generator's text."""
    cache, found = {}, []
    for page in pages():
        text = page.read_text()
        fresh = rendered(text, cache)
        for old, new in zip(BLOCK.finditer(text), BLOCK.finditer(fresh)):
            if old["body"] != new["body"]:
                found.append(f"{page.name}: {old['name']}")
    return found


def main(argv):
    if "--check" in argv:
        found = stale()
        for where in found:
            print(f"docs/{where} is stale: run python docs/scripts/rendered_blocks.py")
        return 1 if found else 0
    cache = {}
    for page in pages():
        page.write_text(rendered(page.read_text(), cache))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
