"""Write the ``--help`` text of ``elastic-np`` and each subcommand for the docs.

Run by ``docs/conf.py`` at build time, so the page always shows the options of
the checked-out version::

    python docs/scripts/cli_help.py OUTDIR
"""

import argparse
import os
import sys

from elastic_np import cli


def _help_texts():
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "88"  # argparse wraps to the terminal width
    try:
        parser = cli.build_parser()
        texts = [("elastic-np", parser.format_help())]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    texts.append((f"elastic-np {name}", sub.format_help()))
        return texts
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def main(outdir):
    os.makedirs(outdir, exist_ok=True)
    parts = []
    for title, text in _help_texts():
        parts.append(f"``{title} --help``::\n")
        parts.append("\n".join("   " + line if line else "" for line in text.rstrip().splitlines()) + "\n")
    path = os.path.join(outdir, "cli_help.inc")
    with open(path, "w") as fh:
        fh.write("\n".join(parts))
    return path


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "."))
