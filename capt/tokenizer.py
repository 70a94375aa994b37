"""Tokenizers behind one small interface: encode(text) -> ids, decode(ids) -> text.

T5 reads `spiece.model` with sentencepiece and appends EOS, as T5's tokenizer does. Llama and
Qwen2 read `tokenizer.json` with tokenizers; whether a BOS token leads is the checkpoint's
decision: `add_bos_token` in tokenizer_config.json when it says, else the post-processor that
tokenizer.json carries (Llama 3 adds <|begin_of_text|> there; Qwen2 adds nothing). Truncation
and padding stored in tokenizer.json are switched off: capt cuts and pads batches itself.
"""

from __future__ import annotations

from pathlib import Path

from .checks import read_json
from .errors import CaptError
from .hub import resolve_model
from .load import read_config


class T5Tokenizer:
    def __init__(self, path: Path):
        import sentencepiece as spm

        file = path / "spiece.model"
        if not file.is_file():
            raise CaptError(f"no spiece.model in {path}: T5 checkpoints need it for tokenization")
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(file))
        except (OSError, RuntimeError) as e:
            raise CaptError(f"{file} is not a sentencepiece model ({e})") from None
        self.eos_token_id = self.sp.eos_id()
        self.pad_token_id = self.sp.pad_id()
        self.bos_token_id = None
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.sp.encode(text)
        return ids + [self.eos_token_id] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in (self.eos_token_id, self.pad_token_id) and i < self.vocab_size]
        return self.sp.decode(ids)


# tokenizer_config.json's special tokens: a string or an AddedToken dict
TOKEN_KEYS = ("bos_token", "eos_token", "pad_token")
FLAG_KEYS = ("add_bos_token", "add_eos_token")


def check_tokenizer_settings(settings: dict, file: Path) -> None:
    """The tokenizer_config.json keys capt reads hold what transformers writes there, checked like a config.json."""
    for key in TOKEN_KEYS:
        token = settings.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if token is not None and not isinstance(token, str):
            raise CaptError(f"{file}: {key} is {settings[key]!r}, but it must be a token's text (or an object with its "
                            "\"content\")")
    for key in FLAG_KEYS:
        if settings.get(key) is not None and not isinstance(settings[key], bool):
            raise CaptError(f"{file}: {key} is {settings[key]!r}, but it must be true, false or null")
    template = settings.get("chat_template")
    if template is not None and not isinstance(template, (str, list)):
        raise CaptError(f"{file}: chat_template is a JSON {type(template).__name__}, but it must be a string (or a "
                        "list of named templates)")


class HFTokenizer:
    """A tokenizer.json (Llama, Qwen2 and any other byte-level BPE checkpoint)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        file = path / "tokenizer.json"
        if not file.is_file():
            raise CaptError(f"no tokenizer.json in {path}: Llama and Qwen2 checkpoints need it for tokenization")
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise CaptError(f"{file} is not a valid tokenizer.json ({e})") from None
        # tokenizer.json may store truncation or padding settings; ids here are never cut or padded silently
        self.tok.no_truncation()
        self.tok.no_padding()
        config_file = path / "tokenizer_config.json"
        settings = read_json(config_file, "a tokenizer_config.json") if config_file.is_file() else {}
        check_tokenizer_settings(settings, config_file)
        self.settings = settings
        self.bos_token_id = self._token_id(settings.get("bos_token"))
        self.eos_token_id = self._token_id(settings.get("eos_token"))
        self.pad_token_id = self._token_id(settings.get("pad_token"))
        if self.pad_token_id is None:
            self.pad_token_id = self.eos_token_id if self.eos_token_id is not None else 0
        self.add_bos = settings.get("add_bos_token")  # None: leave it to tokenizer.json's post-processor
        self.add_eos = bool(settings.get("add_eos_token", False))
        if self.add_bos is None and self.add_eos:
            # EOS is added by hand below, so the BOS the post-processor would add must be too: ask the template
            template = self.tok.encode("", add_special_tokens=True).ids
            self.add_bos = self.bos_token_id is not None and template[:1] == [self.bos_token_id]
        self.chat_template = settings.get("chat_template")
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def _token_id(self, token) -> int | None:
        if isinstance(token, dict):  # older configs store AddedToken dicts
            token = token.get("content")
        return None if token is None else self.tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens:
            return self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos is None and not self.add_eos:
            return self.tok.encode(text, add_special_tokens=True).ids
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if self.add_eos and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def load_tokenizer(path):
    """The tokenizer of the checkpoint directory at path (its config.json picks which kind)."""
    path = resolve_model(path)  # a hub id -> its cached snapshot folder
    config = read_config(path)
    if config["model_type"] == "t5":
        return T5Tokenizer(path)
    return HFTokenizer(path)
