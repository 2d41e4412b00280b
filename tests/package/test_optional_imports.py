"""``import elastic_np`` never imports the optional frameworks."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_elastic_np_imports_neither_torch_nor_jax():
    code = (
        "import sys, elastic_np, elastic_np.cpu, elastic_np.testing\n"
        "print(sorted(m for m in ('torch', 'jax', 'jaxlib', 'dask', 'transformers') if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]", result.stdout
