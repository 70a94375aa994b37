"""Checks of values that come from files: each config.json field has its annotated type and a
sane range, so a bad checkpoint config ends in one line that names the field, never deep in
PyTorch. Used by the models' Config dataclasses (built from config.json).

Every JSON file capt reads goes through read_json (a whole file) or parse_json (one line of a
JSONL file): bytes that are not UTF-8, text that is not JSON, nesting too deep for Python's
parser, integers beyond Python's 4,300-digit limit, lone surrogate escapes ("\\ud800": valid JSON,
but no character, which tokenizers and UTF-8 writers refuse) and a top-level value of the wrong
type all end in one CaptError line naming the file (and line).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from pathlib import Path

import torch

from .errors import CaptError

MAX_POSITIONS = 1 << 21  # max_position_embeddings allowed: rope tables of this many rows are allocated on load
MAX_INT = (1 << 31) - 1  # an integer field's largest value: a size or token id beyond it is no real model's


def _is(value, kind: str) -> bool:
    """Whether value is of an annotated kind: None, bool, int, float, str, dict, list[int]."""
    if kind == "None":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":  # a JSON number: an int counts, bool does not, and it must be finite
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "list[int]":
        return isinstance(value, list) and all(_is(v, "int") for v in value)
    return type(value).__name__ == kind  # str, dict


def is_whole(value, least: int = 0) -> bool:
    """value is an int (not a bool) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_finite(value) -> bool:
    """value is a finite int or float (not a bool): what a JSON number written by capt holds."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def shown(value, width: int = 60) -> str:
    """repr(value) cut to `width` characters, for messages about values from files (which may be huge)."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def check_fields(config, where: str, positive: tuple[str, ...] = (), at_least_zero: tuple[str, ...] = (),
                 unbounded: tuple[str, ...] = ()) -> None:
    """Every field of the dataclass `config` holds its annotated type (check_values)."""
    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    check_values(values, type(config), where, positive, at_least_zero, unbounded)


def check_token_ids(config, names: tuple[str, ...], where: str) -> None:
    """The token ids a model embeds itself (generate feeds a finished row its pad or end token; T5's decoder
    starts from its start token) are rows of its embedding: below vocab_size."""
    for name in names:
        value = getattr(config, name)
        if any(
            v >= config.vocab_size for v in (value if isinstance(value, list) else [] if value is None else [value])
        ):
            raise CaptError(f"{where}: {name} is {shown(value)}, but the embedding has vocab_size {config.vocab_size} "
                            "rows (ids 0.."
                            f"{config.vocab_size - 1})")


def check_values(values: dict, cls, where: str, positive: tuple[str, ...] = (), at_least_zero: tuple[str, ...] = (),
                 unbounded: tuple[str, ...] = ()) -> None:
    """The entries of `values` (a config's fields, a run's saved settings) that name a field of the dataclass
    `cls` hold its annotated type (as a string: "int | None"), integers within MAX_INT (but those named in
    `unbounded`); the fields named in `positive` are > 0 and those in `at_least_zero` >= 0 where they are
    set. A file edited by hand fails here in one line that names the field, not deep in the code."""
    for field in dataclasses.fields(cls):
        if field.name not in values:
            continue
        value = values[field.name]
        if not any(_is(value, kind.strip()) for kind in field.type.split("|")):
            raise CaptError(f"{where}: {field.name} is {shown(value)} ({type(value).__name__}), but it must be "
                            f"{field.type}")
        values_ = value if isinstance(value, list) else [value]
        if field.name not in unbounded and any(_is(v, "int") and abs(v) > MAX_INT for v in values_):
            raise CaptError(f"{where}: {field.name} is {shown(value)}, above {MAX_INT:,}, more than capt takes there")
        if field.name in positive and any(v is not None and v <= 0 for v in values_):
            raise CaptError(f"{where}: {field.name} is {shown(value)}, but it must be above 0")
        if field.name in at_least_zero and any(v is not None and v < 0 for v in values_):
            raise CaptError(f"{where}: {field.name} is {shown(value)}, but it must be 0 or more")


# ---------------------------------------------------------------------------------------------
# JSON files

JSON_TYPES = {
    dict: "object",
    list: "list",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}
# \ud800 .. \udfff: half of a UTF-16 pair, or a lone one
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def json_type(value) -> str:
    """The JSON name of a parsed value's type: object, list, string, number, boolean or null."""
    return JSON_TYPES.get(type(value), type(value).__name__)


def parse_json(raw: bytes | str, file, line: int | None = None):
    """The JSON value of `raw` (a whole file's bytes, or line `line` of a JSONL file), or one
    CaptError line naming the file (and line) and what is wrong."""
    where = f"{file} line {line}:" if line is not None else f"{file} is"
    if isinstance(raw, bytes):
        # the byte-order mark some editors write first
        skip = 3 if line in (None, 1) and raw.startswith(b"\xef\xbb\xbf") else 0
        try:
            raw = raw[skip:].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CaptError(f"{where} not UTF-8 text (byte {e.object[e.start]:#04x} at byte {e.start + skip + 1}"
                            f"{' of the line' if line is not None else ''})") from None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        empty = "the file is empty" if line is None and not raw.strip() else str(e)
        raise CaptError(f"{where} not valid JSON ({empty})") from None
    except RecursionError:
        raise CaptError(f"{where} not valid JSON (nested too deeply for Python's parser)") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise CaptError(f"{where} not JSON capt can read ({str(e).split(';')[0]})") from None
    if SURROGATE_ESCAPE.search(raw):  # a surrogate pair is one character; a lone half is none
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise CaptError(f"{where} not text capt can use: a string holds the lone surrogate escape "
                            f"\\u{ord(e.object[e.start]):04x}, half of a UTF-16 pair and no character") from None
    return value


def read_json(file, what: str, kind: type = dict):
    """The JSON value of `file` (what: what it should be, for messages), which must be a `kind`
    (a JSON object by default); one CaptError line when it cannot be read or is not one."""
    try:
        raw = Path(file).read_bytes()
    except PermissionError:
        raise CaptError(f"cannot read {file}: permission denied") from None
    except OSError as e:
        raise CaptError(f"cannot read {file}: {e.strerror or e}") from None
    value = parse_json(raw, file)
    if not isinstance(value, kind):
        raise CaptError(f"{file} is not {what}: it holds a JSON {json_type(value)}, not "
                        f"{'an' if kind is dict else 'a'} "
                        f"{JSON_TYPES[kind]}")
    return value


# ---------------------------------------------------------------------------------------------
# The models' arguments (the Python API): shapes, dtypes and index ranges, named in one line.
#
# Values are read only from tensors on the CPU, and not while torch.compile traces (a value read
# would break its graph): reading a CUDA tensor's values would make the host wait for the device, a
# sync in every training and evaluation step. On a GPU an id out of range is reported by the
# embedding's own device-side assert instead; capt's own callers check ids on the host first
# (evaluate.check_vocab, from the token lists).


def _readable(t: torch.Tensor) -> bool:
    """Whether t's values may be read here without a device sync or a graph break."""
    return t.device.type == "cpu" and t.numel() > 0 and not torch.compiler.is_compiling()


def _tensor(value, name: str, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CaptError(f"{name} must be a torch tensor of {what}, not {type(value).__name__}")
    return value


def check_ids(ids, name: str, vocab: int) -> None:
    """ids: a (B, T) integer tensor of token ids, each in 0..vocab-1 (read on the CPU only)."""
    _tensor(ids, name, "token ids (B, T)")
    if ids.dim() != 2:
        raise CaptError(f"{name} has shape {tuple(ids.shape)}; it must be (batch, tokens): a 1-D sequence is ids[None]")
    if ids.shape[0] == 0:
        raise CaptError(f"{name} has shape {tuple(ids.shape)}: a batch of no rows")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise CaptError(f"{name} holds {str(ids.dtype).replace('torch.', '')} values; token ids are integers "
                        "(torch.long)")
    if _readable(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < vocab:
        raise CaptError(f"{name} holds ids from {int(ids.min())} to {int(ids.max())}, but the vocabulary has ids "
                        f"0..{vocab - 1}")


def check_mask(mask, name: str, shape: tuple[int, ...]) -> None:
    """mask: None, or a tensor of `shape` holding 1 / True where a token is real (bool, integer or float)."""
    if mask is None:
        return
    _tensor(mask, name, f"shape {shape}")
    if tuple(mask.shape) != tuple(shape):
        raise CaptError(f"{name} has shape {tuple(mask.shape)}, but the ids give {tuple(shape)}")
    if mask.is_complex():
        raise CaptError(f"{name} holds complex values; a mask holds 1 (or True) for real tokens and 0 for padding")


def check_positions(at, name: str, batch: int, length: int) -> None:
    """at: a (B, K) integer tensor of positions into a sequence of `length` (read on the CPU only)."""
    _tensor(at, name, "positions (B, K)")
    if at.dim() != 2 or at.shape[0] != batch:
        raise CaptError(f"{name} has shape {tuple(at.shape)}; it must be ({batch}, K): K positions for each of the "
                        f"{batch} rows")
    if at.dtype == torch.bool or at.is_floating_point() or at.is_complex():
        raise CaptError(f"{name} holds {str(at.dtype).replace('torch.', '')} values; positions are integers "
                        "(torch.long)")
    if _readable(at) and not 0 <= int(at.min()) <= int(at.max()) < length:
        raise CaptError(f"{name} holds positions from {int(at.min())} to {int(at.max())}, but the sequence has "
                        f"0..{length - 1}")


def check_count(value, name: str, least: int = 0) -> int:
    """A whole number >= least (say, max_new_tokens or a batch size), not a bool or a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise CaptError(f"{name} must be a whole number from {least}, got {shown(value)}")
    return int(value)


# ---------------------------------------------------------------------------------------------
# The models' configs (capt/models: each Config's __post_init__ makes one call here)

LLAMA_TYPES = ("llama", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")
FEED_FORWARDS = ("relu", "gated-gelu")


def _positive_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def check_llama_config(c) -> None:
    """A Llama / Qwen2 Config (capt/models/llama.py) as config.json gave it: every field's type and range,
    the architecture's fixed choices, then its derived defaults filled in (num_key_value_heads, head_dim)
    and the two spellings of rope (rope_theta / rope_scaling, transformers 4; rope_parameters,
    transformers 5) merged into one: rope_theta a float, rope_scaling the scaling dict or None."""
    check_fields(c, "config.json", positive=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                 "rope_theta"), at_least_zero=("bos_token_id", "eos_token_id", "pad_token_id"))
    if c.max_position_embeddings > MAX_POSITIONS:  # the rope tables are allocated for every position
        raise CaptError(f"config.json: max_position_embeddings {c.max_position_embeddings} is above {MAX_POSITIONS:,}, "
                        "the most capt allocates rope tables for")
    if c.model_type not in LLAMA_TYPES:
        raise CaptError(f"model_type {c.model_type!r} is not one of {', '.join(LLAMA_TYPES)}")
    if c.hidden_act != "silu":
        raise CaptError(f"hidden_act {c.hidden_act!r} is not supported: Llama and Qwen2 use silu")
    if c.use_sliding_window:
        raise CaptError("use_sliding_window is true: sliding-window attention is not implemented")
    check_token_ids(c, ("eos_token_id", "pad_token_id"), "config.json")
    if c.num_key_value_heads is None:
        c.num_key_value_heads = c.num_attention_heads
    if c.head_dim is None:
        c.head_dim = c.hidden_size // c.num_attention_heads
    if c.head_dim < 2 or c.head_dim % 2:  # rope rotates the two halves of each head against each other
        raise CaptError(f"config.json: the head dimension is {c.head_dim}, but rope needs an even number of 2 or more")
    if c.num_attention_heads % c.num_key_value_heads:
        raise CaptError(f"num_attention_heads {c.num_attention_heads} is not a multiple of "
                        f"num_key_value_heads {c.num_key_value_heads}")
    scaling = dict(c.rope_parameters or c.rope_scaling or {})
    theta = scaling.pop("rope_theta", c.rope_theta)
    if not _positive_number(theta):
        raise CaptError(f"config.json: rope_theta is {theta!r}, but it must be a positive number")
    c.rope_theta = float(theta)
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CaptError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    c.rope_parameters = None
    if rope_type == "default":
        c.rope_scaling = None
        return
    need = ["factor"] + (["low_freq_factor", "high_freq_factor"] if rope_type == "llama3" else [])
    missing = [k for k in need if k not in scaling]
    if missing:
        raise CaptError(f"{rope_type} rope scaling lacks {', '.join(missing)}")
    bad = [k for k in need if not _positive_number(scaling[k])]
    if bad or (rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]):
        raise CaptError(f"config.json: {rope_type} rope scaling needs positive numbers with high_freq_factor above "
                        f"low_freq_factor, got {', '.join(f'{k} {scaling[k]!r}' for k in need)}")
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", c.max_position_embeddings)
    c.rope_scaling = {"rope_type": rope_type, **scaling}


def check_t5_config(c) -> None:
    """A T5 Config (capt/models/t5.py) as config.json gave it: every field's type and range, then its
    defaults that follow from other fields (decoder depth, the v1.0 output scale, the start token)."""
    check_fields(
        c,
        "config.json",
        positive=(
            "vocab_size",
            "d_model",
            "d_kv",
            "d_ff",
            "num_layers",
            "num_decoder_layers",
            "num_heads",
            "relative_attention_num_buckets",
            "relative_attention_max_distance",
            "layer_norm_epsilon",
        ),
        at_least_zero=("decoder_start_token_id", "pad_token_id", "eos_token_id"),
    )
    if c.num_decoder_layers is None:
        c.num_decoder_layers = c.num_layers
    if c.scale_decoder_outputs is None:
        c.scale_decoder_outputs = c.tie_word_embeddings
    if c.decoder_start_token_id is None:
        c.decoder_start_token_id = c.pad_token_id
    check_token_ids(c, ("decoder_start_token_id", "pad_token_id", "eos_token_id"), "config.json")
    if c.feed_forward_proj not in FEED_FORWARDS:
        raise CaptError(f"T5 feed_forward_proj {c.feed_forward_proj!r} is not one of {', '.join(FEED_FORWARDS)}")


# ---------------------------------------------------------------------------------------------
# The models' calls (capt/models: one call at the top of each entry point)


def check_call(ids, name: str, vocab: int, masks: dict | None = None, positions: dict | None = None,
               cache_rows: int | None = None) -> None:
    """One call's tensors: ids (B, T) token ids below vocab; masks {name: mask or None}, each (B, T), or
    {name: (mask, C)} for a mask that also covers C cached columns, (B, C + T); positions {name: (B, K)
    positions into T, or None}; cache_rows: the rows of the cache the call continues (it must be B)."""
    check_ids(ids, name, vocab)
    B, T = ids.shape
    for mask_name, mask in (masks or {}).items():
        mask, cached = mask if isinstance(mask, tuple) else (mask, 0)
        check_mask(mask, mask_name, (B, cached + T))
    for at_name, at in (positions or {}).items():
        if at is not None:
            check_positions(at, at_name, B, T)
    if cache_rows is not None and cache_rows != B:
        raise CaptError(f"the cache holds {cache_rows} rows, but {name} has {B}")


def check_columns(columns: int, rope_rows: int, max_positions: int, cache_len: int | None, slots: int) -> None:
    """A decoder call's key/value columns fit the rope table (rope_rows positions: max_positions + `slots`
    for the capsule slots) and the cache (cache_len columns, or None without one)."""
    if columns > rope_rows:  # columns bound the positions: a position never exceeds its column
        raise CaptError(f"{columns} key/value columns (padding, capsule slots, prompt and prefix vectors included) "
                        f"exceed the rope table's {rope_rows} positions "
                        f"(max_position_embeddings {max_positions} + {slots} for capsule slots)")
    if cache_len is not None and columns > cache_len:
        raise CaptError(f"the cache holds {cache_len} columns; this call needs {columns}")
