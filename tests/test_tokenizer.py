"""capt's tokenizers give the same ids as transformers' on tiny tokenizers trained here."""

import json

import pytest
import sentencepiece as spm
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from capt import CaptError, load_tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Übermäßig große Zahlen: 12345 und 678, naïve café résumé.",
    "Hello   world\nnew line here\tand a tab.",
    "A premise and a hypothesis entail each other; 東京 is a city.",
    "Is the answer True or False? entailment, contradiction, neutral.",
]
TEXTS = [
    "Hello   world\nnew line",
    "Zahlen 12345  über  ñ 東京 ｆｕｌｌｗｉｄｔｈ",
    "  leading and trailing spaces  ",
    "tab\there, digits 0099 and 3.14159",
    "emoji 🙂 and accents: déjà vu",
    "",
]


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("t5tok")
    (d / "corpus.txt").write_text("\n".join(CORPUS * 20))
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "spiece"), vocab_size=60,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   character_coverage=1.0, minloglevel=2)
    (d / "config.json").write_text(json.dumps({"model_type": "t5"}))
    return d


# Qwen2's tokenizer.json splits with this pattern (digits one by one), then maps bytes, after NFC.
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501


def bpe_dir(root, model_type, bos_in_template, tokenizer_config):
    """A byte-level BPE tokenizer.json as Llama 3 / Qwen2 ship them, trained on the corpus."""
    tok = Tokenizer(models.BPE())
    if model_type == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin|>", "<|end|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    if bos_in_template:  # Llama 3 adds its BOS through the post-processor
        tok.post_processor = processors.TemplateProcessing(single="<|begin|> $A", pair="<|begin|> $A <|begin|> $B",
                                                           special_tokens=[("<|begin|>", tok.token_to_id("<|begin|>"))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    root.mkdir()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    return root


def test_t5_ids_equal_transformers(t5_dir):
    ours = load_tokenizer(t5_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(t5_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ids[-1] == ours.eos_token_id  # EOS appended, as T5's tokenizer does
    assert ours.decode(ours.encode("The quick brown fox")) == theirs.decode(
        theirs("The quick brown fox")["input_ids"], skip_special_tokens=True
    )


@pytest.mark.parametrize("style", ["llama3", "llama2", "qwen2"])
def test_bpe_ids_equal_transformers(tmp_path, style):
    if style == "llama3":  # BOS from tokenizer.json's template, nothing said in tokenizer_config
        d = bpe_dir(tmp_path / style, "llama", True, {"bos_token": "<|begin|>", "eos_token": "<|end|>",
                                                      "tokenizer_class": "PreTrainedTokenizerFast"})
    elif style == "llama2":  # tokenizer_config says add_bos_token, and the template agrees
        d = bpe_dir(
            tmp_path / style,
            "llama",
            True,
            {
                "bos_token": "<|begin|>",
                "eos_token": "<|end|>",
                "add_bos_token": True,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
        )
    else:  # Qwen2: no BOS at all
        d = bpe_dir(
            tmp_path / style,
            "qwen2",
            False,
            {
                "eos_token": "<|end|>",
                "pad_token": "<|pad|>",
                "bos_token": None,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
        )
    ours = load_tokenizer(d)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    begin = ours.tok.token_to_id("<|begin|>")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], (style, text)
        assert (ids[:1] == [begin]) == (style != "qwen2")
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_missing_tokenizer_files(tmp_path, t5_dir):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(CaptError, match=r"no spiece\.model in"):
        load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CaptError, match=r"no tokenizer\.json in"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CaptError, match=r"not a valid tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_stored_truncation_and_padding_are_ignored(tmp_path):
    d = bpe_dir(tmp_path / "cut", "llama", True, {"bos_token": "<|begin|>", "eos_token": "<|end|>"})
    plain = Tokenizer.from_file(str(d / "tokenizer.json"))
    stored = Tokenizer.from_file(str(d / "tokenizer.json"))
    stored.enable_truncation(max_length=4)
    stored.enable_padding(length=64, pad_id=stored.token_to_id("<|pad|>"), pad_token="<|pad|>")
    stored.save(str(d / "tokenizer.json"))
    assert json.loads((d / "tokenizer.json").read_text())["truncation"]["max_length"] == 4
    ours = load_tokenizer(d)
    for text in TEXTS:
        want = plain.encode(text).ids
        assert ours.encode(text) == want, text
        assert ours.encode(text, add_special_tokens=False) == plain.encode(text, add_special_tokens=False).ids
    assert len(ours.encode(CORPUS[0])) > 4


@pytest.mark.parametrize("bos_in_template", [True, False])
def test_add_eos_keeps_the_templates_bos(tmp_path, bos_in_template):
    """add_eos_token without add_bos_token: EOS is added by hand, and the BOS the template adds stays."""
    d = bpe_dir(
        tmp_path / "eos",
        "llama",
        bos_in_template,
        {"bos_token": "<|begin|>", "eos_token": "<|end|>", "add_eos_token": True},
    )
    ours = load_tokenizer(d)
    begin, end = ours.tok.token_to_id("<|begin|>"), ours.tok.token_to_id("<|end|>")
    for text in TEXTS:
        body = ours.tok.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == [begin] * bos_in_template + body + [end], text
