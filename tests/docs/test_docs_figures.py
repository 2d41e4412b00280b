"""Every measured figure of the README and the docs is the one its recorded results file gives.

``docs/scripts/figures.py`` fills the figures in from ``docs/performance/``;
these tests fail when a figure in the text is not its file's, when a figure
is typed outside the markers, or when a results file does not say which
command, machine and commit gave it.
"""

import copy
import json
import pathlib
import re
import runpy
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FIGURES = runpy.run_path(str(ROOT / "docs" / "scripts" / "figures.py"))


def _records():
    return {path: json.loads((FIGURES["RESULTS"] / path).read_text())
            for path in {spec[0] for spec in FIGURES["FIGURES"].values()}}


def test_every_figure_in_the_text_is_its_results_files():
    assert FIGURES["stale"]() == [], "run python docs/scripts/figures.py"


def test_every_figure_named_in_the_text_is_known_and_every_known_one_is_used():
    assert FIGURES["used"]() == set(FIGURES["FIGURES"])


def test_a_figure_edited_by_hand_is_caught_in_the_readme_and_in_a_page():
    text = README.read_text()
    marker = next(FIGURES["MARKDOWN"].finditer(text))
    edited = text[:marker.start("text")] + "1.23" + text[marker.end("text"):]
    assert edited != text and FIGURES["rendered_markdown"](edited) == text
    page = (ROOT / "docs" / "models.rst").read_text()
    edited = re.sub(r"(\.\. \|fig-compile-step\| replace:: )[^\n]+", r"\g<1>0.50 (0.10-0.90)", page)
    assert edited != page and FIGURES["rendered_rst"](edited) == page


def test_a_new_record_changes_the_figure():
    records = _records()
    before = FIGURES["figure"]("fig-torch-f32-fwd", records)
    changed = copy.deepcopy(records)
    changed["runs/cpu-vs-torch.json"]["figures"]["float32 fwd torch/ours"].update(median=9.876, min=0.5, max=12.0)
    assert FIGURES["figure"]("fig-torch-f32-fwd", changed) == "9.88 (0.50-12.00)" != before


def test_a_page_without_a_figures_block_gets_one_with_the_definitions_it_uses():
    text = "Title\n=====\n\nIt took |fig-compile-step| here.\n"
    rendered = FIGURES["rendered_rst"](text)
    definition = f".. |fig-compile-step| replace:: {FIGURES['figure']('fig-compile-step')}\n"
    assert rendered.startswith(text) and definition in rendered and rendered.endswith(".. figures: end\n")
    assert FIGURES["rendered_rst"](rendered) == rendered
    assert FIGURES["rendered_rst"]("No figure here.\n") == "No figure here.\n"


def test_every_results_file_says_what_ran_where_and_when():
    for path, record in _records().items():
        assert record["command"].startswith("python "), path
        assert record["machine"], path
        if path.startswith("runs/"):  # the scripts of benchmarks/ with --json
            assert (ROOT / record["script"]).exists() and record["command"].split()[1] == record["script"]
            assert re.fullmatch(r"\d{4}-\d\d-\d\d", record["date"]) and record["commit"], path
            assert {"cpu", "cores", "simd_bits", "amx"} <= set(record["machine"]), path


def test_the_processor_reads_as_the_text_names_it():
    xeon = {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "simd_bits": 512, "amx": True}
    epyc = {"cpu": "AMD EPYC 7B13 64-Core Processor", "cores": 2, "simd_bits": 256}
    assert FIGURES["describe_cpu"](xeon) == "2-core Intel Xeon (AVX-512, AMX)"
    assert FIGURES["describe_cpu"](epyc) == "2-core AMD EPYC 7B13 64-Core (AVX2)"


def _readme_prose():
    """The README without its code blocks, code spans, links' targets and figures."""
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    text = FIGURES["MARKDOWN"].sub("FIGURE", text)
    text = re.sub(r"`[^`]*`", "CODE", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def test_the_readme_types_no_measured_figure_outside_the_markers():
    prose = _readme_prose()
    measured = re.findall(r"\b\d+(?:\.\d+)?\s?(?:s|ms|us|ns|GB/s|GFLOP/s|TFLOP/s|MiB|GiB|x)\b"
                          r"|\b\d+\.\d+\b(?!\.)|\b\d+(?:\.\d+)? times\b", prose)
    # the conformance kit's own promise, not a measurement
    allowed = {"0.1"}
    assert [m for m in measured if m not in allowed] == []


def test_no_readme_line_starts_with_a_figure():
    """A Markdown line starting with ``<!--`` opens an HTML block: the figure would break its paragraph."""
    for line in README.read_text().splitlines():
        assert not line.lstrip().startswith("<!-- figure"), line


def test_cpu_vs_torch_records_the_figures_the_text_reads(tmp_path):
    """The script's ``--json`` file holds every value `FIGURES` reads from it."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cpu_vs_torch
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    path = tmp_path / "cpu-vs-torch.json"
    cpu_vs_torch.main(["--n", "32", "--heads", "1", "--dim", "8", "--rounds", "2", "--repeat", "1", "--no-naive",
                       "--json", str(path)])
    record = json.loads(path.read_text())
    assert record["command"].endswith(f"--json {path}") and record["rounds"] == 2
    for name, (source, value, text) in FIGURES["FIGURES"].items():
        if source == "runs/cpu-vs-torch.json":
            assert FIGURES["figure"](name, {source: record})
    ratio = record["figures"]["float32 fwd torch/ours"]
    seconds = np.array(record["seconds"]["float32 torch fwd"]) / np.array(record["seconds"]["float32 fwd"])
    assert ratio["n"] == 2 and ratio["median"] == pytest.approx(np.median(seconds))
