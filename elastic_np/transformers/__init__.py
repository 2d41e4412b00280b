"""elastic_np as an attention of Hugging Face transformers: ``attn_implementation="elastic_np"``.

`register` adds an attention function and the mask function that goes with
it to transformers' registries; a model built with
``attn_implementation="elastic_np"`` then runs every attention layer through
`elastic_np.torch.attention` (forward and backward; CPU or CUDA tensors as
that function takes them). Scaling, grouped-query heads, soft-capping and
gpt-oss's per-head sinks (``s_aux``, the logarithm of ``beta``, with their
gradient) map to the options of the same names; causality, sliding windows
and padding arrive as transformers' boolean mask, formed wherever it masks
more than causality does (bottom-right aligned, as the kernels align it;
`boolean_mask`): a decoding step's mask that keeps a prefix of the keys (a
static cache's empty slots, right padding) becomes ``kv_lengths``, so that
the keys past it are never read. Packed sequences (transformers' padding-free path, where
``cu_seq_lens_q`` and ``cu_seq_lens_k`` reach the attention, as
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives them) go
through `elastic_np.torch.varlen_attention`, each sequence on its own. What
the function cannot honour (attention dropout while training, attention
weights as an output) is an error naming it.

transformers' continuous batching (``generate_batch``, the manager behind
``transformers serve``) takes only its own implementations or a
FlashAttention: `register` also offers elastic_np's FlashAttention functions
(`elastic_np.transformers.flash`) as a kernel of the ``kernels`` package,
which transformers loads, as it loads FlashAttention from the Hub, for
``attn_implementation=CONTINUOUS_BATCHING``. Its packed sequences then go
through `elastic_np.torch.varlen_attention`, each sequence on its own.

Examples
--------
>>> import torch, transformers
>>> import elastic_np.transformers
>>> elastic_np.transformers.register()
>>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                   num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="elastic_np")
>>> model(torch.tensor([[1, 2, 3]])).logits.shape
torch.Size([1, 3, 64])
"""

import os
import pathlib
import weakref

import torch

from elastic_np import torch as enpt

#: The name `register` gives the attention by default.
NAME = "elastic_np"

#: The ``attn_implementation`` of elastic_np's FlashAttention functions, for every model (`register` first) and
#: for continuous batching: a name of the Hub's form, which the ``kernels`` package resolves to `KERNEL_PATH`.
CONTINUOUS_BATCHING = "elastic-np/flash-attn"
#: The kernel's folder: a build of it, ``torch-universal``, imports `elastic_np.transformers.flash`.
KERNEL_PATH = pathlib.Path(__file__).parent / "hub_kernel"

#: Keyword arguments transformers passes that change nothing here.
_IGNORED = frozenset({"position_ids", "cache_position", "num_items_in_batch", "output_hidden_states",
                      "output_router_logits", "use_cache", "past_key_values", "seq_idx"})
#: Those that describe packed sequences: their attention goes through `elastic_np.torch.varlen_attention`.
_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_PACKED_NAMES = frozenset(_PACKED)  # (a set test first: most calls pass none of them)
#: Every keyword the attention takes besides its named parameters.
_TAKEN = _IGNORED | _PACKED_NAMES | {"output_attentions", "is_causal"}


def register(name=NAME, backend="auto"):
    """Register the attention and its mask function under ``name`` with transformers, and offer `CONTINUOUS_BATCHING`.

    The ``kernels`` package (which transformers requires) then finds
    `CONTINUOUS_BATCHING` in this package (`offer_kernel`), and a model made
    with that ``attn_implementation`` runs transformers' FlashAttention path
    over `elastic_np.transformers.flash` (on the "auto" backend), continuous
    batching included.

    Parameters
    ----------
    name : str, optional
        The ``attn_implementation`` to give models.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        The elastic_np backend every layer runs on.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, boolean_mask)
    offer_kernel()


def offer_kernel():
    """Add `CONTINUOUS_BATCHING`, at `KERNEL_PATH`, to the ``kernels`` package's local overrides.

    The overrides are the environment variable ``LOCAL_KERNELS``
    (``repo_id=path`` entries joined by ``:``); those it holds for other
    kernels are kept. Child processes inherit it.
    """
    if ":" in str(KERNEL_PATH):
        raise RuntimeError(f"the kernels package cannot take a path with ':' in LOCAL_KERNELS: {KERNEL_PATH}")
    entries = [entry for entry in os.environ.get("LOCAL_KERNELS", "").split(":")
               if entry and not entry.startswith(CONTINUOUS_BATCHING + "=")]
    os.environ["LOCAL_KERNELS"] = ":".join(entries + [f"{CONTINUOUS_BATCHING}={KERNEL_PATH}"])


def boolean_mask(*args, **kwargs):
    """transformers' boolean mask ``(B, 1, N, M)`` (True keeps), or None where causality alone masks.

    transformers' SDPA mask may be None where torch's ``is_causal`` (top-left
    aligned) stands in for it, a static cache's empty slots included; the
    kernels align causality bottom-right, so the mask is skipped only where
    the two alignments agree and nothing else is masked (`_causal_alone`):
    then the attention runs causal, as the module is (a decoding step's
    queries see every key), with no mask to form or read. transformers
    allows no skip for a cache of fixed size (``allow_is_causal_skip``):
    its empty slots are masked.
    """
    from transformers.masking_utils import sdpa_mask

    if kwargs.pop("allow_is_causal_skip", True) and _causal_alone(*args, **kwargs):  # never with a static cache
        return None
    return sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)


def _causal_alone(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, local_size=None, **_):
    """Whether `sdpa_mask`'s arguments describe plain causality over every key, aligned alike top-left and
    bottom-right: one query, or as many queries as keys, no padding, no window or chunks, not compiling (where
    reading the padding would break the graph)."""
    from transformers.masking_utils import causal_mask_function

    if mask_function not in (None, causal_mask_function) or local_size is not None or not isinstance(q_length, int):
        return False
    if not (q_length == 1 or q_length == kv_length) or torch.compiler.is_compiling():
        return False
    if attention_mask is None:
        return True
    return attention_mask.shape[-1] >= kv_offset + kv_length and bool(
        attention_mask[:, kv_offset : kv_offset + kv_length].all())


def attention_forward(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, s_aux=None, backend="auto", **kwargs):
    """One layer's attention, as transformers calls it: ``(out of shape (B, N, H, Dv), None)``.

    ``query`` is ``(B, H, N, D)``, ``key`` and ``value`` ``(B, Hkv, M, D)``;
    ``attention_mask`` what `boolean_mask` made (or None: every key kept,
    causal where the module is). ``s_aux`` holds gpt-oss's per-head sink
    logits: ``beta = exp(s_aux)``.

    With ``cu_seq_lens_q`` and ``cu_seq_lens_k`` (and optionally
    ``max_length_q``, ``max_length_k``), the ``B * N`` tokens are packed
    sequences, the offsets where each starts: each is attended to on its own
    (`elastic_np.torch.varlen_attention`), causal where the module is, with
    its sliding window. The mask is then not needed; when given, it must keep
    within each sequence what causality and the window keep (what it keeps
    across sequences is never looked at), else a `ValueError` says so (a
    padding mask with packed sequences).
    """
    _check_kwargs(module, dropout, kwargs)
    options = {"scale": scaling, "softcap": softcap, "backend": backend}
    if s_aux is not None:
        options["beta"] = torch.exp(s_aux.to(query.dtype))
    if not _PACKED_NAMES.isdisjoint(kwargs) and any(kwargs.get(name) is not None for name in _PACKED):
        causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
        window = (int(sliding_window) - 1, 0) if sliding_window is not None and causal else (-1, -1)
        return _packed_attention(query, key, value, attention_mask, kwargs, causal, window, options), None
    if attention_mask is None:
        options["causal"] = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
        if sliding_window is not None and options["causal"]:
            options["window_size"] = (int(sliding_window) - 1, 0)
    else:
        options.update(_mask_options(attention_mask, query.shape[0], query.shape[2], key.shape[2]))
    out = enpt.attention(query, key, value, **options)
    return out.transpose(1, 2).contiguous(), None


def _check_kwargs(module, dropout, kwargs):
    if dropout and module.training:
        raise ValueError(f"elastic_np attention does not apply attention dropout (dropout={dropout} while "
                         "training): set the config's attention_dropout to 0.0, or train with another "
                         "attn_implementation")
    if kwargs.get("output_attentions"):
        raise ValueError("elastic_np attention never forms the attention weights: output_attentions=True "
                         "needs attn_implementation='eager'")
    if not kwargs.keys() <= _TAKEN:
        raise TypeError(f"elastic_np attention cannot honour {', '.join(sorted(kwargs.keys() - _TAKEN))}")


#: The masks `_check_packed_mask` found right: ``id(mask) -> (weak reference to it, what it was checked for)``.
_CHECKED = {}


def _packed_attention(query, key, value, mask, kwargs, causal, window, options):
    """Packed sequences' attention, ``(B, N, H, Dv)``: the ``B * N`` tokens through `enpt.varlen_attention`."""
    missing = [name for name in _PACKED[:2] if kwargs.get(name) is None]
    if missing:
        raise ValueError(f"elastic_np attention takes packed sequences with both cu_seq_lens_q and cu_seq_lens_k, "
                         f"got no {missing[0]}")
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    B, H, N, _ = query.shape
    if mask is not None:
        _check_packed_mask(mask, cu_q, cu_k, causal, window, B * N, key.shape[0] * key.shape[2])
    q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (query, key, value))
    try:
        out = enpt.varlen_attention(q, k, v, cu_q, cu_k, max_q=kwargs.get("max_length_q"),
                                    max_k=kwargs.get("max_length_k"), causal=causal, window_size=window, **options)
    except ValueError as error:  # its names: cu_seqlens_q for transformers' cu_seq_lens_q, max_q for max_length_q
        raise ValueError(f"packed sequences (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k): "
                         f"{error}") from None
    return out.view(B, N, H, out.shape[-1])


def _check_packed_mask(mask, cu_q, cu_k, causal, window, total_q, total_k):
    """Raise a `ValueError` unless ``mask`` keeps, within each packed sequence, what ``causal`` and ``window`` keep.

    Only the sequences' diagonal blocks are read (what the mask keeps across
    sequences is never looked at, nor computed), once per mask: the layers of
    one forward share it (`_CHECKED`).
    """
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[-2:] != (total_q, total_k):
        raise ValueError(f"elastic_np attention takes packed sequences with transformers' boolean mask of one row, "
                         f"(1, 1, {total_q}, {total_k}), or none, got dtype {mask.dtype} and shape "
                         f"{tuple(mask.shape)}")
    starts_q, starts_k = _starts(cu_q, total_q), _starts(cu_k, total_k)
    if starts_q is None or starts_k is None or len(starts_q) != len(starts_k):
        return  # not offsets of these tokens: varlen_attention's checks name the argument
    key = (tuple(starts_q), tuple(starts_k), causal, window)
    seen = _CHECKED.get(id(mask))
    if seen is not None and seen[0]() is mask and seen[1] == key:
        return
    for q0, q1, k0, k1 in zip(starts_q, starts_q[1:], starts_k, starts_k[1:]):
        if not bool((mask[0, :, q0:q1, k0:k1] == _kept(q1 - q0, k1 - k0, causal, window, mask.device)).all()):
            raise ValueError("elastic_np attention takes packed sequences (cu_seq_lens_q) with a mask that keeps, "
                             "within each sequence, what causality and the sliding window keep, and this one "
                             "differs (padding?): packed sequences carry no padding; drop the attention_mask or "
                             "the cu_seq_lens")
    if len(_CHECKED) >= 8:
        _CHECKED.clear()
    _CHECKED[id(mask)] = (weakref.ref(mask), key)


def _kept(n, m, causal, window, device):
    """What ``causal`` and ``window`` keep of a sequence of ``n`` queries and ``m`` keys, aligned bottom-right."""
    keep = torch.ones((n, m), dtype=torch.bool, device=device)
    left, right = window
    if causal:
        keep = keep.tril(m - n)
    if left >= 0:
        keep = keep.triu(m - n - left)
    if right >= 0:
        keep = keep.tril(m - n + right)
    return keep


def _starts(cu, total):
    """``cu`` as a list of offsets rising from 0 to ``total``, or None where it is not one."""
    starts = torch.as_tensor(cu).tolist()
    if not isinstance(starts, list) or len(starts) < 2 or starts[0] != 0 or starts[-1] != total \
            or any(b < a for a, b in zip(starts, starts[1:])):
        return None
    return starts


def _mask_options(mask, B, N, M):
    """The options for transformers' boolean mask: ``kv_lengths`` for a prefix of the keys at one query, else ``mask``."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-1] != M:
        raise ValueError(f"elastic_np attention takes transformers' boolean (B, 1, N, M) mask, got dtype "
                         f"{mask.dtype} and shape {tuple(mask.shape)}; a model with a mask of its own needs "
                         "attn_implementation='eager'")
    if N == 1 and mask.shape[1] == 1 and mask.shape[0] in (1, B):
        if bool(mask.all()):  # every key (a decoding step without padding): no option at all, the same
            return {}  # problem, whose call can run the plan of its layout
        keep = mask[:, 0, 0, :].expand(B, M)
        lengths = keep.sum(dim=-1)
        prefix = torch.arange(M, device=mask.device) < lengths[:, None]
        if torch.equal(keep, prefix):
            return {"kv_lengths": lengths}
    return {"mask": mask}
