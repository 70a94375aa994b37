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

The other methods (capt/baselines.py) act through three seams, None until a method fills them:
`model.front`, rows in front of the input embeddings like the slot (positions 0..n-1, tokens from
n); `layer.entry`, a change to a block's input; `attention.prefix`, key/value columns in front of a
layer's keys, not rotated, with the tokens' positions from n (as transformers reads a prefilled
cache from peft). All three act on the call that begins a sequence; the cache keeps what they put
there. features() returns the final hidden states, what a linear head reads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_call, check_columns, check_count, check_llama_config
from ..errors import CaptError
from .ops import Attend, Slots, capsule_rows, open_slots, refresh_slots, slot_mask, task_index
from .sampling import check_sampling, end_tokens, next_token

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
        # each field's type and range; head_dim, num_key_value_heads and rope filled in (capt/checks.py)
        check_llama_config(self)

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

    @property
    def empty(self) -> bool:
        """No call has stored anything yet: the call now running begins the sequence."""
        return self.length == 0

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


def begins(cache: KVCache | None) -> bool:
    """Whether the call now running begins its sequence (the capsule slot and a method's rows go in front
    of it), or continues a cached one (a decode step; answer tokens read after a cached prompt)."""
    return cache is None or cache.empty


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)  # cast back before the weight, as the checkpoints expect


class Attention(nn.Module):
    def __init__(self, config: Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=config.qkv_bias)  # Qwen2: always biased
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=config.o_bias)  # Qwen2: never biased
        self.attend = Attend()  # SDPA, grouped-query heads included
        self.prefix = None  # seam: a method's key/value columns in front of this layer's (capt/baselines.py)

    def forward(self, x, rope, mask, cache=None, out_rows=None):
        """x (B, T, d) -> (B, T, d). rope: cos, sin (B, 1, T, Dh); mask: SDPA's (attn_mask, is_causal);
        out_rows (B, K): return the output at these rows only, (B, K, d) (see DecoderLayer)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.prefix is not None and begins(cache):
            k, v = self.prefix(k, v)  # (B, Hkv, n + T, Dh): n columns in front of the first call's, not rotated
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, past + T, Dh)
        y = self.attend(q, k, v, *mask).transpose(1, 2)  # (B, T, H, Dh)
        if out_rows is not None:
            # (B, K, H, Dh)
            y, T = y.gather(1, out_rows[..., None, None].expand(-1, -1, *y.shape[2:])), out_rows.shape[1]
        return self.o_proj(y.reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_biased
        self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

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
        self.register_parameter("capsule", None)  # (K, d): p_l, one row per capsule set; set by methods.attach
        # (K,) bool: the sets holding this block, when not all
        self.register_buffer("capsule_active", None, persistent=False)
        self.capsule_instance = None  # extraction / projection: the learned instance part (ops); else the mean
        self.entry = None  # seam: a method's change to this block's input (capt/baselines.py)

    def forward(self, x, rope, mask, cache=None, slots=None, out_rows=None):
        """x (B, N, d): the block's input, the capsule slot(s) or a method's rows in front of the tokens.
        rope, mask: as Attention's. slots: the capsule's state for this call (ops.Slots), None when its
        input holds no slot (a decode step reads it from the cache). out_rows (B, K): the rows of the
        output that will be read (the last block, when logits are wanted at some positions only).
        Attention still reads every row, but its output projection and the MLP run at these rows only,
        and the output is (B, K, d): the same numbers as those rows of the full output."""
        if self.entry is not None and begins(cache):
            x = self.entry(x)
        # The capsule: entering block l > 0 of S, the slot(s) are re-formed from this block's input,
        # slot = p_l + mean(the previous slot, the prompt's real tokens) (a sequence whose set lacks block l keeps its).
        if self.capsule is not None and slots is not None and self.layer_idx > 0:
            p, keep = capsule_rows(self.capsule, slots.rows, self.capsule_active)  # (1 or B, d), (B,) or None
            x = refresh_slots(x, slots.mask, p, slots.integration, keep, self.capsule_instance)
        y = self.self_attn(self.input_layernorm(x), rope, mask, cache, out_rows)
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
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # (P, Dh) fp32
        self.register_buffer("rope_sin", sin, persistent=False)
        # method slots and seams (capt/models/protocol.py), filled by methods.attach
        self.method = None  # the attached method's record (methods.MethodConfig)
        self.front = None  # seam: a method's rows in front of the input embeddings (capt/baselines.py)
        self.linear_head: nn.Linear | None = None  # the linear-head baseline's classifier over features()

    # --- the model contract (capt/models/protocol.py) -----------------------------------------

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
        """Module.to and friends: the rope tables follow the device; a cast is undone by recomputing them in fp32."""
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
        """Key/value columns in front of a sequence's first token: the capsule slot(s), a method's rows
        (front seam) and its key/value columns (every layer's prefix seam holds as many)."""
        slots = 0 if self.method is None else self.method.slots
        prefix = self.model.layers[0].self_attn.prefix
        return slots + (0 if self.front is None else self.front.length) + (0 if prefix is None else prefix.length)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for `batch` rows of up to max_len columns (the capsule slots count)."""
        w = self.model.embed_tokens.weight
        return KVCache(self.config, batch, max_len, w.dtype, w.device)

    # --- forward ------------------------------------------------------------------------------

    def forward(self, input_ids, attention_mask=None, prompt_mask=None, logits_at=None, cache=None, tasks=None):
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
        tasks: with several capsule sets loaded (model.tasks), each row's set: a list of names, one
            per row (or one name for all), or a (B,) integer tensor of indices into model.tasks.
            Read by the call that forms the slot (the first on a cache); later calls ignore it.
        """
        check_call(
            input_ids,
            "input_ids",
            self.config.vocab_size,
            {"attention_mask": attention_mask, "prompt_mask": prompt_mask},
            {"logits_at": logits_at},
            None if cache is None else cache.seen.shape[0],
        )  # (capt/checks.py)
        return self.lm_logits(self.hidden(input_ids, attention_mask, prompt_mask, logits_at, cache, tasks))

    def features(self, input_ids, attention_mask=None, prompt_mask=None, hidden_at=None, tasks=None):
        """The final hidden states (B, T, d), after the final norm, or (B, K, d) at the positions
        hidden_at (B, K): what a linear head reads. The other arguments as forward's."""
        check_call(
            input_ids,
            "input_ids",
            self.config.vocab_size,
            {"attention_mask": attention_mask, "prompt_mask": prompt_mask},
            {"hidden_at": hidden_at},
        )
        return self.hidden(input_ids, attention_mask, prompt_mask, hidden_at, None, tasks)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, K, d), after the final norm -> vocabulary logits (B, K, V)."""
        if self.config.tie_word_embeddings:  # tied output: the embedding matrix read backwards
            return F.linear(h, self.model.embed_tokens.weight)
        return self.lm_head(h)

    def hidden(self, input_ids, attention_mask, prompt_mask, at, cache, tasks) -> torch.Tensor:
        """forward and features: the stack, (B, T, d) or (B, K, d) at the positions `at`, after the final norm."""
        B, T = input_ids.shape
        device = input_ids.device
        mask = torch.ones(B, T, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
        pool = mask if prompt_mask is None else mask & prompt_mask.bool()
        past = 0 if cache is None else cache.length
        # padding not counted
        positions = (0 if cache is None else cache.seen[:, None]) + (mask.long().cumsum(-1) - 1).clamp_min(0)
        x = self.model.embed_tokens(input_ids)  # (B, T, d)
        slots, n_prefix = None, 0
        # the first call: the capsule slot(s) and a method's rows and columns go in front of its tokens
        if begins(cache):
            rows = task_index(tasks, self.tasks, B, device)  # (B,) each row's capsule set, or None: one set
            integration = None if self.method is None else self.method.integration
            if integration is not None:
                # The capsule, before block 0: slot(s) at index 0 from the prompt's embeddings,
                # add: [p_0 + their mean]; prepend: [their mean, p_0] (zeros without block 0).
                block0, n = self.model.layers[0], self.method.slots
                p0 = None if block0.capsule is None else capsule_rows(block0.capsule, rows, block0.capsule_active)[0]
                x = open_slots(x, pool, p0, integration, n, block0.capsule_instance)  # (B, S + T, d)
                # the slots always visible
                mask, slots = slot_mask(mask, n), Slots(integration, slot_mask(pool, n), rows)
            if self.front is not None:  # seam: a method's rows at index 0.., always visible
                x = torch.cat([self.front(x, pool), x], dim=1)  # (B, F + T, d)
                mask = slot_mask(mask, x.shape[1] - mask.shape[1])
            prefix = self.model.layers[0].self_attn.prefix
            n_prefix = 0 if prefix is None else prefix.length
            mask = slot_mask(mask, n_prefix)  # the prefix seam's columns come first in every layer, always visible
        n_front = x.shape[1] - T  # rows in front of the tokens: positions 0.., the tokens continue after the prefix
        if n_front:
            front = torch.arange(n_front, device=device)[None] + (0 if cache is None else cache.seen[:, None])
            positions = torch.cat([front.expand(B, -1), positions + n_front + n_prefix], dim=1)  # (B, F + T)
        elif n_prefix:
            positions = positions + n_prefix
        N = x.shape[1]
        check_columns(past + n_prefix + N, self.rope_cos.shape[0], self.config.max_position_embeddings,
                      None if cache is None else cache.max_len, MAX_SLOTS)
        rope = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]  # (B, 1, N, Dh)
        # padding is possible only where an attention_mask came, now or in an earlier call on the cache
        key_mask = None
        if attention_mask is not None or (cache is not None and cache.padded):
            # (B, past + n_prefix + N)
            key_mask = mask if cache is None else torch.cat([cache.key_mask[:, :past], mask], dim=1)
        attn_mask = sdpa_mask(key_mask, past + n_prefix, N, device)
        # Where only some positions are read, the last block's output projection and MLP run there only
        # (its queries, keys and values still run on every row; the same numbers, bit for bit: tests/test_llama.py).
        out_rows = None if at is None else at + n_front  # (B, K): rows of x, the front rows counted
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, attn_mask, cache, slots, out_rows if i == last else None)
        if cache is not None:
            cache.advance(mask, attention_mask is not None)
        if out_rows is None:
            x = x[:, n_front:]  # (B, T, d): outputs never show the slot or a method's rows
        return self.model.norm(x)

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
        check_call(input_ids, "input_ids", self.config.vocab_size, {"attention_mask": attention_mask})
        B, T = input_ids.shape
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
        # (B, V)
        logits = self(input_ids, attention_mask=attention_mask, cache=cache, logits_at=last, tasks=tasks)[:, -1]
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
