"""The README's measured figures, rendered from the benchmark results they come from.

A block of the README between the lines ::

    <!-- figures: docs/performance/NAME.json -->
    <!-- end figures -->

holds what ``elastic-np bench`` printed for that run: the machine it ran on
and the table, rendered from the stored file by the code the command prints
with (`elastic_np.cli._bench.format_table`). Nothing between the markers is
typed by hand::

    python docs/scripts/readme_figures.py           # rewrite the blocks
    python docs/scripts/readme_figures.py --check   # exit 1 when a block is stale

``tests/test_docs.py`` runs the check.
"""

import json
import pathlib
import re
import sys

from elastic_np.cli import _bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- figures: (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- end figures -->)", re.S)


def render(record):
    """The README text of one ``elastic-np bench --json`` record: its machine, command and table."""
    machine = record["machine"]
    simd = f"{machine['simd_bits']}-bit SIMD" + (" with FMA" if machine.get("fma") else "")
    versions = ", ".join(f"{name} {machine[name]}" for name in ("numpy", "numba", "torch") if machine.get(name))
    return (
        f"{machine['cpu']}, {machine['cores']} cores ({simd}; {machine['numba_threads']} kernel threads), "
        f"Python {machine['python']}, {versions}; `{record['command']}`:\n\n"
        f"```text\n{_bench.format_table(record)}\n```\n"
    )


def rendered(text=None):
    """The README's text with every figures block rendered from its file."""
    text = README.read_text() if text is None else text

    def block(match):
        record = json.loads((ROOT / match["path"]).read_text())
        return match.group(1) + render(record) + match.group(4)

    return BLOCK.sub(block, text)


def stale():
    """The paths of the blocks that differ from their files' rendering."""
    text = README.read_text()
    fresh = rendered(text)
    return [m["path"] for m, n in zip(BLOCK.finditer(text), BLOCK.finditer(fresh)) if m["body"] != n["body"]]


def main(argv):
    if "--check" in argv:
        paths = stale()
        for path in paths:
            print(f"README.md: the figures of {path} are stale: run python docs/scripts/readme_figures.py")
        return 1 if paths else 0
    README.write_text(rendered())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
