"""A Hugging Face decoder-only ``*ForCausalLM`` as a pipeline's layer sequence, and its loss.

::

    layers = causal_lm_layers(model)      # the model's own modules: the weights are shared
    pipe = GPipe(layers, partitions=4, micro_batches=8, loss_fn=CausalLMLoss(), optimizer=...)
    loss = pipe.train_step((input_ids, attention_mask), labels)
    # == model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

One flattener serves every family whose base model is token embedding -> decoder blocks -> final
norm and whose causal-LM forward is that base model followed by ``lm_head``. The roles are read off
the model object, not looked up by family name: the token embedding is ``get_input_embeddings()``
and the head ``get_output_embeddings()``; of the base model's children, the one ``nn.ModuleList`` is
the blocks, an ``nn.Embedding`` other than the tokens' holds absolute positions (GPT-2's ``wpe``), an
``nn.Dropout`` drops embeddings, a ``*RotaryEmbedding`` makes rotary positions, and the one child left
is the final norm. Anything else is refused (:func:`refusal`) before any work, by name and why:
encoder-decoders, bases with other parts (Bloom's embedding norm, BioGPT's offset positions, OPT's
decoder wrapper), blocks that need more than a mask and positions (MPT's ALiBi) or no mask (RWKV), layer
types other than full and sliding attention (Mamba, Jamba, Qwen3-Next, Llama 4's chunks), a router
loss added to the loss. A model that passes is then run on a short batch beside its layers, padded,
unpadded and without a mask, and in training where its config asks for dropout
(:func:`causal_lm_layers`, ``check``): a forward that does more than what is read off the model
(CTRL's scaled sinusoids, a dropout applied as a function of an attribute no flattener knows) is
refused too.

The layers are ``embeddings`` (token ids, ``(input_ids, attention_mask)`` or ``(input_ids,
attention_mask, position_ids)``, the mask possibly None, to hidden states), ``block_i`` (one decoder
layer each) and ``head`` (final norm, ``lm_head``, logits). Between layers flows the hidden state, with
the 2-D padding mask and the position ids where the batch had them, as integer tensors (no gradient).
Each block recomputes what the base model's forward computes once for all blocks, exactly as it does:
the positions (the ones given, else ``arange`` of the sequence, as transformers derives them without a
cache), the causal mask of its own layer type (``create_causal_mask``, or
``create_sliding_window_causal_mask`` for a sliding layer, from ``config.layer_types`` or, without them,
``config.sliding_window`` where the base model's forward makes a sliding mask at all; packed sequences
read off the position ids where no padding mask is given and the forward's cache is off
(``config.use_cache``, or transformers' gradient checkpointing in training), as the model's forward
reads them) and its rotary cos/sin, from its own copy of the parameter-free rotary module (its buffers
on its own cell's device, which may not be the first block's). Each family's scalings are kept, read off
the model: the embedding multiplier (Granite's ``embedding_multiplier``; Gemma's sqrt(hidden) is inside
its embedding module), the logit soft-capping (``config.final_logit_softcapping``, Gemma 2/3), the logit
scale (Cohere's ``logit_scale``) and the logit divisor (Granite's ``config.logits_scaling``); so are
StarCoder2's embedding dropout (a float attribute its forward applies as a function) and Doge's mask,
built as a tensor even without padding (its forward's ``allow_is_causal_skip=False``).

With ``config.tie_word_embeddings`` the first and the last layer share one ``nn.Parameter`` (cut
into different cells, GPipe keeps a copy in each and sums their gradients).
:func:`~gpipe_repro.models.hf_config.hf_config` (here too) builds a config from a family name and
sizes, or from a ``config.json``, for a model on the meta device.

transformers is imported only when a function here is called.
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpipe_repro.models.hf_check import WRITE_YOUR_OWN, check_same_function
from gpipe_repro.models.hf_config import hf_config

__all__ = ["CausalLMLoss", "causal_lm_layers", "hf_config", "refusal", "TokenEmbedding", "DecoderBlock",
           "LMHead"]

ATTENTION_TYPES = ("full_attention", "sliding_attention")   # the layer types with a causal mask
BLOCK_INPUTS = ("attention_mask", "position_ids", "position_embeddings")   # what a block is given
#: Inputs a family's blocks require that its forward passes as None where its config turns them off,
#: by the config's say: Falcon's ``alibi`` without ALiBi (``config.alibi`` False: rotary positions,
#: Falcon-7B and 40B).
NONE_INPUTS: dict[str, Callable[[Any], bool]] = {"alibi": lambda config: not getattr(config, "alibi", True)}


def _unpack(value: Any) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
    """What flows between the layers: hidden states (token ids into the first), and the mask and
    position ids where the batch had them: a bare tensor, ``(x, mask)`` or ``(x, mask,
    position_ids)`` (the mask may be None)."""
    if isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, tuple):
        return value, None, None
    if not 1 <= len(value) <= 3:
        raise ValueError(f"a causal LM's batch is input_ids, (input_ids, attention_mask) or (input_ids, "
                         f"attention_mask, position_ids), the mask possibly None; got a tuple of "
                         f"{len(value)} items: the layers take no other input")
    return value[0], (value[1] if len(value) > 1 else None), (value[2] if len(value) > 2 else None)


def _pack(hidden: Any, mask: torch.Tensor | None, positions: torch.Tensor | None) -> Any:
    """What a layer passes on: the hidden states alone, or with the mask and the position ids
    where the batch gave them."""
    if positions is not None:
        return hidden, mask, positions
    return hidden if mask is None else (hidden, mask)


def _positions(hidden: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
    """The position ids given with the batch, else as transformers derives them without a cache:
    arange of the sequence, (1, T)."""
    if given is not None:
        return given
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class TokenEmbedding(nn.Module):
    """``input_ids`` or ``(input_ids, attention_mask)`` -> hidden, or ``(hidden, attention_mask)``:
    token embedding, times the family's multiplier, plus absolute positions, dropout (a module, or
    the probability a base model applies as a function: StarCoder2's ``embedding_dropout``)."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None, dropout: nn.Module | None,
                 multiplier: float | None, dropout_p: float | None = None) -> None:
        super().__init__()
        self.tokens, self.positions, self.dropout = tokens, positions, dropout
        self.multiplier, self.dropout_p = multiplier, dropout_p

    def forward(self, batch: Any) -> Any:
        ids, mask, given = _unpack(batch)
        hidden = self.tokens(ids)
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        if self.positions is not None:
            hidden = hidden + self.positions(_positions(hidden, given))
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        if self.dropout_p:
            hidden = nn.functional.dropout(hidden, p=self.dropout_p, training=self.training)
        return _pack(hidden, mask, given)


class DecoderBlock(nn.Module):
    """One decoder layer: hidden (or ``(hidden, attention_mask)``) -> the same. Builds its causal
    mask and, with a rotary module, its cos/sin as the base model's forward does for it;
    `materialize_mask`: always a mask tensor, never None for "causal, no padding" (Doge adds its
    dynamic mask onto it: ``allow_is_causal_skip=False`` in its forward)."""

    def __init__(self, block: nn.Module, config: Any, layer_type: str, rotary: nn.Module | None,
                 materialize_mask: bool = False) -> None:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        super().__init__()
        self.block = block
        self.config = config
        self.layer_type = layer_type
        self.materialize_mask = materialize_mask
        self.make_mask: Callable[..., Any] = (create_sliding_window_causal_mask
                                              if layer_type == "sliding_attention" else create_causal_mask)
        # its own copy, its buffers on this block's device (the config stays shared)
        self.rotary = None if rotary is None else copy.deepcopy(rotary, {id(config): config})
        self.rotary_takes_layer_type = rotary is not None and \
            "layer_type" in inspect.signature(rotary.forward).parameters
        params = inspect.signature(block.forward).parameters
        self.takes_position_ids = "position_ids" in params or any(
            p.kind is p.VAR_KEYWORD for p in params.values())
        self.none_inputs = [name for name in NONE_INPUTS if name in params]   # passed as None

    def forward(self, value: Any) -> Any:
        hidden, mask, given = _unpack(value)
        positions = _positions(hidden, given)
        # Without a padding mask and without a cache, transformers reads packed sequences off the
        # position ids (positions that start again at 0) and masks attention between them; the base
        # model's forward builds a cache where config.use_cache is set (the default), and then it
        # does not; training with transformers' gradient checkpointing on, it sets use_cache off
        # (as GradientCheckpointingLayer checkpoints: the block's flag, in training). So the mask
        # gets the position ids the batch gave where the forward would read them. The check reads
        # their values, which meta tensors (planning) do not have.
        cache = getattr(self.config, "use_cache", False) and not (
            getattr(self.block, "gradient_checkpointing", False) and self.training)
        packed = given if given is not None and not hidden.is_meta and not cache else None
        skip = {"allow_is_causal_skip": False} if self.materialize_mask else {}
        kwargs: dict[str, Any] = {
            "attention_mask": self.make_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask,
                                             cache=None, position_ids=packed, **skip)}
        if self.takes_position_ids:
            kwargs["position_ids"] = positions
        kwargs.update(dict.fromkeys(self.none_inputs))
        if self.rotary is not None:
            by_type = (self.layer_type,) if self.rotary_takes_layer_type else ()
            kwargs["position_embeddings"] = self.rotary(hidden, positions, *by_type)
        out = self.block(hidden, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return _pack(out, mask, given)


class LMHead(nn.Module):
    """hidden (or ``(hidden, attention_mask)``) -> logits: final norm, ``lm_head``, then the family's
    logit scale, divisor and soft-capping, in its forward's order."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, scale: float | None, divisor: float | None,
                 softcap: float | None) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.scale, self.divisor, self.softcap = scale, divisor, softcap

    def forward(self, value: Any) -> torch.Tensor:
        hidden, _, _ = _unpack(value)
        logits = self.lm_head(self.norm(hidden))
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class CausalLMLoss(nn.Module):
    """The causal-LM loss of transformers' models (shift the labels left by one, cross-entropy in
    fp32, ``ignore_index`` -100), as ``(summed loss, number of counted tokens)`` of a micro-batch:
    the pipeline divides the sum of sums by the sum of counts, the token mean over the whole
    mini-batch, so a micro-batch with more padding weighs exactly as in the full batch."""

    def __init__(self, ignore_index: int = -100) -> None:
        super().__init__()
        self.ignore_index = ignore_index

    def _shifted(self, labels: torch.Tensor) -> torch.Tensor:
        """Each position's target: the next token, the last position ignored."""
        return nn.functional.pad(labels, (0, 1), value=self.ignore_index)[..., 1:]

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shifted = self._shifted(labels).to(logits.device)
        total = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                            shifted.reshape(-1), ignore_index=self.ignore_index,
                                            reduction="sum")
        return total, (shifted != self.ignore_index).sum()

    def target_count(self, labels: torch.Tensor) -> float:
        """The tokens the mini-batch's loss counts, before the step (fp16 scales the summed loss by
        the loss scale over it: torch.amp.GradScaler's scale on the token mean)."""
        return float((self._shifted(labels) != self.ignore_index).sum())


# -- reading the model --------------------------------------------------------------------------------

def _scalings(model: Any, base: nn.Module) -> dict[str, float | None] | str:
    """The family's scalings read off the model (see the module docstring), or why they cannot be
    kept: one that is not a plain number (a learned tensor would be a parameter outside the layers)."""
    found = {"multiplier": getattr(base, "embedding_multiplier", None),
             "embedding_dropout": getattr(base, "embedding_dropout", None),
             "scale": getattr(model, "logit_scale", None),
             "divisor": getattr(model.config, "logits_scaling", None),
             "softcap": getattr(model.config, "final_logit_softcapping", None)}
    for role, value in found.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"its {role} ({type(value).__name__}) is not a number"
    return {role: None if value is None else float(value) for role, value in found.items()}


def _materializes_mask(base: nn.Module) -> bool:
    """Whether the base model's forward asks for a mask tensor even without padding
    (``allow_is_causal_skip=False``: Doge adds its dynamic mask onto the causal one), read from its
    source; False where the source is not available (the logits check then tells)."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return "allow_is_causal_skip=False" in source.replace(" ", "")


def _base_parts(model: Any) -> dict[str, Any] | str:
    """The base model's parts by role, or why they cannot be told apart."""
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        return "it has no base model (model.base_model) separate from its head"
    tokens, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(head, nn.Module):
        return "it has no output embeddings (lm_head)"
    parts: dict[str, Any] = {"base": base, "tokens": tokens, "head": head}
    roles: dict[str, list[str]] = {"blocks": [], "rotary": [], "dropout": [], "positions": [], "norm": []}
    for name, child in base.named_children():
        if child is tokens:
            continue
        role = ("blocks" if isinstance(child, nn.ModuleList) else
                "rotary" if type(child).__name__.endswith("RotaryEmbedding") else
                "dropout" if isinstance(child, nn.Dropout) else
                "positions" if type(child) is nn.Embedding else "norm")   # offsets, sinusoids: unknown
        roles[role].append(name)
    children = ", ".join(f"{n} ({type(c).__name__})" for n, c in base.named_children())
    if not any(child is tokens for child in base.children()):
        where = next((n for n, m in base.named_modules() if m is tokens), None)
        return (f"its token embedding is {type(base).__name__}.{where}, not one of its direct parts "
                f"({children}): embedding, blocks and final norm are read off the base model's own "
                "children" if where else
                f"its token embedding is not part of {type(base).__name__} ({children})")
    if len(roles["blocks"]) != 1:
        return (f"{type(base).__name__} has {len(roles['blocks']) or 'no'} lists of modules "
                f"(nn.ModuleList) among its parts ({children}), not one list of decoder blocks")
    for role in ("rotary", "dropout", "positions"):
        if len(roles[role]) > 1:
            return f"{type(base).__name__} has several {role} modules: {', '.join(roles[role])}"
    if not roles["norm"]:
        return f"{type(base).__name__} has no final norm after its blocks ({children})"
    if len(roles["norm"]) > 1:
        found = ", ".join(f"{n} ({type(getattr(base, n)).__name__})" for n in roles["norm"])
        return (f"{type(base).__name__} has parts that are not embedding, blocks, rotary, dropout "
                f"or one final norm: {found}")
    for role, names in roles.items():
        parts[role] = getattr(base, names[0]) if names else None
    if len(parts["blocks"]):
        params = list(inspect.signature(parts["blocks"][0].forward).parameters.values())[1:]
        off = {name for name, is_off in NONE_INPUTS.items() if is_off(model.config)}
        needed = [p.name for p in params if p.default is p.empty and p.name not in BLOCK_INPUTS
                  and p.name not in off
                  and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if needed:
            return (f"its blocks need {', '.join(needed)}, which its forward computes for them (only "
                    "a mask, positions and rotary embeddings are known)")
        if not any(p.name == "attention_mask" or p.kind is p.VAR_KEYWORD for p in params):
            return "its blocks take no attention mask (they are not attention blocks)"
    return parts


def refusal(model: Any) -> str | None:
    """Why `model` cannot be flattened into embed -> blocks -> norm -> head with the same loss, or
    None when it can (see the module docstring). Reads the model object only; runs nothing."""
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import ForCausalLMLoss

    if not isinstance(model, PreTrainedModel):
        return f"it is a {type(model).__name__}, not a transformers model"
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; only decoder-only models are a single chain of blocks"
    if getattr(config, "output_router_logits", False):
        return ("its loss adds the router's auxiliary loss (config.output_router_logits=True), which "
                "depends on every micro-batch's routing; set output_router_logits=False to train on the "
                "language-model loss alone")
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        return "its attention is not causal (is_causal / use_bidirectional_attention)"
    if _loss_function(model) is not ForCausalLMLoss:
        return "its loss is not transformers' ForCausalLMLoss"
    others = sorted(set(getattr(config, "layer_types", None) or []) - set(ATTENTION_TYPES))
    if others:
        return (f"it has {', '.join(others)} layers; only {' and '.join(ATTENTION_TYPES)} layers get "
                "their mask from the padding mask alone")
    parts = _base_parts(model)
    if isinstance(parts, str):
        return f"its forward is not embed -> blocks -> norm -> head: {parts}"
    scalings = _scalings(model, parts["base"])
    return scalings if isinstance(scalings, str) else None


def _loss_function(model: Any) -> Any:
    """The loss `model`'s own forward uses. transformers' ``loss_function`` property warns
    ("`loss_type=None` was set in the config but it is unrecognized") for every config that names no
    loss type, GPT-2's included, and then falls back to its causal-LM loss: that fallback is read here
    without the warning. A model that sets or overrides ``loss_function`` is read as it says."""
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING

    if hasattr(model, "_loss_function") or type(model).loss_function is not PreTrainedModel.loss_function:
        return getattr(model, "loss_function", None)
    return LOSS_MAPPING.get(getattr(model, "loss_type", None) or "", LOSS_MAPPING["ForCausalLM"])


def _layer_types(config: Any, n: int, base: nn.Module) -> list[str]:
    """Each block's attention type, as the family's forward picks its mask: the config's layer types,
    else a sliding window where the config has one and the base model's forward makes a sliding
    mask at all (Moshi's config has a window its forward never applies)."""
    declared = getattr(config, "layer_types", None)
    if declared:
        return list(declared[:n])
    sliding = getattr(config, "sliding_window", None) is not None
    if sliding:
        try:
            sliding = "sliding" in inspect.getsource(type(base).forward)
        except (OSError, TypeError):     # no source to read: the config's word
            pass
    return ["sliding_attention" if sliding else "full_attention"] * n


def causal_lm_layers(model: Any, *, check: bool = True) -> nn.Sequential:
    """`model` (a transformers ``*ForCausalLM``) as ``embeddings, block_0 .. block_{n-1}, head``,
    made of the model's own modules (see the module docstring).

    Raises ValueError naming the family and why, before any work, for a model that is not
    embed -> blocks -> norm -> head (encoder-decoder, recurrent or linear-attention layers, a router
    loss, ...). With `check` (default) and real weights, the layers' logits are compared with
    ``model(...)``'s on a short padded batch (eval mode, no gradient; the modes are restored): a family
    whose forward does more than what is read off the model object is refused rather than trained on
    a different function. A model on the meta device is not run.
    """
    reason = refusal(model)
    if reason is not None:
        family = getattr(getattr(model, "config", None), "model_type", "not a transformers model")
        raise ValueError(f"{type(model).__name__} ({family}) cannot be pipelined by causal_lm_layers: "
                         f"{reason}{'' if 'set ' in reason else '. ' + WRITE_YOUR_OWN}")
    parts, scalings = _base_parts(model), _scalings(model, model.base_model)
    assert not isinstance(parts, str) and not isinstance(scalings, str)
    config = model.config
    blocks = list(parts["blocks"])[:getattr(config, "num_hidden_layers", None) or len(parts["blocks"])]
    layers: dict[str, nn.Module] = {"embeddings": TokenEmbedding(
        parts["tokens"], parts["positions"], parts["dropout"], scalings["multiplier"],
        scalings["embedding_dropout"])}
    materialize = _materializes_mask(model.base_model)
    for i, (block, kind) in enumerate(zip(blocks, _layer_types(config, len(blocks), model.base_model))):
        layers[f"block_{i}"] = DecoderBlock(block, config, kind, parts["rotary"], materialize)
    layers["head"] = LMHead(parts["norm"], parts["head"], scalings["scale"], scalings["divisor"],
                            scalings["softcap"])
    sequence = nn.Sequential()
    for name, layer in layers.items():
        sequence.add_module(name, layer)
    if check:
        check_same_function(model, sequence)
    return sequence
