"""elastic_np as an attention of Hugging Face transformers: ``attn_implementation="elastic_np"``.

`register` adds an attention function and the mask function that goes with
it to transformers' registries; a model built with
``attn_implementation="elastic_np"`` then runs every attention layer through
`elastic_np.torch.attention` (forward and backward; CPU or CUDA tensors as
that function takes them). Scaling, grouped-query heads, soft-capping and
gpt-oss's per-head sinks (``s_aux``, the logarithm of ``beta``, with their
gradient) map to the options of the same names; causality, sliding windows
and padding arrive as transformers' boolean mask, which is never dropped:
a decoding step's mask that keeps a prefix of the keys (a static cache's
empty slots, right padding) becomes ``kv_lengths``, so that the keys past
it are never read. What the function cannot honour (attention dropout while
training, packed sequences, attention weights as an output) is an error
naming it.

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

import torch

from elastic_np import torch as enpt

#: The name `register` gives the attention by default.
NAME = "elastic_np"

#: Keyword arguments transformers passes that change nothing here.
_IGNORED = frozenset({"position_ids", "cache_position", "num_items_in_batch", "output_hidden_states",
                      "output_router_logits", "use_cache", "past_key_values", "seq_idx"})
#: Those that describe packed sequences (`cu_seq_lens_q`, ...), which this function does not take yet.
_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def register(name=NAME, backend="auto"):
    """Register the attention and its mask function under ``name`` with transformers.

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


def boolean_mask(*args, **kwargs):
    """transformers' boolean mask ``(B, 1, N, M)`` (True keeps), never skipped for a causal pattern.

    transformers' SDPA mask may be None where torch's ``is_causal`` (top-left
    aligned) stands in for it; the kernels align causality bottom-right, so
    the mask is always formed, and None only where nothing is masked.
    """
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)


def attention_forward(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, s_aux=None, backend="auto", **kwargs):
    """One layer's attention, as transformers calls it: ``(out of shape (B, N, H, Dv), None)``.

    ``query`` is ``(B, H, N, D)``, ``key`` and ``value`` ``(B, Hkv, M, D)``;
    ``attention_mask`` what `boolean_mask` made (or None: every key kept,
    causal where the module is). ``s_aux`` holds gpt-oss's per-head sink
    logits: ``beta = exp(s_aux)``.
    """
    _check_kwargs(module, dropout, kwargs)
    options = {"scale": scaling, "softcap": softcap, "backend": backend}
    if s_aux is not None:
        options["beta"] = torch.exp(s_aux.to(query.dtype))
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
    packed = [name for name in _PACKED if kwargs.get(name) is not None]
    if packed:
        raise ValueError(f"elastic_np attention does not take packed sequences yet ({', '.join(packed)})")
    unknown = sorted(set(kwargs) - _IGNORED - set(_PACKED) - {"output_attentions", "is_causal"})
    if unknown:
        raise TypeError(f"elastic_np attention cannot honour {', '.join(unknown)}")


def _mask_options(mask, B, N, M):
    """The options for transformers' boolean mask: ``kv_lengths`` for a prefix of the keys at one query, else ``mask``."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-1] != M:
        raise ValueError(f"elastic_np attention takes transformers' boolean (B, 1, N, M) mask, got dtype "
                         f"{mask.dtype} and shape {tuple(mask.shape)}; a model with a mask of its own needs "
                         "attn_implementation='eager'")
    if N == 1 and mask.shape[1] == 1:
        keep = mask[:, 0, 0, :].expand(B, M)
        lengths = keep.sum(dim=-1)
        prefix = torch.arange(M, device=mask.device) < lengths[:, None]
        if torch.equal(keep, prefix):
            return {"kv_lengths": lengths}
    return {"mask": mask}
