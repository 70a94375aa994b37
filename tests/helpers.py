"""Builders shared by the tests: tiny random checkpoints with real tokenizers, and tiny SuperGLUE files.

    tiny_llama(dir)   a 2-layer Llama (transformers, random weights) + byte-level BPE tokenizer.json
    tiny_t5(dir)      a 2-layer T5 v1.0 (transformers, random weights) + sentencepiece spiece.model
    write_superglue(dir, {"CB": (n_train, n_val), ...})   synthetic official-format jsonl files

Everything is seeded, so a builder called twice gives the same bytes.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import torch

CORPUS = [
    "The man fell down because he slipped on the ice.",
    "She said that it rained all day in the city.",
    "It was a complex language, not written down but handed down.",
    "The river bank was flooded after the storm last night.",
    "He opened the window and the cold air came into the room.",
    "Is the sky blue? The sky is blue on a clear day.",
    "They went to the market to buy bread, milk and apples.",
    "The children played in the park until the sun went down.",
    "I do not think that the answer is correct, she replied.",
    "The company announced that its profits had doubled this year.",
    "cb hypothesis: premise: copa choice1: choice2: question: cause effect",
    "rte sentence1: sentence2: wic word: boolq passage: multirc answer: paragraph:",
    "entailment contradiction neutral not_entailment True False choice1 choice2",
    "What did the woman do? Who ran home? Was he late? Yes, no, maybe.",
    "0123456789 , . ; : ! ? ' \" ( ) - the a an of to in on at by for with",
]
WORDS = ("the man woman dog city river bank storm rain sun park market bread window door child house car road "
         "ran fell said opened bought played saw went came left found lost took gave made broke").split()


def _randomize(model, seed: int, std: float = 0.15) -> None:
    """Non-trivial random weights (norm weights near 1), so that capsules change the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * std
            p.copy_(1.0 + noise if "norm" in name else noise)


def tiny_llama(directory, seed: int = 0, vocab_size: int = 360, layers: int = 2) -> Path:
    """A tiny random Llama checkpoint with a byte-level BPE tokenizer (BOS added by tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    _randomize(model, seed)
    model.save_pretrained(directory)
    return directory


def tiny_qwen2(directory, vocab_size: int = 199, max_positions: int = 96) -> Path:
    """A tiny random Qwen2 checkpoint, no tokenizer: biased q/k/v, grouped-query attention, untied output."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e6,
        tie_word_embeddings=False,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        eos_token_id=3,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.normal_(1.0, 0.1) if key.endswith("norm.weight") else p.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return Path(directory)


def tiny_t5(directory, seed: int = 0, vocab_size: int = 400) -> Path:
    """A tiny random T5 v1.0 checkpoint (tied, ReLU) with a sentencepiece spiece.model (pad 0, eos 1, unk 2)."""
    import sentencepiece as spm
    from transformers import T5Config, T5ForConditionalGeneration

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 3), model_writer=buffer, vocab_size=vocab_size, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, byte_fallback=True, character_coverage=1.0,
        hard_vocab_limit=False, minloglevel=2, num_threads=1,
    )
    (directory / "spiece.model").write_bytes(buffer.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buffer.getvalue())

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=sp.get_piece_size(),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="relu",
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        dropout_rate=0.0,
    )
    model = T5ForConditionalGeneration(config).eval()
    _randomize(model, seed, std=0.3)
    model.save_pretrained(directory)
    return directory


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _row(task: str, rng: random.Random, i: int) -> dict:
    if task == "CB":
        return {"premise": _sentence(rng, rng.randint(5, 14)), "hypothesis": _sentence(rng, 4),
                "label": rng.choice(["entailment", "contradiction", "neutral"]), "idx": i}
    if task == "COPA":
        return {"premise": _sentence(rng, 6), "choice1": _sentence(rng, 4), "choice2": _sentence(rng, 4),
                "question": rng.choice(["cause", "effect"]), "label": rng.randint(0, 1), "idx": i}
    if task == "RTE":
        return {"premise": _sentence(rng, 10), "hypothesis": _sentence(rng, 5),
                "label": rng.choice(["entailment", "not_entailment"]), "idx": i}
    if task == "WiC":
        return {"word": rng.choice(WORDS), "sentence1": _sentence(rng, 6), "sentence2": _sentence(rng, 6),
                "label": rng.random() < 0.5, "idx": i}
    if task == "BoolQ":
        return {
            "passage": _sentence(rng, 12),
            "question": _sentence(rng, 5).lower(),
            "label": rng.random() < 0.5,
            "idx": i,
        }
    if task == "MultiRC":
        questions = [{"question": _sentence(rng, 4), "idx": q, "answers": [
            {"text": _sentence(rng, 2), "idx": a, "label": rng.randint(0, 1)} for a in range(2)]} for q in range(2)]
        return {"idx": i, "passage": {"text": f"<b>Sent 1: </b>{_sentence(rng, 8)}<br>", "questions": questions}}
    raise ValueError(task)


def write_superglue(directory, sizes: dict[str, tuple[int, int]], seed: int = 0) -> Path:
    """Official-format train.jsonl / val.jsonl per task: sizes {"CB": (n_train, n_val)}; 0 leaves a file out."""
    directory = Path(directory)
    rng = random.Random(seed)
    for task, (n_train, n_val) in sizes.items():
        folder = directory / task
        folder.mkdir(parents=True, exist_ok=True)
        for name, n in (("train.jsonl", n_train), ("val.jsonl", n_val)):
            if n:
                (folder / name).write_text("".join(json.dumps(_row(task, rng, i)) + "\n" for i in range(n)))
    return directory


# label value -> word; not in value order, the last word two words
SENTIMENT = {"1": "positive", "0": "negative", "2": "no opinion"}


def write_task(
    directory, sizes: tuple[int, int, int] = (40, 0, 12), seed: int = 0, labelled_test: bool = True, **spec
) -> Path:
    """A task file `directory/reviews.json` and its JSONL files: a made-up three-way review task.

    sizes: (train, validation, test) rows, 0 leaves the file out of the task file. Rows hold a
    "review" text, a "stars" number and an integer "label" (0, 1, 2); spec overrides task file keys.
    """
    directory = Path(directory)
    rng = random.Random(seed)
    (directory / "data").mkdir(parents=True, exist_ok=True)
    task = {"name": "reviews", "train": "data/train.jsonl", "validation": "data/dev.jsonl", "test": "data/test.jsonl",
            "template": "Review: {review} Stars: {stars}. Opinion:", "label_field": "label", "labels": SENTIMENT,
            "metric": "macro-f1", "shorten": "review"}
    for key, n in zip(("train", "validation", "test"), sizes):
        if not n:
            del task[key]
            continue
        rows = []
        for i in range(n):
            label = rng.randint(0, 2)
            row = {
                "id": f"{key}-{i}",
                "review": _sentence(rng, rng.randint(4, 12)),
                "stars": [1, 5, 3][label] + rng.randint(0, 1),
                "label": label,
            }
            if key == "test" and not labelled_test:
                del row["label"]
            rows.append(row)
        (directory / task[key]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    task.update(spec)
    task = {k: v for k, v in task.items() if v is not None}
    path = directory / "reviews.json"
    path.write_text(json.dumps(task, indent=2))
    return path


def hub_cache(
    cache: Path, repo_id: str, checkpoint: Path, commit: str = "0123456789abcdef0123456789abcdef01234567"
) -> Path:
    """Put the files of `checkpoint` into a Hugging Face hub cache folder as huggingface_hub lays one out.

        cache/models--ORG--NAME/refs/main                  the commit hash (40 hex digits, no newline)
        cache/models--ORG--NAME/blobs/<id>                  each file's bytes; <id> its sha256 for LFS files
                                                            (safetensors), its git blob sha1 for the others
        cache/models--ORG--NAME/snapshots/<commit>/<file>   relative symlinks ../../blobs/<id>

    Returns the snapshot folder.
    """
    import hashlib
    import os

    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for file in sorted(Path(checkpoint).iterdir()):
        data = file.read_bytes()
        if file.suffix == ".safetensors":  # stored with git LFS: named by sha256
            blob = hashlib.sha256(data).hexdigest()
        else:  # a plain git file: named by its git blob id
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snapshot / file.name)
    return snapshot


def capt(*argv, capsys) -> tuple[int, str, str]:
    """`capt ARGV` in this process: (exit status, stdout, stderr)."""
    from capt.cli.main import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *fragments):
    """Exit status 1 and exactly one line, `capt: error: ...`, holding every fragment; no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("capt: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
