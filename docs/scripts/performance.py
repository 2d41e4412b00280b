"""Render the performance page's figures and tables from saved benchmark results.

Run by ``docs/conf.py`` at build time; also usable by hand::

    python docs/scripts/performance.py OUTDIR

It reads every ``docs/performance/*.json``, each written unchanged by
``elastic-np bench --json FILE`` (keys ``machine``, ``command``, ``config``,
``matmul_peak_gflops``, ``results``, ...), and writes
``OUTDIR/performance_results.inc``, which the performance page includes: per
file the machine, the command, the table ``elastic-np bench`` printed and its
log-log plot, both drawn by the same code the command uses
(`elastic_np._bench.format_table`, `elastic_np._bench.plot`). Without result
files the include says so: no figure on that page is ever typed in by hand.
"""

import glob
import json
import os
import sys

from elastic_np import _bench

DOCS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(DOCS, "performance")

NO_RESULTS = """\
.. note::

   No benchmark results are stored in ``docs/performance/`` in this version of the
   documentation, so this section shows no figures. Produce them with the steps in
   :ref:`perf-reproduce`.
"""


def main(outdir, results_dir=RESULTS):
    """Write ``performance_results.inc`` (and plots) for the files in ``results_dir``."""
    os.makedirs(outdir, exist_ok=True)
    parts = []
    for n, name in enumerate(sorted(glob.glob(os.path.join(results_dir, "*.json")))):
        with open(name) as fh:
            run = json.load(fh)
        stem = os.path.splitext(os.path.basename(name))[0]
        title = f"``{stem}``"
        parts.append(f"{title}\n{'~' * len(title)}\n")
        if run.get("machine"):
            parts.append(f"Machine: ``{json.dumps(run['machine'], sort_keys=True)}``\n")
        if run.get("command"):
            parts.append(f"Command: ``{run['command']}``\n")
        if run.get("results"):
            png = f"performance_{n}.png"
            _bench.plot(run, os.path.join(outdir, png))
            parts.append(f".. image:: /generated/{png}\n   :alt: time against sequence length, {stem}\n")
            table = "\n".join("   " + line for line in _bench.format_table(run).splitlines())
            parts.append(f".. code-block:: text\n\n{table}\n")
    text = "\n".join(parts) if parts else NO_RESULTS
    path = os.path.join(outdir, "performance_results.inc")
    with open(path, "w") as fh:
        fh.write(text)
    return path


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "."))
