"""Render the performance page's figures and tables from saved benchmark results.

Run by ``docs/conf.py`` at build time; also usable by hand::

    python docs/scripts/performance.py OUTDIR

It reads every ``docs/performance/*.json`` (written by
``elastic-np bench --json FILE``) and writes ``OUTDIR/performance_results.inc``,
which the performance page includes, plus one plot per results file. Without
result files the include says so: no figure on that page is ever typed in by
hand.

Expected layout of a results file (one run on one machine)::

    {
      "machine": {"cpu": "...", "cores": 2, "gpu": null, ...},   # free-form, shown as given
      "command": "elastic-np bench --seq 512 1024 2048 --json ...",
      "results": [
        {"implementation": "elastic_np cpu", "pass": "forward", "dtype": "float32",
         "B": 1, "H": 8, "N": 2048, "M": 2048, "D": 64, "causal": false,
         "time_s": 0.0123, "gflops": 180.0},
        ...
      ]
    }
"""

import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(DOCS, "performance")

NO_RESULTS = """\
.. note::

   No benchmark results are stored in ``docs/performance/`` in this version of the
   documentation, so this section shows no figures. Produce them with the steps in
   :ref:`perf-reproduce`.
"""


def _table(rows):
    """A reStructuredText list-table of the result records."""
    cols = ["implementation", "pass", "dtype", "N", "M", "D", "causal", "time_s", "gflops"]
    lines = [".. list-table::", "   :header-rows: 1", ""]
    lines.append("   * - " + "\n     - ".join(cols))
    for r in rows:
        cells = []
        for c in cols:
            value = r.get(c, "")
            if c == "time_s" and value != "":
                value = f"{1e3 * float(value):.3g} ms"
            elif c == "gflops" and value != "":
                value = f"{float(value):.1f}"
            cells.append(str(value) if value != "" else "--")
        lines.append("   * - " + "\n     - ".join(cells))
    return "\n".join(lines) + "\n"


def _plot(rows, path, title):
    fig, ax = plt.subplots(figsize=(6, 3.8), constrained_layout=True)
    series = {}
    for r in rows:
        key = (r.get("implementation", "?"), r.get("pass", ""), r.get("dtype", ""))
        series.setdefault(key, []).append((int(r["N"]), float(r["time_s"])))
    for (impl, kind, dtype), points in sorted(series.items()):
        points.sort()
        ax.loglog([p[0] for p in points], [p[1] for p in points], "o-",
                  label=f"{impl} ({kind}, {dtype})")
    ax.set_xlabel("sequence length N = M")
    ax.set_ylabel("time (s)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="x-small")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(outdir, results_dir=RESULTS):
    """Write ``performance_results.inc`` (and plots) for the files in ``results_dir``."""
    os.makedirs(outdir, exist_ok=True)
    files = sorted(glob.glob(os.path.join(results_dir, "*.json")))
    parts = []
    for n, name in enumerate(files):
        with open(name) as fh:
            run = json.load(fh)
        rows = run.get("results", [])
        stem = os.path.splitext(os.path.basename(name))[0]
        title = f"``{stem}``"
        parts.append(f"{title}\n{'~' * len(title)}\n")
        machine = run.get("machine")
        if machine:
            parts.append(f"Machine: ``{json.dumps(machine, sort_keys=True)}``\n")
        if run.get("command"):
            parts.append(f"Command: ``{run['command']}``\n")
        if rows and all("N" in r and "time_s" in r for r in rows):
            png = f"performance_{n}.png"
            _plot(rows, os.path.join(outdir, png), stem)
            parts.append(f".. image:: /generated/{png}\n   :alt: time against sequence length, {stem}\n")
        if rows:
            parts.append(_table(rows))
    text = "\n".join(parts) if parts else NO_RESULTS
    path = os.path.join(outdir, "performance_results.inc")
    with open(path, "w") as fh:
        fh.write(text)
    return path


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "."))
