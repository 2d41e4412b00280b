"""Render the performance page's figures and tables from saved benchmark results.

Run by ``docs/conf.py`` at build time; also usable by hand::

    python docs/scripts/performance.py OUTDIR

It reads every ``docs/performance/*.json``, each written unchanged by a
benchmark command, and writes two files the performance page includes:

- ``OUTDIR/performance_results.inc``, from the files of ``elastic-np bench
  --json FILE`` (keys ``machine``, ``command``, ``config``,
  ``matmul_peak_gflops``, ``results``, ...): per file the machine, the
  command, the table ``elastic-np bench`` printed and its log-log plot, both
  drawn by the same code the command uses (`elastic_np.cli._bench.format_table`,
  `elastic_np.cli._bench.plot`);
- ``OUTDIR/performance_cuda.inc``, from the files of ``python -m
  elastic_np.cuda --bench --json FILE`` (``"kind": "cuda"``, see
  `elastic_np.cli._cuda_bench.bench_record`): per file the GPU, its driver and
  the library versions, the command, and the table the command printed
  (`elastic_np.cli._cuda_bench.format_table`: both timings, TFLOP/s and torch's
  time / ours for the training shape, then the decoding shapes).

Without result files of a kind, its include says so: no figure on that page
is ever typed in by hand.
"""

import glob
import json
import os
import sys

from elastic_np.cli import _bench

DOCS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(DOCS, "performance")

NO_RESULTS = """\
.. note::

   No CPU benchmark results are stored in ``docs/performance/`` in this version of the
   documentation, so this section shows no figures. Produce them with the steps in
   :ref:`perf-reproduce`.
"""

NO_CUDA_RESULTS = """\
.. note::

   No CUDA result file (``"kind": "cuda"``) is stored in ``docs/performance/`` in this
   version of the documentation: the speed of the CUDA kernels on a GPU is unmeasured,
   and this section shows no figures. Produce one with the command above.
"""


def _code_block(text):
    lines = "\n".join("   " + line if line else "" for line in text.splitlines())
    return f".. code-block:: text\n\n{lines}\n"


def _title(stem, underline):
    title = f"``{stem}``"
    return f"{title}\n{underline * len(title)}\n"


def _cpu_parts(run, stem, n, outdir, plots=True):
    parts = [_title(stem, "~")]
    if run.get("machine"):
        parts.append(f"Machine: ``{json.dumps(run['machine'], sort_keys=True)}``\n")
    if run.get("command"):
        parts.append(f"Command: ``{run['command']}``\n")
    if run.get("results"):
        png = f"performance_{n}.png"
        if plots:
            _bench.plot(run, os.path.join(outdir, png))
        parts.append(f".. image:: /generated/{png}\n   :alt: time against sequence length, {stem}\n")
        parts.append(_code_block(_bench.format_table(run)))
    return parts


def _cuda_parts(run, stem):
    from elastic_np.cli import _cuda_bench as cuda_bench

    parts = [_title(stem, "^")]
    machine = run.get("machine") or {}
    parts.append(f"GPU: {cuda_bench.machine_line(machine)}.\n")
    parts.append(f"Machine: ``{json.dumps(machine, sort_keys=True)}``\n")
    if run.get("command"):
        parts.append(f"Command: ``{run['command']}``\n")
    parts.append(_code_block(cuda_bench.format_table(run)))
    return parts


def main(outdir, results_dir=RESULTS, plots=True):
    """Write ``performance_results.inc`` and ``performance_cuda.inc`` (and plots) for the files in ``results_dir``.

    Returns the path of ``performance_results.inc``; ``performance_cuda.inc``
    is written beside it. Without ``plots``, the text alone (the image
    directives name the plots a build draws).
    """
    os.makedirs(outdir, exist_ok=True)
    cpu, gpu = [], []
    for n, name in enumerate(sorted(glob.glob(os.path.join(results_dir, "*.json")))):
        with open(name) as fh:
            run = json.load(fh)
        stem = os.path.splitext(os.path.basename(name))[0]
        if run.get("kind") == "cuda":
            gpu += _cuda_parts(run, stem)
        else:
            cpu += _cpu_parts(run, stem, n, outdir, plots)
    path = os.path.join(outdir, "performance_results.inc")
    for target, parts, empty in ((path, cpu, NO_RESULTS),
                                 (os.path.join(outdir, "performance_cuda.inc"), gpu, NO_CUDA_RESULTS)):
        with open(target, "w") as fh:
            fh.write("\n".join(parts) if parts else empty)
    return path


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "."))
