"""Screenshot a graph page of the published asv dashboard in headless Chromium.

Serves ``html/`` (what ``asv publish`` wrote) from 127.0.0.1, opens the graph
page of one benchmark in Debian's ``chromium`` and saves a PNG; then checks
that a graph was drawn: the page's DOM holds flot's plot canvas, and the
screenshot holds coloured pixels (the plotted lines and markers; the page
itself is white, grey and blue-grey text). Not run in CI.

The dashboard loads jQuery, flot, Bootstrap and a few plugins from CDNs. So
that the page works on a machine without internet access, the script installs
the same packages from the npm registry with ``npm`` (into a cache directory),
copies them into ``html/vendor/`` and points the pages there (``--no-vendor``
keeps the CDN links).

Usage, from ``asv_benchmarks/`` after ``asv run`` (see ``docs/performance.rst``, "The asv suite")::

    python screenshot.py --publish                   # asv publish, then the screenshot
    python screenshot.py --publish --branch my-branch   # a branch not in asv.conf.json
    python screenshot.py --benchmark bench_compare.Forward.time_forward \
        --query "p-causal=True" --out compare.png

The dashboard only draws commits on the configured branches; ``--branch``
publishes with a temporary copy of ``asv.conf.json`` naming that branch.
"""

import argparse
import functools
import http.server
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse

HERE = pathlib.Path(__file__).resolve().parent
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    # Let the dashboard's JavaScript fetch its JSON and draw before the capture.
    "--virtual-time-budget=15000",
]


# The dashboard's external scripts and styles, by file name in their CDN URL:
# the npm package that holds the same file, and its path in node_modules.
ASSETS = {
    "jquery-3.3.1.min.js": ("jquery@3.3.1", "jquery/dist/jquery.min.js"),
    "jquery.flot.min.js": ("flot@0.8.3", "flot/jquery.flot.js"),
    "jquery.flot.time.min.js": ("flot@0.8.3", "flot/jquery.flot.time.js"),
    "jquery.flot.selection.min.js": ("flot@0.8.3", "flot/jquery.flot.selection.js"),
    "jquery.flot.categories.min.js": ("flot@0.8.3", "flot/jquery.flot.categories.js"),
    "jquery.flot.orderBars.js": (
        "flot-orderbars@1.0.0", "flot-orderbars/js/jquery.flot.orderBars.js"
    ),
    "stupidtable.min.js": ("stupid-table-plugin@1.1.3", "stupid-table-plugin/stupidtable.min.js"),
    "md5.min.js": ("blueimp-md5@2.19.0", "blueimp-md5/js/md5.min.js"),
    "bootstrap.min.js": ("bootstrap@3.1.1", "bootstrap/dist/js/bootstrap.min.js"),
    "bootstrap.min.css": ("bootstrap@3.1.1", "bootstrap/dist/css/bootstrap.min.css"),
}
ASSET_CACHE = pathlib.Path.home() / ".cache" / "elastic_np" / "asv-dashboard-assets"


def vendor(html, cache=ASSET_CACHE):
    """Serve the dashboard's CDN scripts and styles from ``html/vendor/`` (installed with npm)."""
    pages = sorted(html.glob("*.html"))
    urls = set()
    for page in pages:
        urls.update(re.findall(r'(?:src|href)="(https?://[^"]+\.(?:js|css))"', page.read_text()))
    names = {url: url.rsplit("/", 1)[-1] for url in urls}
    known = {url: ASSETS[name] for url, name in names.items() if name in ASSETS}
    for url in sorted(urls - set(known)):
        print(f"warning: no local copy of {url}", file=sys.stderr)
    missing = sorted({spec for spec, path in known.values()
                      if not (cache / "node_modules" / path).exists()})
    if missing:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(cache),
             *missing],
            check=True,
        )
    (html / "vendor").mkdir(exist_ok=True)
    for url, (spec, path) in known.items():
        shutil.copyfile(cache / "node_modules" / path, html / "vendor" / url.rsplit("/", 1)[-1])
    for page in pages:
        text = page.read_text()
        for url in known:
            text = text.replace(f'"{url}"', f'"vendor/{url.rsplit("/", 1)[-1]}"')
        # The CDN's integrity hashes are of its minified builds, not of these files.
        text = re.sub(r'((?:src|href)="vendor/[^"]+"[^>]*?)\s+integrity="[^"]*"', r"\1", text)
        page.write_text(text)


def publish(branch=None):
    """Run ``asv publish``, with the configured branches replaced by ``branch`` if given."""
    command = ["asv", "publish"]
    with tempfile.TemporaryDirectory() as tmp:
        if branch is not None:
            config = _load_config(HERE / "asv.conf.json")
            config["branches"] = [branch]
            for key in ("repo", "benchmark_dir", "env_dir", "results_dir", "html_dir"):
                config[key] = str((HERE / config[key]).resolve())
            path = pathlib.Path(tmp) / "asv.conf.json"
            path.write_text(json.dumps(config, indent=4))
            command += ["--config", str(path)]
        subprocess.run(command, cwd=HERE, check=True)


def _load_config(path):
    """asv's JSON with ``//`` comment lines."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("//")]
    return json.loads("\n".join(lines))


def serve(directory):
    """Serve ``directory`` quietly on 127.0.0.1; return the server (port in ``server_port``)."""

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def chromium(url, *extra, executable="chromium"):
    """Run headless Chromium on ``url`` with a fresh profile; return its stdout."""
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url],
            capture_output=True,
            text=True,
            timeout=180,
            check=True,
        )
    return result.stdout


def coloured_fraction(png):
    """Fraction of pixels whose colour is clearly not a grey (``max - min`` of RGB > 0.25)."""
    import matplotlib.image

    image = matplotlib.image.imread(str(png))[..., :3]
    spread = image.max(axis=-1) - image.min(axis=-1)
    return float((spread > 0.25).mean())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html-dir", default=str(HERE / "html"))
    parser.add_argument("--benchmark", default="bench_cpu.CPUForward.time_forward")
    parser.add_argument(
        "--query", default="", help="graph page parameters, e.g. \"p-dtype='float32'\""
    )
    parser.add_argument("--out", default=str(HERE / "html" / "cpu_forward.png"))
    parser.add_argument("--window-size", default="1400,1000")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--publish", action="store_true", help="run asv publish first")
    parser.add_argument("--branch", help="publish this branch instead of the configured ones")
    parser.add_argument("--no-vendor", action="store_true",
                        help="keep the dashboard's CDN links (needs internet access)")
    args = parser.parse_args(argv)

    if args.publish:
        publish(args.branch)
    html = pathlib.Path(args.html_dir)
    if not (html / "index.html").exists():
        parser.error(f"{html / 'index.html'} not found: run `asv publish` first")
    if not args.no_vendor:
        vendor(html)
    graph_dir = html / "graphs"
    if not any(graph_dir.rglob(f"{args.benchmark}.json")):
        parser.error(f"no graph data for {args.benchmark} under {graph_dir}")

    server = serve(html)
    try:
        fragment = args.benchmark + (f"?{args.query}" if args.query else "")
        fragment = urllib.parse.quote(fragment, safe="?=&,.'")
        url = f"http://127.0.0.1:{server.server_port}/index.html#{fragment}"
        out = pathlib.Path(args.out).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        chromium(url, f"--screenshot={out}", f"--window-size={args.window_size}",
                 executable=args.chromium)
        dom = chromium(url, "--dump-dom", f"--window-size={args.window_size}",
                       executable=args.chromium)
    finally:
        server.shutdown()

    has_canvas = re.search(r'<canvas[^>]*class="flot-base"', dom) is not None
    fraction = coloured_fraction(out)
    print(f"{url}\n  screenshot: {out}\n  flot canvas in DOM: {has_canvas}\n"
          f"  coloured pixels: {fraction:.4%}")
    if not has_canvas or fraction < 1e-4:
        print("no graph was drawn", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
