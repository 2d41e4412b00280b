"""The options are described once (`elastic_np._contract._spec`): every signature, docstring and list follows it."""

import ast
import dataclasses
import importlib
import inspect
import pathlib

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import testing
from elastic_np._api import varlen
from elastic_np._contract import _spec
from elastic_np.testing import _cases

PACKAGE = pathlib.Path(enp.__file__).parent

#: Where the option list may be spelled out: the table, and the two public entry points.
ALLOWED = {("_contract/_spec.py", None), ("_api/dispatch.py", "attention"), ("_api/dispatch.py", "attention_backward")}
#: What reads the options one by one by its nature, as the steps of adding an option say: the
#: oracle and the kernels (their records of the problem), and the kit's cases (values per option).
READERS = ("reference/", "cpu/", "cuda/", "testing/_cases.py")

#: A construct naming this many options or more spells out the list.
SPELLED_OUT = 5


def _option_functions():
    """``(label, function, option names)`` of every public function that takes the options."""
    found = [
        ("elastic_np.attention", enp.attention, _spec.NAMES),
        ("elastic_np.attention_backward", enp.attention_backward, _spec.NAMES),
        ("elastic_np.attention_double_backward", enp.attention_double_backward, _spec.NAMES),
        ("reference.attention", enp.reference.attention, _spec.NAMES),
        ("reference.attention_backward", enp.reference.attention_backward, _spec.NAMES),
        ("reference.attention_double_backward", enp.reference.attention_double_backward, _spec.NAMES),
        ("elastic_np.varlen_attention", enp.varlen_attention, varlen.OPTIONS),
        ("elastic_np.varlen_attention_backward", enp.varlen_attention_backward, varlen.OPTIONS),
    ]
    for module_name, names in (("elastic_np.torch", ("attention", "varlen_attention")),
                               ("elastic_np.jax", ("attention",)),
                               ("elastic_np.dask", ("attention", "attention_backward"))):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        # a packed batch's signature lists the options it takes (`varlen.OPTIONS`; the torch operators' no scales
        # of a quantized cache)
        torch_varlen = tuple(n for n in varlen.OPTIONS if n not in varlen.CACHE_SCALES)
        found += [(f"{module_name}.{n}", getattr(module, n), torch_varlen if "varlen" in n else _spec.NAMES)
                  for n in names]
        if module_name == "elastic_np.torch":
            model = tuple(n for n in _spec.NAMES if n not in _spec.PER_CALL + _spec.LEARNABLE)
            found += [("ElasticAttention", module.ElasticAttention, model),
                      ("ElasticAttention.forward", module.ElasticAttention.forward, _spec.PER_CALL)]
    found += [("elastic_np.varlen_attention", enp.varlen_attention, varlen.OPTIONS),
              ("elastic_np.varlen_attention_backward", enp.varlen_attention_backward, varlen.OPTIONS)]
    return found


@pytest.mark.parametrize("label, fn, names", _option_functions(), ids=lambda x: x if isinstance(x, str) else "")
def test_signature_follows_the_table(label, fn, names):
    params = inspect.signature(fn).parameters
    # ElasticAttention takes the learnable options' initial values besides, defaults of its own
    own = set(_spec.LEARNABLE) - set(_spec.PER_CALL) if label == "ElasticAttention" else set()
    options = [p for name, p in params.items() if name in _spec.NAMES and name not in own]
    assert [p.name for p in options] == list(names), label
    for p in options:
        assert p.kind is p.KEYWORD_ONLY, (label, p.name)
        assert p.default == _spec.DEFAULTS[p.name], (label, p.name)
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), f"{label} shows **options"


@pytest.mark.parametrize("label, fn, names", _option_functions(), ids=lambda x: x if isinstance(x, str) else "")
def test_docstring_names_every_option(label, fn, names):
    doc = inspect.getdoc(fn)
    assert "%(" not in doc, f"{label}: an unfilled placeholder"
    missing = [n for n in names if n not in doc]
    assert not missing, f"{label}'s docstring does not document {missing}"


@pytest.mark.parametrize("label, fn, names", _option_functions()[:4], ids=lambda x: x if isinstance(x, str) else "")
def test_an_unknown_option_names_the_function(label, fn, names):
    q = np.ones((1, 1, 2, 4))
    args = (q, q, q) if "backward" not in label else (q, q, q, q, q, np.zeros((1, 1, 2)))
    if "double_backward" in label:
        args = (q, q, q) + args
    with pytest.raises(TypeError, match=f"{fn.__name__}\\(\\) got an unexpected keyword argument 'is_causal'"):
        fn(*args, is_causal=True)


def test_the_kit_lists_the_table():
    assert _cases.OPTION_NAMES == _spec.IN_KIT
    # the kit's cases hold float caches: a quantized one is held to the oracle in tests/cpu/test_quantized.py
    assert set(_spec.NAMES) - set(_spec.IN_KIT) == {"layout", "precision"}
    assert set(testing.ConformanceReport.__module__.split(".")) >= {"elastic_np"}


def test_every_option_sets_problem_fields_and_rejects_a_bad_value():
    shape = _spec.Shape(B=1, H=2, N=3, M=4, D=5, check_bias_values=True)
    defaults = _spec.problem_fields(_spec.DEFAULTS, shape)
    assert defaults["scale"] == pytest.approx(5 ** -0.5)
    bad = {"scale": "x", "causal": 1, "window_size": (0,), "kv_lengths": [9], "align": "left",
           "mask": np.ones(4), "nvm": "yes", "tau": 0.0, "beta": -1.0, "dynamic_window": 0.5,
           "softcap": 0.0, "alibi_slopes": np.ones(3), "bias": np.ones((5, 4)), "k_scale": 0.0, "v_scale": np.ones((2, 3)), "precision": "fast",
           "layout": "nhd"}
    assert set(bad) == set(_spec.NAMES)
    for option in _spec.OPTIONS:
        assert option.fields(option.default, shape).keys() <= defaults.keys()
        with pytest.raises((TypeError, ValueError), match=f"`{option.name}`|`sigma`|`window_size`"):
            option.fields(bad[option.name], shape)


def _spelled_out(tree):
    """``(function, line, names)`` of every construct in ``tree`` naming `SPELLED_OUT` options or more.

    Constructs: a function's parameters, a call's keywords, a dict's string
    keys, a tuple, list or set of strings.
    """
    found = []

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        elif isinstance(node, ast.Call):
            names = [kw.arg for kw in node.keywords]
        elif isinstance(node, ast.Dict):
            names = [k.value for k in node.keys if isinstance(k, ast.Constant)]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        else:
            names = []
        named = [n for n in names if n in _spec.NAMES]
        if len(named) >= SPELLED_OUT:
            found.append((function, node.lineno, named))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return found


def test_no_function_outside_the_table_spells_out_the_options():
    # the table (one record per option) may spell the list out but need not: the check must see the rest
    offenders, allowed_seen = [], {("_contract/_spec.py", None)}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(READERS):
            continue
        for function, line, named in _spelled_out(ast.parse(path.read_text(), relative)):
            key = (relative, None if relative == "_contract/_spec.py" else function)
            if key in ALLOWED:
                allowed_seen.add(key)
            else:
                offenders.append(f"{relative}:{line} in {function}: {', '.join(named)}")
    assert not offenders, "the option list spelled out outside elastic_np/_contract/_spec.py:\n" + "\n".join(offenders)
    # the check sees the lists it allows: it would see any other
    assert allowed_seen == ALLOWED


def _narrowed(monkeypatch, name, **fields):
    """The option table with option ``name``'s record changed in ``fields``."""
    option = next(o for o in _spec.OPTIONS if o.name == name)
    narrowed = dataclasses.replace(option, **fields)
    monkeypatch.setattr(_spec, "OPTIONS", tuple(narrowed if o is option else o for o in _spec.OPTIONS))


def test_an_option_a_backend_does_not_take_is_rejected(monkeypatch):
    _narrowed(monkeypatch, "softcap", backends=("reference",))
    _spec.check_support({"softcap": None}, "cpu")  # the default: nothing to reject
    _spec.check_support({"softcap": 5.0}, "reference")
    with pytest.raises(ValueError, match="backend 'cpu' does not take `softcap`"):
        _spec.check_support({"softcap": 5.0}, "cpu")
    q = np.ones((1, 1, 2, 4), np.float32)
    with pytest.raises(ValueError, match="backend 'cpu' does not take `softcap`"):
        enp.attention(q, q, q, softcap=5.0, backend="cpu")


def test_an_option_the_kernels_do_not_take_in_a_dtype_is_rejected(monkeypatch):
    _narrowed(monkeypatch, "softcap", dtypes=("float64",))
    q = np.ones((1, 1, 2, 4), np.float32)
    with pytest.raises(ValueError, match="the cpu kernels do not take `softcap` in float32"):
        enp.attention(q, q, q, softcap=5.0, backend="cpu")
    q64 = q.astype(np.float64)
    enp.attention(q64, q64, q64, softcap=5.0, backend="cpu")  # the float64 kernels take it
    enp.attention(q, q, q, softcap=5.0, backend="reference")  # the reference: float64 always
    enp.attention(q, q, q, backend="cpu")  # the option left at its default


@pytest.mark.parametrize("foreign, ours", [("is_causal", "`causal=`"), ("attn_mask", "`bias=`"),
                                           ("softmax_scale", "`scale=`"), ("dropout_p", "not supported"),
                                           ("enable_gqa", "needs no flag")])
@pytest.mark.parametrize("label, fn, names", _option_functions()[:4], ids=lambda x: x if isinstance(x, str) else "")
def test_a_pytorch_or_flashattention_name_says_which_of_ours_it_is(label, fn, names, foreign, ours):
    q = np.ones((1, 1, 2, 4))
    args = (q, q, q) if "backward" not in label else (q, q, q, q, q, np.zeros((1, 1, 2)))
    if "double_backward" in label:
        args = (q, q, q) + args
    with pytest.raises(TypeError, match=f"{fn.__name__}\\(\\) got an unexpected keyword argument '{foreign}': .*{ours}"):
        fn(*args, **{foreign: True})


def test_other_mistakes_keep_pythons_message():
    q = np.ones((1, 1, 2, 4))
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'v'"):
        enp.attention(q, q)
    with pytest.raises(TypeError, match="unexpected keyword argument 'causl'$"):
        enp.attention(q, q, q, causl=True)


def test_a_float_mask_points_to_bias():
    q = np.ones((1, 1, 2, 4))
    with pytest.raises(TypeError, match="`mask` must be a boolean array, got dtype float64.*pass it as `bias=`"):
        enp.attention(q, q, q, mask=np.zeros((2, 2)))
    with pytest.raises(TypeError, match="got dtype int64$"):
        enp.attention(q, q, q, mask=np.zeros((2, 2), dtype=np.int64))
