"""Llama 2, Llama 3.x and Qwen2 / Qwen2.5: decoder-only language models that carry capsules.

One file serves both families; `model_type` ("llama" | "qwen2") picks the few differences.
How they differ from a textbook Transformer:

- Pre-norm blocks with RMSNorm (no mean subtraction, no bias), normalised in fp32 and cast back
  before the weight is applied; a final RMSNorm before the output matrix.
- SwiGLU MLP: down_proj(silu(gate_proj(x)) * up_proj(x)).
- Rotary position embedding on q and k in the half-split form: the two halves of each head are
  rotated against each other (no interleaved pairs), from position ids, theta = rope_theta
  (Llama 2: 1e4, Llama 3: 5e5, Qwen2: 1e6).
- Llama 3.1+ "llama3" rope scaling: long wavelengths are slowed by `factor`, short ones are
  kept, the band between is blended smoothly ("linear" scaling slows them all).
- Grouped-query attention: num_key_value_heads <= num_attention_heads, each key/value head
  serves a group of consecutive query heads.
- head_dim may differ from hidden_size / num_attention_heads (q_proj is then not square).
- Biases: Llama has none unless attention_bias / mlp_bias say so (attention_bias covers o_proj
  too); Qwen2 always has q/k/v biases and never an o_proj or MLP bias.
- The output matrix is either lm_head or tied to the embedding (tie_word_embeddings: Llama 3.2
  1B/3B, small Qwen2 models); a tied one is not a parameter of its own.

Capsules (docs/method.md): the slot(s) sit at sequence index 0 (and 1 for prepend), take position
ids 0 (.. n_slots - 1), and the tokens continue from n_slots. Attention is causal, so a slot sees
only the slots while every token sees them; padding never hides them. The slot summarises the
tokens of `prompt_mask` only, so answer tokens fed for teacher forcing never reach it. With a
key/value cache the slot is formed by the first call (the prompt) and then stays fixed. A model
holding several capsule sets (model.tasks) forms each row's slot with its own set's vectors: the
first call takes `tasks`, and each block gathers its row of the (K, d) table per row.

The baselines (capt/methods.py) sit in the same places: prompt and deep-prompt vectors are rows
at the front like the slot (positions 0..n-1, tokens from n); prefix keys/values are columns in
front of each layer's keys, not rotated, and the tokens' positions start at n (as transformers
reads a prefilled cache from peft); `hidden_at` returns final hidden states for a linear head.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checks import MAX_POSITIONS, check_count, check_fields, check_ids, check_mask, check_positions, check_token_ids
from .errors import CaptError
from .ops import INTEGRATIONS, Linear, attention_with_weights, first_capsules, open_slots, prepend, prepend_heads, pooled_rows, refresh_slots, replace_front, slot_mask, task_index
from .sampling import check_sampling, end_tokens, next_token

MODEL_TYPES = ("llama", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")
MAX_SLOTS = 2  # the rope tables have room for the capsule slots beyond max_position_embeddings

# Qwen2Config's defaults where they differ from LlamaConfig's (used when config.json omits a key).
QWEN2_DEFAULTS = {
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "max_position_embeddings": 32768,
    "num_key_value_heads": 32,
    "bos_token_id": None,
    "eos_token_id": None,
}


@dataclass
class Config:
    """The config.json keys these models read; defaults are LlamaConfig's (Qwen2Config's for qwen2).

    rope_theta / rope_scaling (transformers 4) and rope_parameters (transformers 5) are both
    accepted; after construction rope_theta holds theta and rope_scaling the scaling dict or None.
    """

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    use_sliding_window: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None

    def __post_init__(self):
        check_fields(self, "config.json", positive=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                     "rope_theta"), at_least_zero=("bos_token_id", "eos_token_id", "pad_token_id"))
        if self.max_position_embeddings > MAX_POSITIONS:  # the rope tables are allocated for every position
            raise CaptError(f"config.json: max_position_embeddings {self.max_position_embeddings} is above {MAX_POSITIONS:,}, "
                            "the most capt allocates rope tables for")
        if self.model_type not in MODEL_TYPES:
            raise CaptError(f"model_type {self.model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        if self.hidden_act != "silu":
            raise CaptError(f"hidden_act {self.hidden_act!r} is not supported: Llama and Qwen2 use silu")
        if self.use_sliding_window:
            raise CaptError("use_sliding_window is true: sliding-window attention is not implemented")
        check_token_ids(self, ("eos_token_id", "pad_token_id"), "config.json")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim < 2 or self.head_dim % 2:  # rope rotates the two halves of each head against each other
            raise CaptError(f"config.json: the head dimension is {self.head_dim}, but rope needs an even number of 2 or more")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CaptError(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {self.num_key_value_heads}")
        self._merge_rope_keys()

    def _merge_rope_keys(self):
        """One form for both spellings: rope_theta (float) and rope_scaling (dict with rope_type) or None."""
        scaling = dict(self.rope_parameters or self.rope_scaling or {})
        theta = scaling.pop("rope_theta", self.rope_theta)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
            raise CaptError(f"config.json: rope_theta is {theta!r}, but it must be a positive number")
        self.rope_theta = float(theta)
        rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise CaptError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if rope_type == "default":
            self.rope_scaling = None
        else:
            need = ["factor"] + (["low_freq_factor", "high_freq_factor"] if rope_type == "llama3" else [])
            missing = [k for k in need if k not in scaling]
            if missing:
                raise CaptError(f"{rope_type} rope scaling lacks {', '.join(missing)}")
            bad = [k for k in need if isinstance(scaling[k], bool) or not isinstance(scaling[k], (int, float)) or not 0 < scaling[k] < math.inf]
            if bad or (rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]):
                raise CaptError(f"config.json: {rope_type} rope scaling needs positive numbers with high_freq_factor above "
                                f"low_freq_factor, got {', '.join(f'{k} {scaling[k]!r}' for k in need)}")
            if rope_type == "llama3":
                scaling.setdefault("original_max_position_embeddings", self.max_position_embeddings)
            self.rope_scaling = {"rope_type": rope_type, **scaling}
        self.rope_parameters = None

    # Qwen2's biases are fixed by the architecture (q/k/v biased; o_proj and MLP never), Llama's by flags.
    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type == "llama" and self.attention_bias

    @property
    def mlp_biased(self) -> bool:
        return self.model_type == "llama" and self.mlp_bias

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        known = {f.name for f in dataclasses.fields(cls)}
        values = dict(QWEN2_DEFAULTS) if d.get("model_type") == "qwen2" else {}
        values.update({k: v for k, v in d.items() if k in known})
        return cls(**values)


# ---------------------------------------------------------------------------------------------
# Rotary position embedding


def rope_inverse_frequencies(config: Config, device=None) -> torch.Tensor:
    """(head_dim / 2,) fp32 angular speeds, after the config's rope scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":  # positions divided by factor
        return inv_freq / factor
    # llama3: wavelengths above original/low_freq_factor are slowed by factor, those below
    # original/high_freq_factor are kept, and the band between is a smooth blend of the two
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    slowed = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    in_band = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(in_band, blended, slowed)


def rope_tables(config: Config, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_position_embeddings + MAX_SLOTS, head_dim) fp32, each half repeated."""
    inv_freq = rope_inverse_frequencies(config, device)
    positions = torch.arange(config.max_position_embeddings + MAX_SLOTS, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)  # (P, Dh / 2)
    angles = torch.cat([angles, angles], dim=-1)  # (P, Dh): the half-split layout
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, Dh) by the angles of its positions; cos/sin (B, 1, T, Dh)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # the half-split form: first half pairs with second half
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Key/value cache


class KVCache:
    """Keys and values of every layer, preallocated for max_len columns (capsule slots included).

    key_mask (B, max_len) marks the columns that are real (not padding); seen (B,) counts the
    positions each row has used, so the next token's position id is seen. padded is False while
    no call has brought an attention_mask: then every column is known to be real without reading
    key_mask back from the device.
    """

    def __init__(self, config: Config, batch: int, max_len: int, dtype: torch.dtype, device):
        shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.seen = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0  # columns filled so far
        self.max_len = max_len
        self.padded = False

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's k, v (B, Hkv, T, Dh) for a layer; return all its keys and values so far."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]  # (B, Hkv, past + T, Dh)

    def advance(self, mask: torch.Tensor, padded: bool) -> None:
        """After every layer has stored its keys: account for this call's columns, mask (B, T).

        padded: whether the call brought an attention_mask (which may hold padding).
        """
        end = self.length + mask.shape[1]
        self.key_mask[:, self.length:end] = mask
        self.seen += mask.sum(-1)
        self.length = end
        self.padded = self.padded or padded


# ---------------------------------------------------------------------------------------------
# The blocks


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)  # cast back before the weight, as the checkpoints expect


def native_gqa(q: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """Whether SDPA should group the query heads itself (enable_gqa, no copies of k and v).

    On CUDA only the flash kernel groups heads, and flash takes fp16 / bf16 without a mask; any
    other call would fall back to the math kernel, so there k and v are copied to whole heads and
    the memory-efficient kernel serves (fp32 training included). On the CPU SDPA's own grouping
    was as fast or faster than copying, with a mask or without (docs/speed.md).
    """
    return not q.is_cuda or (attn_mask is None and q.dtype in (torch.float16, torch.bfloat16))


class Attention(nn.Module):
    def __init__(self, config: Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        d = config.hidden_size
        self.q_proj = Linear(d, self.n_heads * self.head_dim, bias=config.qkv_bias)  # Qwen2: always biased
        self.k_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, d, bias=config.o_bias)  # Qwen2: never biased
        self.register_parameter("prefix_k", None)  # (Hkv, n, Dh) prefix tuning's keys/values, set by methods.attach
        self.register_parameter("prefix_v", None)

    def prefix_length(self) -> int:
        return 0 if self.prefix_k is None else self.prefix_k.shape[1]

    def forward(self, x, cos, sin, attn_mask, causal, cache, start=True, attentions=None, out_rows=None):
        """attentions: a list to append this call's weights (B, H, T, S) to (the analysis path), or None (SDPA).
        out_rows (B, K): return the output at these rows only, (B, K, d) (see DecoderLayer)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.prefix_k is not None and start:
            # prefix tuning: n trained keys/values per key/value head in front of this call's, not rotated
            k, v = prepend_heads(self.prefix_k, k), prepend_heads(self.prefix_v, v)  # (B, Hkv, n + T, Dh)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, past + T, Dh)
        # Grouped-query attention: query head h reads key/value head h // groups (see native_gqa).
        groups = self.n_heads // self.n_kv_heads
        native = native_gqa(q, attn_mask) and attentions is None
        if groups > 1 and not native:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, Dh)
        if attentions is not None:  # the analysis path: the same attention written out, its weights kept
            y, weights = attention_with_weights(q, k, v, attn_mask, causal)  # (B, H, T, Dh), (B, H, T, S)
            attentions.append(weights)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                               enable_gqa=groups > 1 and native)  # (B, H, T, Dh)
        y = y.transpose(1, 2)  # (B, T, H, Dh)
        if out_rows is not None:
            y, T = y.gather(1, out_rows[..., None, None].expand(-1, -1, *y.shape[2:])), out_rows.shape[1]  # (B, K, H, Dh)
        return self.o_proj(y.reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_biased
        self.gate_proj = Linear(d, f, bias=bias)
        self.up_proj = Linear(d, f, bias=bias)
        self.down_proj = Linear(f, d, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_parameter("capsule", None)  # p_l (d,), or (K, d) one row per capsule set; set by methods.attach
        self.register_buffer("capsule_active", None, persistent=False)  # (K,) bool: the sets holding this block, when not all
        self.register_parameter("deep_prompt", None)  # (n, d) deep prompt tuning's vectors, set by methods.attach
        self.pooled_before = 0  # the model's pooled rows in front of deep_prompt's (methods.set_pooled)

    def forward(self, x, cos, sin, attn_mask, causal, pool_mask, integration, cache, start=True, task_ids=None,
                attentions=None, out_rows=None):
        """out_rows (B, K): the rows of the output that will be read (the last block, when logits are wanted at
        some positions only). Attention still reads every row, but its output projection and the MLP run at
        these rows only, and the output is (B, K, d): the same numbers as those rows of the full output."""
        # The capsule: entering block l > 0 of S, the slot(s) are re-formed from this block's input.
        # integration is None when the slot is not part of this input (a decode step reads it from the cache).
        if self.capsule is not None and self.layer_idx > 0 and integration is not None:
            p, rows = self.capsule, None
            if task_ids is not None:  # several capsule sets: each row's own vector (B, d), one gather
                p = self.capsule[task_ids]
                rows = None if self.capsule_active is None else self.capsule_active[task_ids]  # (B,) sets holding block l
            x = refresh_slots(x, pool_mask, p, integration, rows)
        # Deep prompt tuning: entering block l > 0, the n front rows are replaced by this block's vectors
        # (start is False in a decode step: the rows were read with the prompt and live in the cache).
        if self.deep_prompt is not None and self.layer_idx > 0 and start:
            x = replace_front(self.deep_prompt, x, self.pooled_before)  # after the pooled rows, if any
        y = self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, causal, cache, start, attentions, out_rows)
        if out_rows is not None:
            x = x.gather(1, out_rows[..., None].expand(-1, -1, x.shape[-1]))  # (B, K, d)
        x = x + y
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The stack: checkpoint keys model.embed_tokens, model.layers.N..., model.norm."""

    def __init__(self, config: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# ---------------------------------------------------------------------------------------------
# The language model


def sdpa_mask(key_mask: torch.Tensor | None, past: int, n: int, device) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for SDPA: n new queries after `past` cached columns.

    key_mask (B, past + n) marks the real columns; None says the caller knows there is no padding,
    which spares a device-to-host read of the mask. Without padding, SDPA's causal flag or no
    mask at all serves where it can (the flash path), else a causal (1, 1, n, past + n) mask; with
    padding a boolean (B, 1, n, past + n) mask where every query also sees itself, so a padded
    query's row is never empty (no NaN).
    """
    if key_mask is not None and bool(key_mask.all()):  # a mask was given, but it holds no padding
        key_mask = None
    if key_mask is None:
        if past == 0:
            return None, True
        if n == 1:  # one new token sees every column before it
            return None, False
    q_index = torch.arange(past, past + n, device=device)[:, None]  # (n, 1)
    k_index = torch.arange(past + n, device=device)[None, :]  # (1, past + n)
    allowed = k_index <= q_index  # (n, past + n)
    if key_mask is None:
        return allowed[None, None], False  # (1, 1, n, past + n)
    allowed = (allowed & key_mask[:, None, :]) | (k_index == q_index)  # (B, n, past + n)
    return allowed[:, None], False  # (B, 1, n, past + n)


class Model(nn.Module):
    """Llama / Qwen2 causal language model (checkpoint keys: model.*, lm_head.weight when untied).

    rope_cos / rope_sin are fp32 tables (non-persistent buffers), whatever dtype the weights
    have: load_model casts only the checkpoint's weights, and model.to(dtype) (or .half(), ...)
    leaves the tables fp32 too; apply_rope casts the looked-up rows to the activations' dtype.
    """

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # (P, Dh) fp32
        self.register_buffer("rope_sin", sin, persistent=False)
        # method slots (capt/protocol.py), filled by methods.attach
        self.method = None  # the attached method's record (methods.MethodConfig)
        self.register_parameter("prompt", None)  # (n, d) prompt tuning's vectors
        self.linear_head: nn.Linear | None = None  # the linear-head baseline's classifier
        self.pooled_tokens = 0  # k training-free instance tokens in front (methods.set_pooled)

    # --- the model contract (capt/protocol.py) ------------------------------------------------

    seq2seq = False

    @property
    def tasks(self) -> list[str] | None:
        """The names of the capsule sets this model holds, in table order (None: one set or none)."""
        return None if self.method is None else self.method.tasks

    @property
    def capsule_width(self) -> int:
        return self.config.hidden_size

    def init_buffers(self, device) -> None:
        """Recompute the rope tables (fp32, on CPU for reproducibility) and put them on device."""
        cos, sin = rope_tables(self.config, "cpu")
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def _apply(self, fn, recurse=True):
        """Module.to and friends: the rope tables follow the device, but a cast is undone by recomputing them in fp32."""
        super()._apply(fn, recurse)
        if self.rope_cos.dtype != torch.float32:
            self.init_buffers(self.rope_cos.device)
        return self

    def checkpoint_aliases(self) -> dict[str, str]:
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    def checkpoint_unused(self) -> set[str]:
        return set()

    def capsule_blocks(self) -> nn.ModuleList:
        return self.model.layers

    def prefix_attentions(self) -> list[nn.Module]:
        """The attention modules that take prefix keys/values: every layer's self-attention."""
        return [layer.self_attn for layer in self.model.layers]

    def prefix_shape(self) -> tuple[int, int]:
        """(key/value heads, head dim) of a prefix: grouped-query attention shares it within a group."""
        return self.config.num_key_value_heads, self.config.head_dim

    def prefix_key_values(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's own keys (before rotation) and values (B, Hkv, T, Dh) for its input h (B, T, d):
        what a prefix's columns stand beside (capt/stepscale.py measures their size)."""
        layer = self.model.layers[i]
        a, x = layer.self_attn, layer.input_layernorm(h)
        B, T, _ = x.shape
        return (a.k_proj(x).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2),
                a.v_proj(x).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2))

    def input_embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def front_length(self) -> int:
        """Key/value columns the attached method puts before the first token (slots, prompt, prefix)."""
        return sum(self.front_counts(start=True))

    def front_counts(self, start: bool) -> tuple[int, int, int]:
        """(capsule slots, prompt or deep-prompt rows, prefix columns) that the attached method puts in
        front of a call's tokens; all zero for a call that continues a cached sequence (start False)."""
        if not start:
            return 0, 0, 0
        integration = None if self.method is None else self.method.integration
        rows = self.prompt if self.prompt is not None else self.model.layers[0].deep_prompt
        return (INTEGRATIONS.get(integration, 0), self.pooled_tokens + (0 if rows is None else rows.shape[0]),
                self.model.layers[0].self_attn.prefix_length())

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for `batch` rows of up to max_len columns (the capsule slots count)."""
        w = self.model.embed_tokens.weight
        return KVCache(self.config, batch, max_len, w.dtype, w.device)

    # --- forward ------------------------------------------------------------------------------

    def output(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output matrix: (B, K, d) -> (B, K, V)."""
        h = self.model.norm(h)
        if self.config.tie_word_embeddings:  # tied output: the embedding matrix read backwards
            return F.linear(h, self.model.embed_tokens.weight)
        return self.lm_head(h)

    def put_front(self, x, mask, pool, seen, n_slots: int, n_front: int, n_prefix: int, task_ids=None):
        """The attached method's rows in front of this call's embeddings x (B, T, d).

        Returns x (B, F + T, d) with F = n_slots + n_front rows in front, the key mask (B, n_prefix + F + T)
        with the prefix columns, slots and rows always visible, the pool mask (B, F + T) and the
        position ids (B, F + T): the front takes positions 0.. in order (prefix columns first), the
        tokens continue after it, padding does not count. task_ids (B,): each row's capsule set.
        """
        positions = seen[:, None] + n_slots + n_front + n_prefix + (mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, T)
        if n_slots:
            # The capsule: slot(s) at index 0 from the prompt's embeddings (+ p_0), always visible, positions 0..n_slots-1.
            p0 = self.model.layers[0].capsule
            if task_ids is not None and p0 is not None:  # several sets: each row's p_0 (zeros for a set without block 0)
                p0 = first_capsules(p0, self.model.layers[0].capsule_active, task_ids)  # (B, d)
            x = open_slots(x, pool, p0, self.method.integration)  # (B, S + T, d)
            mask, pool = slot_mask(mask, n_slots), slot_mask(pool, n_slots)  # (B, S + T)
            positions = torch.cat([seen[:, None] + torch.arange(n_slots, device=x.device), positions], dim=1)
        if n_front:
            # Prompt tuning (model.prompt) or deep prompt tuning (block 0's vectors): n rows at index 0..n-1,
            # always visible, positions 0..n-1; pooled instance tokens (k rows, chunk means of the prompt's
            # embeddings) in front of those.
            pooled = pooled_rows(x, pool, self.pooled_tokens) if self.pooled_tokens else None  # (B, k, d)
            rows = self.prompt if self.prompt is not None else self.model.layers[0].deep_prompt
            if rows is not None:
                x = prepend(rows, x)  # (B, n + T, d)
            if pooled is not None:
                x = torch.cat([pooled, x], dim=1)  # (B, k + n + T, d)
            mask = slot_mask(mask, n_front)
            positions = torch.cat([seen[:, None] + torch.arange(n_front, device=x.device), positions], dim=1)
        if n_prefix:
            mask = slot_mask(mask, n_prefix)  # prefix tuning: every layer's n key/value columns come first, always visible
        return x, mask, pool, positions

    def forward(self, input_ids, attention_mask=None, prompt_mask=None, logits_at=None, cache=None, hidden_at=None,
                tasks=None, attentions=None, hidden_states=None):
        """Logits (B, T, V) for input_ids (B, T), or (B, K, V) at the positions logits_at (B, K).

        attention_mask (B, T): 1 for real tokens, 0 for padding (left or right); with a cache it
            covers this call's tokens only (the cache remembers the rest).
        prompt_mask (B, T): the tokens a capsule may summarise (default: attention_mask); leave
            out answer tokens fed for teacher forcing.
        logits_at (B, K): token positions (0..T-1, slots not counted) where logits are wanted.
        cache: a KVCache from new_cache(); calls on it continue one sequence. With capsules the
            slot is formed by the first call (past == 0) from that call's tokens (under
            prompt_mask): the prompt. Later calls, one token or several (say, candidate answers
            read after a cached prompt), attend to the slot's cached keys/values and never change
            it, and their prompt_mask is not read; so a prompt fed in several chunks gets a slot
            of its first chunk only.
        hidden_at (B, K): return the final hidden states (B, K, d) there (after the final norm),
            instead of logits: what a linear head reads.
        tasks: with several capsule sets loaded (model.tasks), each row's set: a list of names, one
            per row (or one name for all), or a (B,) integer tensor of indices into model.tasks.
            Read by the call that forms the slot (the first on a cache); later calls ignore it.
        attentions: a list; each layer appends its attention weights (B, H, N, S) over the columns
            (prefix, slots, prompt rows, tokens; N rows, S = prefix + past + N columns), computed by
            hand instead of SDPA (the analysis path, capt attention). The outputs are the same.
        hidden_states: a list; the hidden states (B, N, d) entering each block are appended to it (block 0:
            the embeddings with the method's front rows), as they are, still part of the graph.
        """
        check_ids(input_ids, "input_ids", self.config.vocab_size)  # shapes and dtypes; values on the CPU only (checks.py)
        B, T = input_ids.shape
        check_mask(attention_mask, "attention_mask", (B, T))
        check_mask(prompt_mask, "prompt_mask", (B, T))
        for at, name in ((logits_at, "logits_at"), (hidden_at, "hidden_at")):
            if at is not None:
                check_positions(at, name, B, T)
        if cache is not None and cache.seen.shape[0] != B:
            raise CaptError(f"the cache holds {cache.seen.shape[0]} rows, but input_ids has {B}")
        mask = torch.ones(B, T, dtype=torch.bool, device=input_ids.device) if attention_mask is None else attention_mask.bool()
        pool = mask if prompt_mask is None else mask & prompt_mask.bool()
        past = 0 if cache is None else cache.length
        seen = torch.zeros(B, dtype=torch.long, device=input_ids.device) if cache is None else cache.seen
        start = past == 0  # this call begins the sequence: slots, prompts and prefixes go in front of it
        n_slots, n_front, n_prefix = self.front_counts(start)
        task_ids = task_index(tasks, self.tasks, B, input_ids.device) if start else None  # (B,) or None: one set
        x = self.model.embed_tokens(input_ids)  # (B, T, d)
        x, mask, pool, positions = self.put_front(x, mask, pool, seen, n_slots, n_front, n_prefix, task_ids)
        N = x.shape[1]
        if past + n_prefix + N > self.rope_cos.shape[0]:  # columns bound the positions: a position never exceeds its column
            raise CaptError(f"{past + n_prefix + N} key/value columns (padding, capsule slots, prompt and prefix vectors included) "
                            f"exceed the rope table's {self.rope_cos.shape[0]} positions "
                            f"(max_position_embeddings {self.config.max_position_embeddings} + {MAX_SLOTS} for capsule slots)")
        if cache is not None and past + n_prefix + N > cache.max_len:
            raise CaptError(f"the cache holds {cache.max_len} columns; this call needs {past + n_prefix + N}")

        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]  # (B, 1, N, Dh)
        # padding is possible only where an attention_mask came, now or in an earlier call on the cache
        padded = attention_mask is not None or (cache is not None and cache.padded)
        key_mask = None
        if padded:
            key_mask = mask if cache is None else torch.cat([cache.key_mask[:, :past], mask], dim=1)  # (B, past + n_prefix + N)
        attn_mask, causal = sdpa_mask(key_mask, past + n_prefix, N, x.device)
        integration = self.method.integration if n_slots else None
        at = logits_at if hidden_at is None else hidden_at
        # Where only some positions are read, the last block's output projection and MLP run there only
        # (its queries, keys and values still run on every row: about 0.85/L of the forward spared on
        # SmolLM2; the same numbers: tests/test_llama.py checks them bit for bit).
        out_rows = None
        if at is not None and hidden_states is None and attentions is None:
            out_rows = at + n_slots + n_front  # (B, K): rows of x, the slot and the prompt vectors counted
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            if hidden_states is not None:
                hidden_states.append(x)  # (B, N, d) entering this block
            x = layer(x, cos, sin, attn_mask, causal, pool, integration, cache, start, task_ids, attentions,
                      out_rows if i == last else None)
        if cache is not None:
            cache.advance(mask, attention_mask is not None)

        if out_rows is None:
            x = x[:, n_slots + n_front:]  # (B, T, d): outputs never show the slot or the prompt vectors
            if at is not None:
                x = x.gather(1, at[..., None].expand(-1, -1, x.shape[-1]))  # (B, K, d)
        if hidden_at is not None:
            return self.model.norm(x)  # (B, K, d)
        return self.output(x)

    # --- generation ---------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens=20, do_sample=False, temperature=1.0,
                 top_k=None, top_p=None, generator=None, eos_token_id=None, tasks=None):
        """Prompt (B, T) + up to max_new_tokens new tokens, like transformers' generate.

        Prompts in a batch are left-padded. A row that has produced an end token is padded with
        pad_token_id (or the first end token) until every row is done or the budget is spent.
        eos_token_id: an id or a list of ids; None takes the config's, [] never stops early.
        With capsules the slot is formed from the prompt during the first pass and stays fixed; so are
        prompt vectors and prefixes, which the cache keeps. tasks: each row's capsule set, as in forward.
        """
        check_ids(input_ids, "input_ids", self.config.vocab_size)
        B, T = input_ids.shape
        check_mask(attention_mask, "attention_mask", (B, T))
        max_new_tokens = check_count(max_new_tokens, "max_new_tokens")
        if T == 0:
            raise CaptError("generate needs at least one prompt token")
        if attention_mask is not None and not bool(attention_mask[:, -1].bool().all()):
            raise CaptError("generate needs left-padded prompts: a prompt ends with padding")
        check_sampling(do_sample, temperature, top_k, top_p)
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        eos = end_tokens(eos)
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else (eos[0] if eos else 0)
        if max_new_tokens <= 0:
            return input_ids

        cache = self.new_cache(B, self.front_length() + T + max_new_tokens)  # capsule slots, prompt or prefix first
        last = torch.full((B, 1), T - 1, dtype=torch.long, device=input_ids.device)
        logits = self(input_ids, attention_mask=attention_mask, cache=cache, logits_at=last, tasks=tasks)[:, -1]  # (B, V)
        eos_ids = torch.tensor(eos, dtype=torch.long, device=input_ids.device)
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        new = []
        for step in range(max_new_tokens):
            token = next_token(logits, do_sample, temperature, top_k, top_p, generator)
            token = torch.where(done, torch.full_like(token, pad), token)  # finished rows are padded
            new.append(token)
            done |= torch.isin(token, eos_ids)
            if step + 1 == max_new_tokens or bool(done.all()):
                break
            logits = self(token[:, None], cache=cache)[:, -1]
        return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)

