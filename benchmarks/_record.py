"""A benchmark's results file: what ran, where, when, and its figures, for ``docs/performance/``.

The scripts that feed the README's and the docs' figures write one with
``--json PATH``; ``docs/scripts/figures.py`` reads the figures from it, so
that a figure in the text is always the one a recorded run gave.
"""

import datetime
import json
import os
import subprocess
import sys

import numpy as np


def machine():
    """`elastic_np.cli._bench.machine_info` with whether a bfloat16 prefill runs on AMX tiles here."""
    from elastic_np.cli import _bench
    from elastic_np.cpu._tiles import amx as _amx

    return {**_bench.machine_info(), "amx": bool(_amx.permitted())}


def commit():
    """The checkout's commit, with ``-dirty`` when its files differ from it (None outside git)."""
    try:
        result = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True,
                                text=True, check=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.CalledProcessError):
        return None
    return result.stdout.strip()


def measured():
    """The commit of the `elastic_np` imported (``PYTHONPATH`` may name another tree than the script's)."""
    import elastic_np

    where = os.path.dirname(os.path.dirname(os.path.abspath(elastic_np.__file__)))
    try:
        return subprocess.run(["git", "-C", where, "describe", "--always", "--dirty", "--abbrev=12"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return where


def summary(values):
    """``{"median", "min", "max", "n"}`` of ``values`` (per-round figures)."""
    values = np.asarray(values, dtype=float)
    return {"median": float(np.median(values)), "min": float(values.min()), "max": float(values.max()),
            "n": int(values.size)}


def write(path, script, argv, figures, **details):
    """Write ``script``'s record to ``path``: its command (``argv``), machine, date, commit and ``figures``.

    ``load_average`` is the machine's at the end (1, 5 and 15 minutes), the
    work of other processes the figures shared the cores with.
    """
    argv = sys.argv[1:] if argv is None else argv
    record = {"script": script, "command": "python " + " ".join([script, *argv]),
              "date": datetime.date.today().isoformat(), "commit": commit(), "machine": machine(),
              "load_average": [round(x, 2) for x in os.getloadavg()], "figures": figures, **details}
    with open(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    return record
