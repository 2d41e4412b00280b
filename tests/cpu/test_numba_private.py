"""The version check in front of Numba's private internals, and the public fallback it selects."""

import os
import pathlib
import re
import subprocess
import sys

import numba
import numpy as np
import pytest

from elastic_np.cpu._runtime import numba_private as private

ALL = frozenset(private.PATHS)


def test_every_path_is_on_inside_the_tested_range():
    low, high = private.TESTED_NUMBA
    for version in (low, high):
        text = ".".join(map(str, version))
        assert private.paths_on(text, None) == ALL
        assert private.paths_on(text, "") == ALL and private.paths_on(text, "0") == ALL
    assert private.paths_on(".".join(map(str, high)) + "rc1", None) == ALL


@pytest.mark.parametrize("version", ["0.61.0", "0.62.0", "0.69.0", "0.70.1", "1.0", "unknown"])
def test_every_path_is_off_outside_the_tested_range(version):
    low, high = private.TESTED_NUMBA
    assert not low <= private._version(version) <= high  # the case really is outside
    assert private.paths_on(version, None) == frozenset()


def test_the_environment_variable_turns_paths_off():
    tested = ".".join(map(str, private.TESTED_NUMBA[1]))
    assert private.paths_on(tested, "1") == frozenset()
    assert private.paths_on(tested, " 1 ") == frozenset()
    assert private.paths_on(tested, "inner, lazy_stages") == ALL - {"inner", "lazy_stages"}
    with pytest.raises(ValueError, match="no path"):
        private.paths_on(tested, "yes")


def test_this_process_follows_the_installed_numba_and_the_variable():
    assert private._ON == private.paths_on(numba.__version__, os.environ.get(private.ENV_VAR))
    with pytest.raises(ValueError):
        private.enabled("no such path")


#: What a process with every private path off has (Numba's public API alone), after a forward with a modifier and a
#: bias: its helpers are plain njit functions, callable from Python, and nothing is registered, linked or loaded
#: lazily (the backward through public Numba alone: CI's stage with ELASTIC_NP_PUBLIC_NUMBA=1).
FORCED_CHECKS = """
from elastic_np.cli import _first_compile
from elastic_np.cpu._prefill import dbias as _dbias
from elastic_np.cpu._tiles import (
    calls as _calls, exp as _exp, logits as _logits, products as _products, scalar as _scalar,
)
assert _calls.matmul_nn is _products.matmul_nn and _calls.exp_shift_sum is _exp.exp_shift_sum
assert type(_logits.modify_tile) is type(_dbias.dbias_tile) is type(_products.matmul_nn)
assert np.isclose(_scalar.log_add_exp(0.0, 0.0), np.log(2.0))
assert not _numba_private._LINKED and not _numba_private._LAZY and not _numba_private._TRAMPOLINES
assert not _first_compile._can_split()
"""

FORCED = """
import numpy as np
import elastic_np as enp
from elastic_np.cpu._runtime import numba_private as _numba_private
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, 12, 8)) for _ in range(3))
out, lse = enp.attention(q, k, v, causal=True, softcap=3.0, bias=np.ones((12, 12)), return_lse=True)
""" + FORCED_CHECKS + """
print(sorted(_numba_private._ON))
"""

#: Whether this Numba is the tested one (`test_the_settings_share_a_cache_folder_without_loading_each_others_code`
#: runs, and checks `FORCED_CHECKS` in its public setting's process).
TESTED = private.paths_on(numba.__version__, None) == ALL


@pytest.mark.skipif(TESTED, reason="the public setting's process of the shared-cache test checks the same")
def test_forced_fallback_uses_public_numba_alone(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), **{private.ENV_VAR: "1"})
    run = subprocess.run([sys.executable, "-c", FORCED], capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_each_setting_but_all_on_has_a_cache_folder_of_its_own(tmp_path, monkeypatch):
    assert private.cache_name(ALL) is None  # Numba's usual places
    assert private.cache_name(frozenset()) == "elastic_np-public"
    assert private.cache_name(ALL - {"inner", "lazy_stages"}) == "elastic_np-public-inner-lazy_stages"
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    assert private._cache_folder("elastic_np-public") == str(tmp_path / "elastic_np-public")
    assert private._cache_folder(None) is None


# One setting, then the other, on one NUMBA_CACHE_DIR: each compiles its own kernels once and then
# loads them; a forced process that loaded the private setting's kernels would call `elastic_np_*`
# symbols it never registered (a crash).
SHARED_CACHE = """
import numpy as np
import elastic_np as enp
from elastic_np import reference
from elastic_np._api import compile_report
from elastic_np.cpu._prefill import forward as _forward
from elastic_np.cpu._runtime import numba_private as _numba_private
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, 24, 8)).astype(np.float32) for _ in range(3))
with compile_report.watch() as watch:
    out = enp.attention(q, k, v, causal=True, softcap=3.0, backend="cpu")
error = np.abs(out - reference.attention(q, k, v, causal=True, softcap=3.0)[0]).max()
folder = _numba_private.cache_folder()
assert folder is None or _forward._forward_kernel._cache.cache_path.startswith(folder), folder
print(len(watch.compiled), error < 1e-5, folder is not None)
if not _numba_private._ON:
""" + "\n".join("    " + line for line in FORCED_CHECKS.strip().splitlines()) + "\n"


@pytest.mark.skipif(not TESTED, reason="outside the tested Numba every setting is the public one")
@pytest.mark.skipif(private._ON != ALL, reason="it sets each setting itself: it runs once, where all paths are on")
def test_the_settings_share_a_cache_folder_without_loading_each_others_code(tmp_path):
    root = str(pathlib.Path(private.__file__).parents[3])  # this checkout's package
    pythonpath = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))

    def run(setting):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=pythonpath, **{private.ENV_VAR: setting})
        done = subprocess.run([sys.executable, "-c", SHARED_CACHE], capture_output=True, text=True, timeout=900,
                              env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        compiled, right, own_folder = done.stdout.split()
        assert right == "True" and own_folder == str(setting == "1")
        return int(compiled)

    assert run("0") > 0  # fills the cache
    assert run("1") > 0  # compiles its own
    assert run("1") == 0 and run("0") == 0  # each loads its own
    assert (tmp_path / "elastic_np-public").is_dir()


HELPERS = """
import numpy as np
from numba import njit
from elastic_np.cpu._runtime.numba_private import inner

@inner(fastmath={"nsz", "arcp", "contract", "reassoc"})
def scale(z, a):
    for c in range(z.shape[0]):
        z[c] *= a

@njit(cache=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def first(z, a):
    scale(z, a)

@njit(cache=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def second(z, a):
    scale(z, a)
"""

LINKED_IR = """
import re, sys
import numpy as np
import helpers
getattr(helpers, sys.argv[1])(np.ones(100), 3.0)
(ir,) = helpers.scale.inspect_llvm().values()
body = re.search(r"^define .*?^}$", ir, re.M | re.S).group(0)  # the helper's function
body = re.sub(r"B[0-9]+v[0-9]+", "", body)  # its name without the process's counter
print(re.sub(r" *;.*", "", body))  # and no comments (a block's predecessors are listed in use order)
"""


@pytest.mark.skipif(not private.enabled("inner"), reason="the helpers are plain njit functions")
def test_a_helper_loaded_from_the_cache_links_as_it_compiled(tmp_path):
    # Numba turned a loaded helper into machine code, which rewrites its module in place; the callers
    # compiled afterwards linked the rewritten IR and differed in their last bits from the same callers
    # compiled against a fresh helper (a decode over every sequence against one per sequence)
    (tmp_path / "helpers.py").write_text(HELPERS)
    root = str(pathlib.Path(private.__file__).parents[3])
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONHASHSEED="0",  # fastmath's order in names
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), root, os.environ.get("PYTHONPATH")])))

    def linked_ir(caller):
        done = subprocess.run([sys.executable, "-c", LINKED_IR, caller], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    compiled = linked_ir("first")  # compiles the helper and caches it
    loaded = linked_ir("second")  # a new caller: the helper comes from the cache
    assert compiled.startswith("define") and loaded == compiled


PRIVATE_NAMES = r"numba\._dynfunc|_dynfunc|numba\.core\.(compiler|codegen|caching|registry)|add_symbol|create_mcjit"


def test_no_other_module_uses_the_private_internals():
    package = pathlib.Path(private.__file__).parents[2]
    users = {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if re.search(PRIVATE_NAMES, path.read_text())
    }
    assert users == {"cpu/_runtime/numba_private.py"}


@pytest.mark.skipif(not private.enabled("direct_calls"), reason="calls go through the dispatchers")
def test_direct_call_is_the_entry_point_of_the_arguments_types_once_compiled(monkeypatch):
    from numba import njit

    f = njit(cache=False, fastmath=False)(lambda a, t: a.sum() + t[0])
    a = np.ones(3)
    assert private.direct_call(f, (a, (1.0,))) is f  # nothing compiled yet
    f(a, (1.0,))
    entry = private.direct_call(f, (a, (1.0,)))
    assert entry is not f and entry(a, (2.0,)) == 5.0
    b = np.ones(3, np.float32)
    assert private.direct_call(f, (b, (1.0,))) is f  # float32 arrays: another type, not compiled
    f(b, (1.0,))
    assert private.direct_call(f, (b, (1.0,))) not in (f, entry)
    read_only = np.ones(3)
    read_only.flags.writeable = False
    assert private.direct_call(f, (read_only, (1.0,))) is f  # a read-only array is another type
    assert private.direct_call(f, (a, (1,))) is f  # so is an int in the tuple
    monkeypatch.setattr(private, "_ON", private._ON - {"direct_calls"})
    assert private.direct_call(f, (a, (1.0,))) is f
