"""The measured figures of the README and the docs, each filled in from the results file of the run that gave it.

A figure is named in the text and written only by this script:

- in ``README.md``, between ``<!-- figure: NAME -->`` and ``<!-- /figure -->``;
- in ``docs/*.rst``, as the substitution ``|NAME|``, whose definition the
  script writes into the page's block between ``.. figures: begin`` and
  ``.. figures: end`` (the page's last lines).

`FIGURES` says, for each name, which file of ``docs/performance/`` holds it
(a results file a benchmark script wrote with ``--json``, or ``elastic-np
bench``'s / ``python -m elastic_np.cuda --bench``'s), which value of it, and
how it reads. The processor a figure was measured on is a figure too
(`describe_cpu`), so that the text names the machine of its record::

    python docs/scripts/figures.py           # rewrite the figures
    python docs/scripts/figures.py --check   # exit 1 when a figure is not its file's

``tests/docs/test_docs_figures.py`` runs the check.
"""

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "performance"
MARKDOWN = re.compile(r"<!-- figure: (?P<name>[\w-]+) -->(?P<text>.*?)<!-- /figure -->", re.S)
RST_USE = re.compile(r"(?<![\w|])\|(?P<name>fig-[\w-]+)\|(?![\w|])")
RST_BLOCK = re.compile(r"(^\.\. figures: begin\n)(?P<body>.*?)(^\.\. figures: end\n)", re.S | re.M)


def describe_cpu(machine):
    """``"2-core Intel Xeon (AVX-512, AMX)"``: a results file's processor, cores and vector units."""
    name = re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b|@.*$", "", machine["cpu"])
    name = re.sub(r"\s+", " ", name).strip()
    units = {512: "AVX-512", 256: "AVX2"}.get(machine.get("simd_bits"), f"{machine.get('simd_bits')}-bit SIMD")
    units += ", AMX" if machine.get("amx") else ""
    return f"{machine['cores']}-core {name} ({units})"


def _cuda_run(record, **config):
    """The ``runs`` entry of a CUDA results file whose config has ``config``'s items."""
    return next(run for run in record["runs"] if all(run["config"].get(k) == v for k, v in config.items()))


def _summary(*path):
    return lambda record: _get(record, ("figures", *path))


def _get(record, path):
    for key in path:
        record = record[key]
    return record


#: Ratios over interleaved rounds, and seconds over runs: the median and the range.
RATIO = "{median:.2f} ({min:.2f}-{max:.2f})"
SECONDS = "{median:.0f} s ({min:.0f}-{max:.0f} s)"


def _figures():
    check, cvt, step = "runs/first-check.json", "runs/cpu-vs-torch.json", "runs/torch-compile-step.json"
    first, h100, h200 = "runs/first-call.json", "h100-cuda.json", "h200-cuda.json"
    continuous = "runs/transformers-continuous-%s.json"
    cpu = (lambda record: describe_cpu(record["machine"]), "{}")
    return {
        "fig-check-cpu": (check, *cpu),
        "fig-check-fresh": (check, _summary("fresh cache"), SECONDS),
        "fig-check-filled": (check, _summary("filled cache"), SECONDS),
        "fig-check-fresh-cpu": (check, _summary("fresh cache cpu"), SECONDS),
        "fig-check-runs": (check, _summary("fresh cache", "n"), "{}"),
        "fig-check-date": (check, lambda record: record["date"], "{}"),
        "fig-first-cpu": (first, *cpu),
        "fig-first-forward": (first, _summary("installed", "forward"), "{median:.1f} s ({min:.1f}-{max:.1f})"),
        "fig-first-backward": (first, _summary("installed", "backward"), "{median:.1f} s ({min:.1f}-{max:.1f})"),
        "fig-first-decode": (first, _summary("installed", "decode"), "{median:.1f} s ({min:.1f}-{max:.1f})"),
        "fig-first-runs": (first, _summary("installed", "forward", "n"), "{}"),
        "fig-torch-cpu": (cvt, *cpu),
        "fig-torch-rounds": (cvt, lambda record: record["rounds"], "{}"),
        "fig-torch-f32-fwd": (cvt, _summary("float32 fwd torch/ours"), RATIO),
        "fig-torch-f32-fwdbwd": (cvt, _summary("float32 fwd+bwd torch/ours"), RATIO),
        "fig-torch-f64-fwd": (cvt, _summary("float64 fwd torch/ours"), RATIO),
        "fig-torch-f64-fwdbwd": (cvt, _summary("float64 fwd+bwd torch/ours"), RATIO),
        "fig-torch-causal": (cvt, _summary("float32 fwd full/causal"), RATIO),
        "fig-torch-elastic": (cvt, _summary("float32 fwd nvm+tau+beta/plain"), RATIO),
        "fig-compile-cpu": (step, *cpu),
        "fig-compile-step": (step, _summary("compiled/eager"), RATIO),
        "fig-compile-rounds": (step, lambda record: record["rounds"], "{}"),
        **_fixed_cost_figures(),
        "fig-generate": ("runs/transformers-generate.json", _summary("sdpa/ours"), RATIO),
        "fig-continuous-f32": (continuous % "float32", _summary("ours/sdpa tokens per second"), RATIO),
        "fig-continuous-bf16": (continuous % "bfloat16", _summary("ours/sdpa tokens per second"), RATIO),
        "fig-continuous-rounds": (continuous % "float32", _summary("ours/sdpa tokens per second", "n"), "{}"),
        "fig-continuous-cpu": (continuous % "float32", *cpu),
        "fig-generate-before": ("runs/transformers-generate-before.json", _summary("sdpa/ours"), RATIO),
        "fig-h100-fwd": (h100, lambda record: record["speed_ratio"]["forward"], "{:.2f}"),
        "fig-h100-fwdbwd": (h100, lambda record: record["speed_ratio"]["forward+backward"], "{:.2f}"),
        "fig-h100-decode": (h100, lambda record: record["decode"][0]["speed_ratio"], "{:.2f}"),
        "fig-h200-fwd": (h200, lambda record: record["speed_ratio"]["forward"], "{:.2f}"),
        "fig-h200-fwdbwd": (h200, lambda record: record["speed_ratio"]["forward+backward"], "{:.2f}"),
        "fig-h200-f64-fwd": (h200, lambda record: _cuda_run(record, dtype="float64", D=64)["speed_ratio"]["forward"],
                             "{:.1f}"),
        "fig-h200-tf32-fwd": (h200, lambda record: _cuda_run(record, precision="tf32", D=64)["speed_ratio"]["forward"],
                              "{:.2f}"),
    }


#: The calls of ``benchmarks/call_overhead.py``, by the short names of their figures.
_CALLS = {"decode64": "decode, 8/2 heads, 64 keys", "decode1024": "decode, 8/2 heads, 1,024 keys",
          "causal16": "16 x 16 causal", "causal16-bwd": "16 x 16 causal, fwd + bwd",
          "decode4096": "decode, 32/8 heads, 4,096 keys, D=128"}


def _fixed_cost_figures():
    """``fig-fixed-<call>-<way>[-before]``: the medians (us) of the fixed-cost records, before and after plans."""
    figures = {"fig-fixed-cpu": ("runs/call-overhead-plans.json", lambda record: describe_cpu(record["machine"]),
                                 "{}")}
    for short, call in _CALLS.items():
        for way, column in (("numpy", "numpy"), ("torch", "torch op"), ("sdpa", "sdpa")):
            for suffix, path in (("", "runs/call-overhead-plans.json"), ("-before", "runs/call-overhead-plans-before.json")):
                if not (way == "sdpa" and suffix):  # SDPA's column is the later run's
                    figures[f"fig-fixed-{short}-{way}{suffix}"] = (path, _summary(f"{call}: {column} us"),
                                                                   "{median:.1f}")
    epyc = "runs/call-overhead-epyc.json"
    figures["fig-fixed-epyc-cpu"] = (epyc, lambda record: describe_cpu(record["machine"]), "{}")
    for short, call in _CALLS.items():
        for way, column in (("numpy", "numpy"), ("torch", "torch op"), ("sdpa", "sdpa")):
            figures[f"fig-fixed-epyc-{short}-{way}"] = (epyc, _summary(f"{call}: {column} us"), "{median:.1f}")
    floor = "runs/call-overhead-floor.json"
    figures["fig-floor-cpu"] = (floor, lambda record: describe_cpu(record["machine"]), "{}")
    for way, column in (("numpy", "numpy"), ("torch", "torch op"), ("sdpa", "sdpa"), ("floor", "floor")):
        figures[f"fig-floor-{way}"] = (floor, _summary(f"{_CALLS['causal16-bwd']}: {column} us"), "{median:.0f}")
    backward = "runs/backward-overhead.json"
    figures["fig-backward-cpu"] = (backward, lambda record: describe_cpu(record["machine"]), "{}")
    for short, call in (("16", "8 heads, 16 x 16, D = 64"), ("64", "8 heads, 64 x 64, D = 64")):
        for part, name in (("bwd", "backward"), ("fwdbwd", "forward + backward")):
            for way in ("off", "on"):
                figures[f"fig-backward-{short}-{part}-{way}"] = (backward, _summary(f"{call}: {name}: {way} us"),
                                                                 "{median:.0f}")
            figures[f"fig-backward-{short}-{part}-ratio"] = (backward, _summary(f"{call}: {name}: off / on"), RATIO)
    return figures


#: Name -> (results file under docs/performance/, record -> value, how the value reads).
FIGURES = _figures()


def figure(name, records=None):
    """The text of figure ``name``, from its results file (or from ``records``: path -> record, read once each)."""
    records = {} if records is None else records
    path, value, text = FIGURES[name]
    if path not in records:
        records[path] = json.loads((RESULTS / path).read_text())
    value = value(records[path])
    return text.format(**value) if isinstance(value, dict) else text.format(value)


def rendered_markdown(text, records=None):
    """Markdown ``text`` with every figure between its markers rewritten from its file."""
    return MARKDOWN.sub(lambda m: f"<!-- figure: {m['name']} -->{figure(m['name'], records)}<!-- /figure -->", text)


def rendered_rst(text, records=None):
    """reST ``text`` whose figures block defines every ``|fig-...|`` the page uses, from the files."""
    names = sorted({m["name"] for m in RST_USE.finditer(RST_BLOCK.sub("", text))})
    body = "".join(f"\n.. |{name}| replace:: {figure(name, records)}\n" for name in names) + "\n"
    if RST_BLOCK.search(text):
        return RST_BLOCK.sub(lambda m: m.group(1) + body + m.group(3), text)
    if not names:
        return text
    return text.rstrip("\n") + "\n\n.. figures: begin\n" + body + ".. figures: end\n"


def pages():
    """The README and the docs pages: ``[(path, renderer)]``."""
    return [(ROOT / "README.md", rendered_markdown)] + [(page, rendered_rst)
                                                        for page in sorted((ROOT / "docs").glob("*.rst"))]


def used():
    """The names of the figures the pages use."""
    names = set()
    for path, _ in pages():
        text = path.read_text()
        names |= {m["name"] for m in MARKDOWN.finditer(text)} | {m["name"] for m in RST_USE.finditer(text)}
    return names


def stale():
    """The pages whose figures differ from their files' (relative paths)."""
    records = {}
    return [str(path.relative_to(ROOT)) for path, render in pages() if render(path.read_text(), records)
            != path.read_text()]


def main(argv):
    if "--check" in argv:
        found = stale()
        for path in found:
            print(f"{path}: a figure is not its results file's: run python docs/scripts/figures.py")
        return 1 if found else 0
    records = {}
    for path, render in pages():
        text = path.read_text()
        fresh = render(text, records)
        if fresh != text:
            path.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
