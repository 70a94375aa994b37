"""Capsules on a transformers model: train with capt, serve with transformers' own generate and pipelines.

    from transformers import AutoModelForCausalLM
    from capt.hf import attach_capsules

    model = AutoModelForCausalLM.from_pretrained("weights/smollm2-135m-instruct")
    handle = attach_capsules(model, "runs/demo")     # a run directory, its best/, or a save_capsules directory
    model.generate(...)                              # the capsule slot is formed from each prompt
    handle.remove()                                  # the plain model again

The method is docs/method.md's, on an unchanged transformers model (LlamaForCausalLM,
Qwen2ForCausalLM or T5ForConditionalGeneration) instead of capt's own forward. capt's models carry
the capsule inline; here it is put on from outside, which is what hooks are for:

- The stack's forward is wrapped. Its arguments are read by name, the cache as the one argument that is
  a transformers Cache (releases name it differently), and passed on as given. When a call begins a
  sequence (no cache, or an empty one: the prompt), the slot is put in front of the token embeddings,
  slot = p_0 + the mean of the real tokens' embeddings; the attention mask gets a column for it,
  always visible; Llama / Qwen2 positions start at 0 for the slot and continue from 1 for the real
  tokens (left padding allowed), as in capt.models.llama. The slot's own output row is dropped before
  the LM head (decoder-only), or kept in the encoder states that the T5 decoder's cross-attention reads.
- A forward pre-hook on each block l > 0 that carries a capsule re-forms the slot from that
  block's input: slot = p_l + mean(slot, real tokens). The pooling mask of the last call that began
  a sequence stays with the handle, so the blocks' recomputation under gradient checkpointing
  re-forms the same slot.
- A later call on the cache (a decode step, or answer tokens read after a cached prompt) finds the
  slot's keys and values there: the wrapper adds the slot's mask column, moves position ids one on
  (transformers' generate counts positions from the mask it knows, without the slot), and the
  blocks leave the slot alone. T5's decoder gets the slot's column in its cross-attention mask.

Decoder-only: a call may pass `prompt_mask` (B, T), capt's own keyword: the tokens the capsule
summarises (default: the attention mask). Leave teacher-forced answer tokens out of it, as capt's
trainer does; generate and pipelines need nothing. Not supported (a one-line CaptError): the
integrations other than add and capsules of two slots, several capsule sets at once, a 4-D attention
mask (static caches build one), two capsule sets on one model without remove() between them,
generate(use_cache=False), generate continued from an earlier call's cache, copy.deepcopy.

The capsule tensors are used as given, not copied: training them (requires_grad) trains capsules
on the transformers model (bench/bench.py's anchors do).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import warnings
from pathlib import Path

import torch

from .errors import CaptError, CaptWarning
from .load import base_description, read_method_meta, read_tensors, weights_fingerprint
from .methods import CapsuleConfig, capsule_vectors

FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "T5ForConditionalGeneration": "t5"}


def masked_mean(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, N, d), (B, N) -> (B, d) fp32 mean over the marked positions (ops.pool_add_reference's arithmetic)."""
    m = mask.to(torch.float32)
    return torch.einsum("bn,bnd->bd", m, h.float()) / m.sum(1, keepdim=True).clamp_min(1.0)


def _stack(model):
    """(family, the stack that carries capsules: decoder-only model.model, T5 model.encoder, its blocks)."""
    family = FAMILIES.get(type(model).__name__)
    if family is None:
        raise CaptError(f"capsules go on {', '.join(FAMILIES)}, not on a {type(model).__name__}")
    stack = model.encoder if family == "t5" else model.model
    return family, stack, stack.block if family == "t5" else stack.layers


def _width_depth(model, family: str) -> tuple[int, int]:
    c = model.config
    return (c.d_model, c.num_layers) if family == "t5" else (c.hidden_size, c.num_hidden_layers)


def _source_hashes(model) -> dict[str, str]:
    """The hashes of the checkpoint directory the model was loaded from, as capsules.json records its base's:
    config.json's sha256 and the weights' (load.weights_fingerprint); {} when it came from no local directory."""
    directory = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if not (directory / "config.json").is_file():
        return {}
    hashes = {"config_sha256": hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()}
    try:
        hashes["weights_sha256"] = weights_fingerprint(directory)
    except CaptError as e:  # no safetensors there, or unreadable: the config alone, said once
        warnings.warn(CaptWarning(f"the base model's weights were not fingerprinted ({e}); capsules are matched to "
                                  "it by config.json alone"))
    return hashes


def block_numbers(tensors: dict, file) -> list[int]:
    """The block index of each layers.I tensor of a capsules file."""
    numbers = [int(k.split(".")[1]) for k in tensors if k.count(".") == 1 and k.split(".")[1].isdigit()]
    if not numbers:
        raise CaptError(f"{file} holds no capsule (no layers.I tensor)")
    return numbers


def read_capsules(capsules) -> tuple[CapsuleConfig, dict[int, torch.Tensor], dict, str]:
    """(CapsuleConfig, {block: p_l}, the base model they were made for, where they came from) from a
    save_capsules directory, a run directory (its best/), a capt model carrying capsules, or {block: tensor}."""
    if isinstance(capsules, dict):
        if not capsules or not all(
            isinstance(k, int) and isinstance(v, torch.Tensor) and v.dim() == 1 for k, v in capsules.items()
        ):
            raise CaptError("in-memory capsules: give {block index: (d,) tensor}, as capt.methods.capsule_vectors "
                            "returns")
        return CapsuleConfig(blocks=sorted(capsules)), dict(capsules), {}, "in-memory capsules"
    if isinstance(capsules, torch.nn.Module):
        method = getattr(capsules, "method", None)
        if method is None or method.method != "capt" or method.task_capsules is not None:
            raise CaptError("this capt model carries no single capsule set: attach or load one (method capt) first")
        return method.capsule, capsule_vectors(capsules), base_description(capsules), "a capt model"
    if not isinstance(capsules, (str, Path)):
        raise CaptError(f"capsules: give a directory (save_capsules or a run), a capt model or {{block: tensor}}, not "
                        f"{type(capsules).__name__}")
    directory = Path(capsules)
    if not (directory / "capsules.json").is_file() and (directory / "best" / "capsules.json").is_file():
        directory = directory / "best"  # a run directory: its best capsules
    config, base, file = read_method_meta(directory, expect="capt")
    if config.task_capsules is not None:
        raise CaptError(f"{directory} holds several capsule sets; capt.hf attaches one set at a time")
    tensors = read_tensors(file)
    vectors = {}
    depth = base["num_layers"] if "num_layers" in base else 1 + max(block_numbers(tensors, file))
    for i in config.capsule.layer_indices(depth):
        if f"layers.{i}" not in tensors:
            raise CaptError(f"{file} has no layers.{i}, which its capsules.json places a capsule on")
        vectors[i] = tensors[f"layers.{i}"]
    return config.capsule, vectors, base, str(directory)


class CapsuleHandle:
    """What attach_capsules leaves on the model: the capsules in use; remove() restores the plain model."""

    def __init__(self, model, family: str, vectors: dict[int, torch.Tensor], source: str):
        self.model, self.family, self.vectors, self.source = model, family, vectors, source
        # (B, 1 + T): the slot and the tokens it summarises, of the last call that began a sequence
        self._pool: torch.Tensor | None = None
        self._starting = False  # whether the stack's current call begins its sequence (the blocks re-form the slot)
        self._parameters: dict[int, list[str]] = {}  # each wrapped forward's parameter names, for positional arguments
        self._undo = []
        _, stack, blocks = _stack(model)
        self._wrap(stack, self._stack_forward)
        if family == "t5":
            self._wrap(model.decoder, self._decoder_forward)
        self._wrap(model, self._generate, "generate")
        for i, block in enumerate(blocks):
            if i > 0 and i in vectors:
                self._undo.append(block.register_forward_pre_hook(self._refresh(i), with_kwargs=True).remove)
        model._capt_capsules = self

    def _wrap(self, module, wrapper, name: str = "forward") -> None:
        original = getattr(module, name)
        self._parameters[id(original)] = list(inspect.signature(original).parameters)
        # signature kept for generate
        setattr(module, name, functools.wraps(original)(functools.partial(wrapper, original)))
        self._undo.append(lambda: delattr(module, name))

    def __deepcopy__(self, memo):
        raise CaptError("a model carrying capsules (capt.hf) cannot be copied: its forward is wrapped for them; copy "
                        "the "
                        "plain model (handle.remove() first) and attach the capsules to the copy")

    def _generate(self, generate, *args, **kwargs):
        """generate, refused without the cache (each step would form the slot again over the generated tokens too,
        where capt forms it from the prompt once) and from a cache of an earlier call (which counts the slot)."""
        config = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
            raise CaptError("capt.hf: generate(use_cache=False) is not supported: the capsule slot is formed from the "
                            "prompt once and read from the cache after it; generate with the cache (the default)")
        if any(callable(getattr(v, "get_seq_length", None)) and v.get_seq_length() > 0 for v in kwargs.values()):
            raise CaptError("capt.hf: generate from a cache that already holds a sequence is not supported: its first "
                            "column is the capsule slot, which transformers' generate counts as a token; generate "
                            "again "
                            "from the whole prompt")
        return generate(*args, **kwargs)

    def remove(self) -> None:
        """Take the capsules off: the model computes exactly what it did before attach_capsules."""
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        if getattr(self.model, "_capt_capsules", None) is self:
            del self.model._capt_capsules

    # -- the slot ------------------------------------------------------------------------------

    def _slot(self, block: int, mean: torch.Tensor) -> torch.Tensor:
        p = self.vectors.get(block)
        return mean if p is None else mean + p.to(device=mean.device, dtype=torch.float32)

    def _refresh(self, i: int):
        def hook(block, args, kwargs):
            if not self._starting:  # a call that continues a cached sequence: the slot is in the cache
                return None
            h = args[0] if args else kwargs["hidden_states"]  # (B, 1 + T, d)
            if h.shape[:2] != self._pool.shape:
                raise CaptError(f"capt.hf: block {i} got hidden states of {tuple(h.shape[:2])} rows, but the call that "
                                f"began the sequence had {tuple(self._pool.shape)} (the slot and its tokens); a "
                                "forward "
                                "ran between a forward and the backward that recomputes it")
            slot = self._slot(i, masked_mean(h, self._pool))  # p_l + mean(slot, real tokens)
            h = torch.cat([slot[:, None].to(h.dtype), h[:, 1:]], dim=1)
            return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})
        return hook

    def _stack_forward(self, forward, *args, **kwargs):
        """The stack's forward with the slot: the first call of a sequence puts it in front; a later call (a
        decode step, answer tokens after a cached prompt) finds it in the cache. The arguments are read by
        name whatever a release calls its cache (the one argument that is a transformers Cache), and passed
        on as given."""
        # positional arguments, by the forward's own names; a loop, not dict.update, which torch 2.11's dynamo cannot
        # trace: the graph broke here, and the frame it resumed in recompiled at every step (bench's hf-best rows)
        for name, value in zip(self._parameters[id(forward)], args):
            kwargs[name] = value
        prompt_mask = kwargs.pop("prompt_mask", None)
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise CaptError("capt.hf takes a 2-D attention mask (B, T); a 4-D one (a static cache builds one) is not "
                            "supported")
        cache = next((v for v in kwargs.values() if callable(getattr(v, "get_seq_length", None))), None)  # a Cache
        self._starting = cache is None or cache.get_seq_length() == 0  # T5's encoder: always
        # a decode step or answer tokens after a cached prompt: the slot is the cache's first column
        if not self._starting:
            tokens = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
            new = kwargs[tokens].shape[1]
            if kwargs.get("position_ids") is not None:  # generate counts from the mask it knows, without the slot
                kwargs["position_ids"] = kwargs["position_ids"] + 1
            elif attention_mask is not None:  # the real tokens so far, from 1
                kwargs["position_ids"] = attention_mask.long().cumsum(-1)[:, -new:]
            # (neither: transformers counts from the cache's length, which holds the slot)
            if attention_mask is not None:
                kwargs["attention_mask"] = _slot_column(attention_mask)
            if kwargs.get("cache_position") is not None:  # releases that pass it (5.0-5.2x): the new tokens' columns
                kwargs["cache_position"] = cache.get_seq_length() + torch.arange(
                    new, device=kwargs["cache_position"].device
                )
            return forward(**kwargs)
        inputs_embeds = kwargs.pop("inputs_embeds", None)
        input_ids = kwargs.pop("input_ids", None)
        if inputs_embeds is None:
            if input_ids is None:
                raise CaptError("give input_ids or inputs_embeds")
            inputs_embeds = self.model.get_input_embeddings()(input_ids)
        B, T = inputs_embeds.shape[:2]
        ones = torch.ones(B, T, dtype=torch.long, device=inputs_embeds.device)
        mask = ones if attention_mask is None else attention_mask
        pool = mask.bool() if prompt_mask is None else mask.bool() & prompt_mask.bool()
        if prompt_mask is not None and self.family == "t5":
            raise CaptError("prompt_mask is for decoder-only models: T5's capsule summarises every encoder token")
        slot = self._slot(0, masked_mean(inputs_embeds, pool))  # p_0 + mean of the real tokens' embeddings
        # (B, 1 + T, d)
        kwargs["inputs_embeds"] = torch.cat([slot[:, None].to(inputs_embeds.dtype), inputs_embeds], dim=1)
        if attention_mask is not None:
            kwargs["attention_mask"] = _slot_column(attention_mask)
        if kwargs.get("cache_position") is not None:  # the slot's column and the tokens' (releases that pass it)
            kwargs["cache_position"] = torch.arange(1 + T, device=kwargs["cache_position"].device)
        # kept after the call: a backward that recomputes the blocks (gradient checkpointing) reads it again
        self._pool = _slot_column(pool)
        if self.family == "t5":
            return forward(**kwargs)  # the slot stays in the encoder states: the decoder reads it
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # the real tokens from 0 (padding does not count), as transformers' generate counts
            position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)
        # slot 0, tokens 1..
        kwargs["position_ids"] = torch.cat([position_ids.new_zeros(position_ids.shape[0], 1), position_ids + 1], dim=1)
        out = forward(**kwargs)
        out.last_hidden_state = out.last_hidden_state[:, 1:]  # the LM head reads the tokens' rows only
        # output_hidden_states: the tokens' rows, as without capsules
        if getattr(out, "hidden_states", None) is not None:
            out.hidden_states = tuple(h[:, 1:] for h in out.hidden_states)
        return out

    def _decoder_forward(self, forward, *args, encoder_hidden_states=None, encoder_attention_mask=None, **kwargs):
        """T5's decoder: its cross-attention mask gets the slot's column when the encoder states hold the slot."""
        if (encoder_attention_mask is not None and encoder_hidden_states is not None
                and encoder_attention_mask.shape[-1] == encoder_hidden_states.shape[1] - 1):
            encoder_attention_mask = _slot_column(encoder_attention_mask)
        return forward(
            *args, encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=encoder_attention_mask, **kwargs
        )


def _slot_column(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, 1 + T): a first column of ones, the always-visible slot."""
    return torch.cat([mask.new_ones(mask.shape[0], 1), mask], dim=1)


def attach_capsules(model, capsules, *, any_base: bool = False) -> CapsuleHandle:
    """Put one capsule set on a transformers LlamaForCausalLM, Qwen2ForCausalLM or T5ForConditionalGeneration.

    capsules: a save_capsules directory, a run directory (its best/ is used), a capt model carrying
    capsules, or {block index: (d,) tensor}. The set must fit the model (family, width, depth) and,
    when both are known, the base it was trained on: the checkpoint directory the model was loaded
    from must hold the same config.json and weights (load.weights_fingerprint; any_base=True accepts
    another base on purpose).
    Returns the handle; handle.remove() restores the plain model.
    """
    family, _, blocks = _stack(model)
    if getattr(model, "_capt_capsules", None) is not None:
        raise CaptError("this model already carries capsules: call remove() on its handle first (one set at a time)")
    config, vectors, base, source = read_capsules(capsules)
    if config.integration != "add":
        raise CaptError(f"{source}: capt.hf serves the add integration only, not {config.integration}; use capt's own "
                        "models")
    if config.length != 1:
        raise CaptError(
            f"{source}: capt.hf serves one capsule slot a block, not {config.length}; use capt's own models"
        )
    width, depth = _width_depth(model, family)
    made = base.get("model_type")
    if made is not None and made != family:
        raise CaptError(f"{source} were made for a {made} model, not this {family} one")
    wrong = {i: tuple(v.shape) for i, v in vectors.items() if v.shape != (width,)}
    if wrong or any(not 0 <= i < depth for i in vectors) or base.get("num_layers", depth) != depth:
        raise CaptError(f"{source} do not fit this model ({depth} blocks of width {width}): "
                        f"{base.get('num_layers', '?')} blocks, shapes {sorted(set(wrong.values())) or [(width,)]}")
    mine = _source_hashes(model)
    # files made before a hash was recorded lack it
    differ = [k for k, v in mine.items() if base.get(k) not in (None, v)]
    if differ and not any_base:
        shown = ", ".join(f"{k} {base[k][:12]} vs {mine[k][:12]}" for k in differ)
        raise CaptError(f"{source} were trained on another base model ({shown}); pass any_base=True to use them on it "
                        "anyway")
    if any(not torch.isfinite(v).all() for v in vectors.values()):
        raise CaptError(f"{source} hold NaN or infinite values")
    return CapsuleHandle(model, family, vectors, source)
