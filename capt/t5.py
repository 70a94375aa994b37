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

The baselines (capt/methods.py) live in the encoder too: prompt and deep-prompt vectors are rows
at the front like the slot (kept in the encoder output); prefix keys/values go in front of each
encoder self-attention's keys, at relative positions 0..n-1 with the rows from n (where
transformers puts a prefilled cache's keys).

Module and parameter names equal the checkpoint's keys, so loading is a strict load_state_dict.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checks import check_count, check_fields, check_ids, check_mask, check_positions, check_token_ids
from .errors import CaptError
from .ops import INTEGRATIONS, Linear, attention_with_weights, first_capsules, open_slots, prepend, prepend_heads, pooled_rows, refresh_slots, replace_front, slot_mask, task_index
from .sampling import check_sampling, end_tokens, next_token

FEED_FORWARDS = ("relu", "gated-gelu")


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
        check_fields(self, "config.json", positive=("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers",
                     "num_heads", "relative_attention_num_buckets", "relative_attention_max_distance", "layer_norm_epsilon"),
                     at_least_zero=("decoder_start_token_id", "pad_token_id", "eos_token_id"))
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        if self.scale_decoder_outputs is None:
            self.scale_decoder_outputs = self.tie_word_embeddings
        if self.decoder_start_token_id is None:
            self.decoder_start_token_id = self.pad_token_id
        check_token_ids(self, ("decoder_start_token_id", "pad_token_id", "eos_token_id"), "config.json")
        if self.feed_forward_proj not in FEED_FORWARDS:
            raise CaptError(f"T5 feed_forward_proj {self.feed_forward_proj!r} is not one of {', '.join(FEED_FORWARDS)}")

    @property
    def is_gated_act(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# ---------------------------------------------------------------------------------------------
# Relative position buckets


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
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
        self.q = Linear(config.d_model, inner, bias=False)
        self.k = Linear(config.d_model, inner, bias=False)
        self.v = Linear(config.d_model, inner, bias=False)
        self.o = Linear(inner, config.d_model, bias=False)
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_heads)
            self.num_buckets = config.relative_attention_num_buckets
            self.max_distance = config.relative_attention_max_distance
        # (H, n, Dh) prefix tuning's keys/values, set by methods.attach on the encoder's self-attention only
        self.register_parameter("prefix_k", None)
        self.register_parameter("prefix_v", None)

    def prefix_length(self) -> int:
        return 0 if self.prefix_k is None else self.prefix_k.shape[1]

    def position_bias(self, query_pos: torch.Tensor, key_pos: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        """(Tq,), (Tk,) positions -> (1, H, Tq, Tk) bias added to the attention logits."""
        relative = key_pos[None, :] - query_pos[:, None]  # (Tq, Tk)
        buckets = relative_position_bucket(relative, bidirectional, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1)[None]  # (1, H, Tq, Tk)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.n_heads, self.d_kv)).transpose(1, 2)  # (B, H, T, Dh)

    def key_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.k(x)), self.heads(self.v(x))

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor,
                attentions: list | None = None) -> torch.Tensor:
        """Queries from x (B, T, d) over keys/values (B, H, S, Dh); attn_mask holds bias + mask, additive.
        attentions: a list to append the weights (B, H, T, S) to (the analysis path), or None (SDPA)."""
        q = self.heads(self.q(x))  # (B, H, T, Dh)
        # no 1/sqrt(d_kv) on the logits: scale=1.0
        if attentions is not None:  # the analysis path: the same attention written out, its weights kept
            out, weights = attention_with_weights(q, k, v, attn_mask, scale=1.0)  # (B, H, T, Dh), (B, H, T, S)
            attentions.append(weights)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0)  # (B, H, T, Dh)
        return self.o(out.transpose(1, 2).flatten(2))  # (B, T, d)


class DenseReluDense(nn.Module):
    """v1.0: wo(relu(wi x)).  v1.1 / Flan-T5: wo(gelu_tanh(wi_0 x) * wi_1 x)."""

    def __init__(self, config: Config):
        super().__init__()
        self.gated = config.is_gated_act
        if self.gated:
            self.wi_0 = Linear(config.d_model, config.d_ff, bias=False)
            self.wi_1 = Linear(config.d_model, config.d_ff, bias=False)
        else:
            self.wi = Linear(config.d_model, config.d_ff, bias=False)
        self.wo = Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:  # "gated-gelu" is the tanh approximation of GELU
            return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))
        return self.wo(F.relu(self.wi(x)))


class LayerSelfAttention(nn.Module):
    def __init__(self, config: Config, has_relative_attention_bias: bool):
        super().__init__()
        self.SelfAttention = Attention(config, has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor, cache: "LayerCache | None" = None,
                attentions: list | None = None) -> torch.Tensor:
        h = self.layer_norm(x)
        k, v = self.SelfAttention.key_values(h)  # (B, H, T, Dh)
        prefix_k, prefix_v = self.SelfAttention.prefix_k, self.SelfAttention.prefix_v
        if prefix_k is not None:  # prefix tuning: n trained keys/values in front (encoder only)
            k, v = prepend_heads(prefix_k, k), prepend_heads(prefix_v, v)  # (B, H, n + T, Dh)
        if cache is not None:  # incremental decoding: the earlier steps' keys/values come first
            k, v = cache.extend(k, v)
        return x + self.SelfAttention(h, k, v, attn_mask, attentions)


class LayerCrossAttention(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.EncDecAttention = Attention(config)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, encoder_states: torch.Tensor, attn_mask: torch.Tensor, cache: "LayerCache | None" = None,
                attentions: list | None = None) -> torch.Tensor:
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
            out = self.EncDecAttention(q.reshape(k.shape[0], -1, d), k, v, attn_mask, attentions)  # (Be, B // Be * T, d)
            if attentions is not None:  # the weights back to one decoder row each: (Be, H, B // Be * T, S) -> (B, H, T, S)
                w = attentions[-1]
                attentions[-1] = w.unflatten(2, (B // k.shape[0], T)).transpose(1, 2).reshape(B, w.shape[1], T, w.shape[-1])
            return x + out.view(B, T, d)
        return x + self.EncDecAttention(q, k, v, attn_mask, attentions)


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
        self.layer = nn.ModuleList([LayerSelfAttention(config, has_relative_attention_bias=index == 0), LayerFF(config)])
        self.register_parameter("capsule", None)  # p_l (d,), or (K, d) one row per capsule set; set by methods.attach
        self.register_buffer("capsule_active", None, persistent=False)  # (K,) bool: the sets holding this block, when not all
        self.register_parameter("deep_prompt", None)  # (n, d) deep prompt tuning's vectors, set by methods.attach
        self.pooled_before = 0  # the model's pooled rows in front of deep_prompt's (methods.set_pooled)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor, pool_mask: torch.Tensor, integration: str | None,
                task_ids: torch.Tensor | None = None, attentions: list | None = None) -> torch.Tensor:
        if self.capsule is not None and self.index > 0 and integration is not None:
            # the capsule: entering a later block in S, the slot is re-formed from p_l and the mean
            # of the previous slot and the real tokens (block 0's capsule went in with the embeddings)
            p, rows = self.capsule, None
            if task_ids is not None:  # several capsule sets: each row's own vector (B, d), one gather
                p = self.capsule[task_ids]
                rows = None if self.capsule_active is None else self.capsule_active[task_ids]  # (B,) sets holding this block
            x = refresh_slots(x, pool_mask, p, integration, rows)
        if self.deep_prompt is not None and self.index > 0:
            # deep prompt tuning: entering a later block, the n front rows are replaced by this block's vectors
            x = replace_front(self.deep_prompt, x, self.pooled_before)  # after the pooled rows, if any
        x = self.layer[0](x, attn_mask, attentions=attentions)
        return self.layer[1](x)


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention over the encoder output, feed-forward."""

    def __init__(self, config: Config, index: int):
        super().__init__()
        self.layer = nn.ModuleList(
            [LayerSelfAttention(config, has_relative_attention_bias=index == 0), LayerCrossAttention(config), LayerFF(config)]
        )

    def forward(self, x, self_mask, encoder_states, cross_mask, cache: "LayerCache | None" = None,
                cross_attentions: list | None = None) -> torch.Tensor:
        x = self.layer[0](x, self_mask, cache)
        x = self.layer[1](x, encoder_states, cross_mask, cache, cross_attentions)
        return self.layer[2](x)


class Encoder(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.block = nn.ModuleList([EncoderBlock(config, i) for i in range(config.num_layers)])
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, h: torch.Tensor, mask: torch.Tensor, integration: str | None = None, padded: bool = True,
                task_ids: torch.Tensor | None = None, attentions: list | None = None,
                hidden_states: list | None = None) -> torch.Tensor:
        """h (B, N, d) embeddings (slots included), mask (B, N) 1 for slots and real tokens; task_ids (B,)
        each row's capsule set when the model holds several; attentions: a list for each block's weights;
        hidden_states: a list for the hidden states (B, N, d) entering each block.

        padded=False promises that mask is all ones: the bias alone, (1, H, N, N), is then shared by
        the whole batch instead of a (B, H, N, N) tensor read by every layer."""
        # prefix tuning's n key columns (if any) take positions 0..n-1 and the rows follow, as transformers
        # places a prefilled cache; the slot(s) or prompt vectors come first among the rows, then the tokens
        n_prefix = self.block[0].layer[0].SelfAttention.prefix_length()
        pos = torch.arange(n_prefix + h.shape[1], device=h.device)
        # one bias for the whole stack, from block 0's table; bidirectional buckets
        bias = self.block[0].layer[0].SelfAttention.position_bias(pos[n_prefix:], pos, bidirectional=True)  # (1, H, N, n + N)
        keys = slot_mask(mask, n_prefix)  # prefix keys are always visible
        attn_mask = aligned(bias + additive_mask(keys.bool()[:, None, None, :], bias.dtype) if padded else bias)  # (B or 1, H, N, n + N)
        for block in self.block:
            if hidden_states is not None:
                hidden_states.append(h)  # (B, N, d) entering this block
            h = block(h, attn_mask, mask, integration, task_ids, attentions)
        return self.final_layer_norm(h)


class Decoder(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.block = nn.ModuleList([DecoderBlock(config, i) for i in range(config.num_decoder_layers)])
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, h, encoder_states, encoder_mask, decoder_mask=None, cache: "Cache | None" = None,
                cross_attentions: list | None = None) -> torch.Tensor:
        """h (B, T, d) decoder embeddings of the new steps. Returns (B, T, d) before the final norm.
        cross_attentions: a list for each block's cross-attention weights (B, H, T, S)."""
        past = 0 if cache is None else cache.length
        T = h.shape[1]
        query_pos = torch.arange(past, past + T, device=h.device)
        key_pos = torch.arange(past + T, device=h.device)
        # one bias for the whole stack, from block 0's table; causal buckets
        bias = self.block[0].layer[0].SelfAttention.position_bias(query_pos, key_pos, bidirectional=False)  # (1, H, T, past+T)
        allowed = (key_pos[None, :] <= query_pos[:, None])[None, None]  # (1, 1, T, past+T)
        if decoder_mask is not None:  # padding of the decoder input, over cached and new steps
            allowed = allowed & decoder_mask.bool()[:, None, None, :]
        self_mask = aligned(bias + additive_mask(allowed, bias.dtype))
        # cross-attention: no position bias, only the encoder padding (the capsule slot stays visible)
        cross_mask = aligned(additive_mask(encoder_mask.bool()[:, None, None, :], h.dtype))  # (Be, 1, 1, S)
        for i, block in enumerate(self.block):
            h = block(h, self_mask, encoder_states, cross_mask, None if cache is None else cache.layers[i], cross_attentions)
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
        self.shared = nn.Embedding(config.vocab_size, config.d_model)  # encoder and decoder embed_tokens are this matrix
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        if not config.tie_word_embeddings:  # v1.1 / Flan-T5: an output matrix of its own
            self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        # method slots (capt/protocol.py), filled by methods.attach
        self.method = None  # the attached method's record (methods.MethodConfig)
        self.register_parameter("prompt", None)  # (n, d) prompt tuning's vectors
        self.linear_head = None  # never filled: T5 scores targets with its decoder
        self.pooled_tokens = 0  # k training-free instance tokens in front (methods.set_pooled)

    # -- the model contract (capt/protocol.py) ----------------------------------------------

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
               tasks=None, attentions: list | None = None, hidden_states: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (B, T) -> encoder states (B, N, d) and their mask (B, N).

        With capsules N = slots + T (prompt tuning: n + T): the slot(s) stay in the output and in
        the mask, so the decoder's cross-attention reads them. Pass both to decode().
        tasks: with several capsule sets loaded (model.tasks), each row's set: a list of names, one
        per row (or one name for all), or a (B,) integer tensor of indices into model.tasks.
        attentions: a list; each encoder block appends its self-attention weights (B, H, N, n_prefix + N),
        computed by hand instead of SDPA (the analysis path, capt attention). The outputs are the same.
        hidden_states: a list; the hidden states (B, N, d) entering each encoder block are appended to it
        (block 0: the embeddings with the method's front rows).
        """
        check_ids(input_ids, "input_ids", self.config.vocab_size)  # shapes and dtypes; values on the CPU only (checks.py)
        check_mask(attention_mask, "attention_mask", tuple(input_ids.shape))
        padded = attention_mask is not None  # without a mask the encoder needs no padding mask at all
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        integration = None if self.method is None else self.method.integration
        task_ids = task_index(tasks, self.tasks, input_ids.shape[0], input_ids.device)  # (B,), or None: one set
        h, mask = self.put_front(self.shared(input_ids), attention_mask, integration, task_ids)  # (B, F + T, d), (B, F + T)
        h = self.encoder(h, mask, integration, padded, task_ids, attentions, hidden_states)
        return h, mask

    def put_front(self, h: torch.Tensor, mask: torch.Tensor, integration: str | None,
                  task_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The attached method's rows in front of the token embeddings h (B, T, d) and their mask (B, T)."""
        pooled = pooled_rows(h, mask, self.pooled_tokens) if self.pooled_tokens else None  # (B, k, d) from the tokens alone
        if integration is not None:
            # the capsule: slot(s) at index 0 from the mean of the real tokens' embeddings (+ p_0);
            # for T5 every non-pad encoder token is summarised
            p0 = self.encoder.block[0].capsule
            if task_ids is not None and p0 is not None:  # several sets: each row's p_0 (zeros for a set without block 0)
                p0 = first_capsules(p0, self.encoder.block[0].capsule_active, task_ids)  # (B, d)
            h = open_slots(h, mask, p0, integration)  # (B, S + T, d)
            mask = slot_mask(mask, INTEGRATIONS[integration])  # (B, S + T), the slots always visible
        front = self.prompt if self.prompt is not None else self.encoder.block[0].deep_prompt
        if front is not None:
            # prompt tuning (model.prompt) or deep prompt tuning (block 0's vectors): n rows at index 0..n-1,
            # always visible, kept in the encoder output like the slot
            h = prepend(front, h)  # (B, n + T, d)
            mask = slot_mask(mask, front.shape[0])
        if pooled is not None:  # pooled instance tokens: k chunk means of the embeddings, in front of the prompt rows
            h = torch.cat([pooled, h], dim=1)  # (B, k + n + T, d)
            mask = slot_mask(mask, self.pooled_tokens)
        return h, mask

    # -- decoder ----------------------------------------------------------------------------

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        encoder_states: torch.Tensor,
        encoder_mask: torch.Tensor,
        decoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        logits_at: torch.Tensor | None = None,
        cross_attentions: list | None = None,
    ) -> torch.Tensor:
        """decoder_input_ids (B, T) -> logits (B, T, V), or (B, K, V) at positions logits_at (B, K).

        encoder_states (Be, N, d) and encoder_mask (Be, N) come from encode(). Be may be B, or a
        divisor of B: then each encoded input serves B // Be consecutive decoder rows (say, the
        candidate targets of one prompt) and its cross-attention keys/values are computed and read once.
        decoder_attention_mask (B, cached + T) marks decoder padding. cache: a Cache from
        new_cache(), extended in place; decoder_input_ids are then only the new steps.
        cross_attentions: a list; each decoder block appends its cross-attention weights (B, H, T, N)
        over the encoder states (slots and prompt rows included), computed by hand (capt attention).
        """
        check_ids(decoder_input_ids, "decoder_input_ids", self.config.vocab_size)
        B, T = decoder_input_ids.shape
        check_mask(decoder_attention_mask, "decoder_attention_mask", (B, (0 if cache is None else cache.length) + T))
        if logits_at is not None:
            check_positions(logits_at, "logits_at", B, T)
        if B % encoder_states.shape[0]:
            raise CaptError(f"decoder batch {B} is not a multiple of the encoder batch {encoder_states.shape[0]}")
        h = self.shared(decoder_input_ids)  # (B, T, d)
        h = self.decoder(h, encoder_states, encoder_mask, decoder_attention_mask, cache, cross_attentions)
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
            raise CaptError("T5 forward needs decoder_input_ids (the targets shifted right behind decoder_start_token_id)")
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
        check_ids(input_ids, "input_ids", self.config.vocab_size)
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

