"""T5 (v1.0, v1.1, Flan-T5): an encoder-decoder Transformer that loads Hugging Face T5 checkpoints.

How T5 differs from a textbook Transformer:
- Positions are a learned scalar bias per head added to the attention logits, looked up by a
  bucketed relative distance (exact for short distances, log-spaced up to a maximum distance).
  The bias table lives in block 0 of each stack only; the bias is computed once per forward and
  shared by every block. Encoder buckets are bidirectional, decoder buckets are causal.
  Cross-attention has no position bias.
- No 1/sqrt(d_kv) on the attention logits (the scale is folded into the initialisation of q).
- num_heads * d_kv need not equal d_model.
- Layer norm is RMS norm: no mean subtraction, no bias, computed in fp32. Pre-norm, with a final
  norm after each stack.
- No biases anywhere.
- Feed-forward: v1.0 is ReLU (`wi`, `wo`); v1.1 / Flan-T5 is gated GELU with the tanh
  approximation (`wi_0` gated, `wi_1` linear, `wo`).
- One embedding matrix (`shared`) serves encoder and decoder. v1.0 ties the output matrix to it
  and scales the decoder output by d_model**-0.5 first; v1.1 has an untied `lm_head` and no scale.
- The decoder starts from decoder_start_token_id (the pad token in T5 checkpoints).

The capsule (docs/method.md) lives in the encoder only: slot(s) at index 0, relative positions
over the extended length (slot at 0, tokens at 1..T), full bidirectional attention, the slot
kept in the encoder output so that the decoder's cross-attention can read it. A model holding
several capsule sets (model.tasks) forms each row's slot with its own set's vectors: encode takes
`tasks`, and each encoder block gathers its row of the (K, d) table per row.

The other methods (capt/baselines.py) act through three seams of the encoder, None until a method
fills them: `model.front`, rows in front of the input embeddings (kept in the encoder output, like
the slot); `block.entry`, a change to an encoder block's input; `attention.prefix`, key/value
columns in front of an encoder self-attention's keys, at relative positions 0..n-1 with the rows
from n (where transformers puts a prefilled cache's keys).

Module and parameter names equal the checkpoint's keys, so loading is a strict load_state_dict.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_call, check_count, check_t5_config
from ..errors import CaptError
from .ops import Attend, Slots, capsule_rows, open_slots, refresh_slots, slot_mask, task_index
from .sampling import check_sampling, end_tokens, next_token


@dataclass
class Config:
    """The fields of a T5 config.json that the model uses; defaults as Hugging Face's T5Config."""

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None  # None: as many as the encoder
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    scale_decoder_outputs: bool | None = None  # None: scale exactly when the output is tied (v1.0)
    decoder_start_token_id: int | None = None  # None: the pad token, as in every T5 checkpoint
    pad_token_id: int = 0
    eos_token_id: int | list[int] | None = 1

    def __post_init__(self):
        # each field's type and range; the defaults that follow from other fields (capt/checks.py)
        check_t5_config(self)

    @property
    def is_gated_act(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# ---------------------------------------------------------------------------------------------
# Relative position buckets


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket of each relative position (key position - query position), in [0, num_buckets).

    Half of the buckets hold one distance each; the other half cover distances up to
    max_distance on a log scale, and everything further shares the last bucket.
    """
    bucket = torch.zeros_like(relative_position)
    if bidirectional:  # encoder: keys after the query get the upper half of the buckets
        num_buckets //= 2
        bucket = (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:  # decoder: keys after the query all fall in bucket 0 (the causal mask hides them)
        distance = (-relative_position).clamp_min(0)
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.clamp_min(1).float() / max_exact) / math.log(max_distance / max_exact)
    far = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp_max(num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, far)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean "may attend" -> 0 where allowed, the most negative finite value elsewhere."""
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), blocked)


def aligned(mask: torch.Tensor) -> torch.Tensor:
    """The additive mask (..., K) in a buffer whose rows are padded to a multiple of 8 columns,
    sliced back to K: the same values, but row strides that SDPA's CUDA kernels take as they are.
    With K (1 + T with the capsule slot) not a multiple of 8 they would pad a copy of the mask in
    every layer's call; here it is done once per forward."""
    width = mask.shape[-1]
    if width % 8 == 0 and mask.is_contiguous():
        return mask
    buffer = mask.new_empty(*mask.shape[:-1], -(-width // 8) * 8)  # (..., K rounded up to 8)
    view = buffer[..., :width]  # (..., K)
    view.copy_(mask)
    return view


# ---------------------------------------------------------------------------------------------
# Building blocks


class T5LayerNorm(nn.Module):
    """RMS norm: scale only, no mean subtraction, no bias; the statistic in fp32."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(self.weight.dtype)


class Attention(nn.Module):
    """Multi-head attention without biases; block 0 of a stack also owns the relative position bias table."""

    def __init__(self, config: Config, has_relative_attention_bias: bool = False):
        super().__init__()
        self.n_heads, self.d_kv = config.num_heads, config.d_kv
        inner = config.num_heads * config.d_kv  # need not equal d_model
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_heads)
            self.num_buckets = config.relative_attention_num_buckets
            self.max_distance = config.relative_attention_max_distance
        self.attend = Attend(scale=1.0)  # SDPA with no 1/sqrt(d_kv) on the logits
        # seam (the encoder's self-attention): a method's key/value columns in front (capt/baselines.py)
        self.prefix = None

    def position_bias(self, query_pos: torch.Tensor, key_pos: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        """(Tq,), (Tk,) positions -> (1, H, Tq, Tk) bias added to the attention logits."""
        relative = key_pos[None, :] - query_pos[:, None]  # (Tq, Tk)
        buckets = relative_position_bucket(relative, bidirectional, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1)[None]  # (1, H, Tq, Tk)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.n_heads, self.d_kv)).transpose(1, 2)  # (B, H, T, Dh)

    def key_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.k(x)), self.heads(self.v(x))

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """Queries from x (B, T, d) over keys/values (B, H, S, Dh); attn_mask holds bias + mask, additive."""
        q = self.heads(self.q(x))  # (B, H, T, Dh)
        out = self.attend(q, k, v, attn_mask, False)  # (B, H, T, Dh)
        return self.o(out.transpose(1, 2).flatten(2))  # (B, T, d)


class DenseReluDense(nn.Module):
    """v1.0: wo(relu(wi x)).  v1.1 / Flan-T5: wo(gelu_tanh(wi_0 x) * wi_1 x)."""

    def __init__(self, config: Config):
        super().__init__()
        self.gated = config.is_gated_act
        if self.gated:
            self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
            self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        else:
            self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:  # "gated-gelu" is the tanh approximation of GELU
            return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))
        return self.wo(F.relu(self.wi(x)))


class LayerSelfAttention(nn.Module):
    def __init__(self, config: Config, has_relative_attention_bias: bool):
        super().__init__()
        self.SelfAttention = Attention(config, has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor, cache: "LayerCache | None" = None) -> torch.Tensor:
        h = self.layer_norm(x)
        k, v = self.SelfAttention.key_values(h)  # (B, H, T, Dh)
        if self.SelfAttention.prefix is not None:
            k, v = self.SelfAttention.prefix(k, v)  # (B, H, n + T, Dh): n columns in front (encoder only)
        if cache is not None:  # incremental decoding: the earlier steps' keys/values come first
            k, v = cache.extend(k, v)
        return x + self.SelfAttention(h, k, v, attn_mask)


class LayerCrossAttention(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.EncDecAttention = Attention(config)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, encoder_states: torch.Tensor, attn_mask: torch.Tensor,
                cache: "LayerCache | None" = None) -> torch.Tensor:
        if cache is not None and cache.cross is not None:  # the encoder output's keys/values, computed once
            k, v = cache.cross
        else:
            k, v = self.EncDecAttention.key_values(encoder_states)  # (Be, H, S, Dh)
            if cache is not None:
                cache.cross = (k, v)
        q = self.layer_norm(x)  # (B, T, d)
        B, T, d = q.shape
        if k.shape[0] != B:
            # B // Be decoder rows per encoded input (say, the candidates of one prompt): cross-attention
            # has no mask between queries, so their queries sit side by side in one row and read the
            # keys/values once, instead of each row reading its own copy
            out = self.EncDecAttention(q.reshape(k.shape[0], -1, d), k, v, attn_mask)  # (Be, B // Be * T, d)
            return x + out.view(B, T, d)
        return x + self.EncDecAttention(q, k, v, attn_mask)


class LayerFF(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.DenseReluDense = DenseReluDense(config)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class EncoderBlock(nn.Module):
    """Self-attention then feed-forward, each pre-normed and residual. May carry a capsule."""

    def __init__(self, config: Config, index: int):
        super().__init__()
        self.index = index
        self.layer = nn.ModuleList(
            [LayerSelfAttention(config, has_relative_attention_bias=index == 0), LayerFF(config)]
        )
        self.register_parameter("capsule", None)  # (K, d): p_l, one row per capsule set; set by methods.attach
        # (K,) bool: the sets holding this block, when not all
        self.register_buffer("capsule_active", None, persistent=False)
        self.capsule_instance = None  # extraction / projection: the learned instance part (ops); else the mean
        self.entry = None  # seam: a method's change to this block's input (capt/baselines.py)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor, slots: Slots | None = None) -> torch.Tensor:
        """x (B, N, d): the block's input, the capsule slot(s) or a method's rows in front of the tokens;
        slots: the capsule's state for this call (ops.Slots), None without a capsule."""
        if self.entry is not None:
            x = self.entry(x)
        # The capsule: entering block l > 0 of S, the slot(s) are re-formed from this block's input,
        # slot = p_l + mean(the previous slot, the real tokens) (a sequence whose set lacks block l keeps its).
        if self.capsule is not None and slots is not None and self.index > 0:
            p, keep = capsule_rows(self.capsule, slots.rows, self.capsule_active)  # (1 or B, d), (B,) or None
            x = refresh_slots(x, slots.mask, p, slots.integration, keep, self.capsule_instance)
        x = self.layer[0](x, attn_mask)
        return self.layer[1](x)


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention over the encoder output, feed-forward."""

    def __init__(self, config: Config, index: int):
        super().__init__()
        self.layer = nn.ModuleList(
            [
                LayerSelfAttention(config, has_relative_attention_bias=index == 0),
                LayerCrossAttention(config),
                LayerFF(config),
            ]
        )

    def forward(self, x, self_mask, encoder_states, cross_mask, cache: "LayerCache | None" = None) -> torch.Tensor:
        x = self.layer[0](x, self_mask, cache)
        x = self.layer[1](x, encoder_states, cross_mask, cache)
        return self.layer[2](x)


class Encoder(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.block = nn.ModuleList([EncoderBlock(config, i) for i in range(config.num_layers)])
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(
        self, h: torch.Tensor, mask: torch.Tensor, slots: Slots | None = None, padded: bool = True
    ) -> torch.Tensor:
        """h (B, N, d) embeddings (slots included), mask (B, N) 1 for slots and real tokens; slots: the
        capsule's state for this call (ops.Slots).

        padded=False promises that mask is all ones: the bias alone, (1, H, N, N), is then shared by
        the whole batch instead of a (B, H, N, N) tensor read by every layer."""
        # the prefix seam's n key columns (if any) take positions 0..n-1 and the rows follow, as transformers
        # places a prefilled cache; the slot(s) or a method's rows come first among the rows, then the tokens
        prefix = self.block[0].layer[0].SelfAttention.prefix
        n_prefix = 0 if prefix is None else prefix.length
        pos = torch.arange(n_prefix + h.shape[1], device=h.device)
        # one bias for the whole stack, from block 0's table; bidirectional buckets
        # (1, H, N, n + N)
        bias = self.block[0].layer[0].SelfAttention.position_bias(pos[n_prefix:], pos, bidirectional=True)
        keys = slot_mask(mask, n_prefix)  # prefix keys are always visible
        # (B or 1, H, N, n + N)
        attn_mask = aligned(bias + additive_mask(keys.bool()[:, None, None, :], bias.dtype) if padded else bias)
        for block in self.block:
            h = block(h, attn_mask, slots)
        return self.final_layer_norm(h)


class Decoder(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.block = nn.ModuleList([DecoderBlock(config, i) for i in range(config.num_decoder_layers)])
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, h, encoder_states, encoder_mask, decoder_mask=None, cache: "Cache | None" = None) -> torch.Tensor:
        """h (B, T, d) decoder embeddings of the new steps. Returns (B, T, d) before the final norm."""
        past = 0 if cache is None else cache.length
        T = h.shape[1]
        query_pos = torch.arange(past, past + T, device=h.device)
        key_pos = torch.arange(past + T, device=h.device)
        # one bias for the whole stack, from block 0's table; causal buckets
        # (1, H, T, past+T)
        bias = self.block[0].layer[0].SelfAttention.position_bias(query_pos, key_pos, bidirectional=False)
        allowed = (key_pos[None, :] <= query_pos[:, None])[None, None]  # (1, 1, T, past+T)
        if decoder_mask is not None:  # padding of the decoder input, over cached and new steps
            allowed = allowed & decoder_mask.bool()[:, None, None, :]
        self_mask = aligned(bias + additive_mask(allowed, bias.dtype))
        # cross-attention: no position bias, only the encoder padding (the capsule slot stays visible)
        cross_mask = aligned(additive_mask(encoder_mask.bool()[:, None, None, :], h.dtype))  # (Be, 1, 1, S)
        for i, block in enumerate(self.block):
            h = block(h, self_mask, encoder_states, cross_mask, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.length += T
        return h


# ---------------------------------------------------------------------------------------------
# Key/value cache for incremental decoding


class LayerCache:
    """One decoder block's keys/values: self-attention grows by each call's steps; cross-attention is set once."""

    def __init__(self):
        self.k: torch.Tensor | None = None  # (B, H, steps so far, Dh)
        self.v: torch.Tensor | None = None
        self.cross: tuple[torch.Tensor, torch.Tensor] | None = None  # (Be, H, S, Dh) each, one row per encoded input

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


class Cache:
    """The decoder's keys/values across calls to Model.decode; `length` decoder steps are stored."""

    def __init__(self, n_layers: int):
        self.layers = [LayerCache() for _ in range(n_layers)]
        self.length = 0


# ---------------------------------------------------------------------------------------------
# The model


class Model(nn.Module):
    """T5 encoder-decoder with a language-model head; capsules (when attached) live in the encoder."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        # encoder and decoder embed_tokens are this matrix
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        if not config.tie_word_embeddings:  # v1.1 / Flan-T5: an output matrix of its own
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # method slots and seams (capt/models/protocol.py), filled by methods.attach
        self.method = None  # the attached method's record (methods.MethodConfig)
        self.front = None  # seam: a method's rows in front of the encoder's input embeddings (capt/baselines.py)
        self.linear_head = None  # never filled: T5 scores targets with its decoder

    # -- the model contract (capt/models/protocol.py) ----------------------------------------------

    seq2seq = True

    @property
    def tasks(self) -> list[str] | None:
        """The names of the capsule sets this model holds, in table order (None: one set or none)."""
        return None if self.method is None else self.method.tasks

    @property
    def capsule_width(self) -> int:
        return self.config.d_model

    def checkpoint_aliases(self) -> dict[str, str]:
        """Checkpoint keys that are copies of a model tensor: the stacks' embed_tokens, a tied lm_head."""
        aliases = {"encoder.embed_tokens.weight": "shared.weight", "decoder.embed_tokens.weight": "shared.weight"}
        if self.config.tie_word_embeddings:
            aliases["lm_head.weight"] = "shared.weight"
        return aliases

    def checkpoint_unused(self) -> set[str]:
        """Checkpoint keys to drop: older conversions carry a cross-attention bias table that T5 never uses."""
        return {"decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"}

    def init_buffers(self, device: torch.device | str) -> None:
        """T5 has no buffers: its position bias is a learned table, loaded like any weight."""

    def capsule_blocks(self) -> nn.ModuleList:
        return self.encoder.block

    def prefix_attentions(self) -> list[nn.Module]:
        """The attention modules that take prefix keys/values: the encoder blocks' self-attention."""
        return [block.layer[0].SelfAttention for block in self.encoder.block]

    def prefix_shape(self) -> tuple[int, int]:
        return self.config.num_heads, self.config.d_kv

    def prefix_key_values(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder block i's own keys and values (B, H, T, Dh) for its input h (B, T, d): what a
        prefix's columns stand beside (capt/stepscale.py measures their size)."""
        layer = self.encoder.block[i].layer[0]
        return layer.SelfAttention.key_values(layer.layer_norm(h))

    def input_embedding(self) -> nn.Embedding:
        return self.shared

    # -- encoder ----------------------------------------------------------------------------

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               tasks=None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (B, T) -> encoder states (B, N, d) and their mask (B, N).

        With capsules N = slots + T (prompt tuning: n + T): the slot(s) stay in the output and in
        the mask, so the decoder's cross-attention reads them. Pass both to decode().
        tasks: with several capsule sets loaded (model.tasks), each row's set: a list of names, one
        per row (or one name for all), or a (B,) integer tensor of indices into model.tasks.
        """
        # (capt/checks.py)
        check_call(input_ids, "input_ids", self.config.vocab_size, {"attention_mask": attention_mask})
        padded = attention_mask is not None  # without a mask the encoder needs no padding mask at all
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        # (B,) each row's capsule set, or None: one set
        rows = task_index(tasks, self.tasks, input_ids.shape[0], input_ids.device)
        h = self.shared(input_ids)  # (B, T, d)
        integration = None if self.method is None else self.method.integration
        slots = None
        if integration is not None:
            # The capsule, before block 0: slot(s) at index 0 from the real tokens' embeddings (T5: every
            # non-pad encoder token), add: [p_0 + their mean]; prepend: [their mean, p_0] (zeros without block 0).
            block0, n = self.encoder.block[0], self.method.slots
            p0 = None if block0.capsule is None else capsule_rows(block0.capsule, rows, block0.capsule_active)[0]
            h = open_slots(h, mask, p0, integration, n, block0.capsule_instance)  # (B, S + T, d)
            mask = slot_mask(mask, n)  # (B, S + T), the slots always visible
            slots = Slots(integration, mask, rows)
        if self.front is not None:  # seam: a method's rows at index 0.., always visible, kept in the encoder output
            h = torch.cat([self.front(h, mask), h], dim=1)  # (B, F + T, d)
            mask = slot_mask(mask, h.shape[1] - mask.shape[1])
        return self.encoder(h, mask, slots, padded), mask

    # -- decoder ----------------------------------------------------------------------------

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        encoder_states: torch.Tensor,
        encoder_mask: torch.Tensor,
        decoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """decoder_input_ids (B, T) -> logits (B, T, V), or (B, K, V) at positions logits_at (B, K).

        encoder_states (Be, N, d) and encoder_mask (Be, N) come from encode(). Be may be B, or a
        divisor of B: then each encoded input serves B // Be consecutive decoder rows (say, the
        candidate targets of one prompt) and its cross-attention keys/values are computed and read once.
        decoder_attention_mask (B, cached + T) marks decoder padding. cache: a Cache from
        new_cache(), extended in place; decoder_input_ids are then only the new steps.
        """
        check_call(
            decoder_input_ids,
            "decoder_input_ids",
            self.config.vocab_size,
            {"decoder_attention_mask": (decoder_attention_mask, 0 if cache is None else cache.length)},
            {"logits_at": logits_at},
        )
        B = decoder_input_ids.shape[0]
        if B % encoder_states.shape[0]:
            raise CaptError(f"decoder batch {B} is not a multiple of the encoder batch {encoder_states.shape[0]}")
        h = self.shared(decoder_input_ids)  # (B, T, d)
        h = self.decoder(h, encoder_states, encoder_mask, decoder_attention_mask, cache)
        if logits_at is not None:  # the final norm and the head only where asked
            h = h.gather(1, logits_at[..., None].expand(-1, -1, h.shape[-1]))  # (B, K, d)
        return self.lm_logits(self.decoder.final_layer_norm(h))

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final decoder states (..., d) -> vocabulary logits (..., V)."""
        if self.config.scale_decoder_outputs:  # v1.0: the tied output is scaled by d_model**-0.5
            h = h * self.config.d_model**-0.5
        weight = self.shared.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(h, weight)

    def new_cache(self) -> Cache:
        return Cache(self.config.num_decoder_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        tasks=None,
    ) -> torch.Tensor:
        """Encode input_ids (B, T), decode decoder_input_ids (B, Td): logits (B, Td, V) or (B, K, V).
        tasks: each row's capsule set when the model holds several (see encode)."""
        if decoder_input_ids is None:
            raise CaptError("T5 forward needs decoder_input_ids (the targets shifted right behind "
                            "decoder_start_token_id)")
        encoder_states, encoder_mask = self.encode(input_ids, attention_mask, tasks)
        return self.decode(decoder_input_ids, encoder_states, encoder_mask, decoder_attention_mask, logits_at=logits_at)

    # -- generation -------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | list[int] | None = None,
        tasks=None,
    ) -> torch.Tensor:
        """Decoder ids (B, 1 + steps), starting with decoder_start_token_id.

        Each sequence stops at its first EOS and is padded with pad_token_id afterwards; the loop
        ends when all have stopped or after max_new_tokens. eos_token_id: None takes the
        config's; an empty list never stops early. tasks: each row's capsule set (see encode).
        """
        check_call(input_ids, "input_ids", self.config.vocab_size)
        max_new_tokens = check_count(max_new_tokens, "max_new_tokens")
        if input_ids.shape[1] == 0:
            raise CaptError("generate needs at least one input token")
        check_sampling(do_sample, temperature, top_k, top_p)
        cfg = self.config
        eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
        eos = torch.tensor(end_tokens(eos), dtype=torch.long, device=input_ids.device)
        encoder_states, encoder_mask = self.encode(input_ids, attention_mask, tasks)
        B = input_ids.shape[0]
        out = torch.full((B, 1), cfg.decoder_start_token_id, dtype=torch.long, device=input_ids.device)
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        cache = self.new_cache()
        step = out
        for _ in range(max_new_tokens):
            logits = self.decode(step, encoder_states, encoder_mask, cache=cache)[:, -1]  # (B, V)
            token = next_token(logits, do_sample, temperature, top_k, top_p, generator)
            token = torch.where(done, cfg.pad_token_id, token)  # finished sequences are padded
            out = torch.cat([out, token[:, None]], dim=1)
            done = done | torch.isin(token, eos)
            if done.all():
                break
            step = token[:, None]
        return out

