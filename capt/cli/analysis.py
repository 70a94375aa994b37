"""Where attention goes (`capt attention`): the capsule as an attention anchor, measured.

Training and evaluation run attention through SDPA, which returns no weights. Each attention
module of the models computes it in a submodule of its own (capt/models/ops.py, Attend); within
`recorded(...)` those are swapped for one that writes the same attention out by hand and keeps
every call's weights (B, H, N, S). Over a split this module aggregates, per layer x head, the mean
attention mass that the real (non-pad) query tokens put on four groups of key columns, which
together take all of it:

    slot     the capsule slot(s) (capt, instance)
    front    the other methods' rows and columns in front: prompt / deep-prompt rows, prefix columns
    first    the first real token (BOS for tokenizers that add one: Llama / Qwen2's; T5 adds none)
    rest     every other real token

A query row's weights sum to one, so each query's four masses sum to one, and so do their means.
Llama / Qwen2: the decoder's self-attention over the prompt (what rank classification reads).
T5: the encoder's self-attention, and the decoder's cross-attention (decoder reading the gold
target, teacher-forced) over the encoder states. Where the slot can look forward (T5's encoder;
in a causal model it sees only itself and what is in front of it), the attention that the slot
row(s) pay to each token is summed by token string and averaged over examples, layers and heads:
the structural tokens of the template are expected at the top (docs/method.md, Analyses).
The head-averaged maps of a few chosen examples (`--examples`, default the first) at a few layers
are kept for pictures.

Pictures (matplotlib, optional, as capt/plots.py): heatmap.png (layers x heads, mass on the slot,
or on the front rows, or on the first token when the model has neither), maps.png (token x token,
one row per chosen example, at most MAX_MAP_ROWS), and curves.png (per-layer mass on slot / front
rows, one line per attention.json).
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn

from ..checks import is_finite, is_whole, read_json
from ..errors import CaptError
from ..evaluate import check_vocab, decoder_inputs, encode_examples, input_format, pad
from .experiment import code_version, data_files
from ..load import atomic_write
from ..models.ops import Attend
from ..plots import _figure, _save
from ..tasks import get_task

GROUPS = ("slot", "front", "first", "rest")
TOP_TOKENS = 25


# ---------------------------------------------------------------------------------------------
# The weights, recorded


def attention_with_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                           is_causal: bool = False, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + mask) v written out, as SDPA computes it, returning the weights too.

    q (B, H, T, Dh), k and v (B, H, S, Dh) with q's heads (grouped heads already repeated);
    attn_mask None, boolean (True: may attend) or additive, broadcast to (B, H, T, S); is_causal as
    SDPA's (top-left: query i sees keys 0..i). Returns (B, H, T, Dh) and the weights (B, H, T, S).
    """
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, T, S)
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()  # (T, S)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    weights = scores.float().softmax(-1).to(q.dtype)  # (B, H, T, S): each row sums to one
    return weights @ v, weights


class KeptAttention(nn.Module):
    """An attention core (as ops.Attend: q (B, H, T, Dh), grouped k, v) that writes attention out and appends
    its weights (B, H, T, S) to `weights`."""

    def __init__(self, scale: float | None, weights: list[torch.Tensor]):
        super().__init__()
        self.scale, self.weights = scale, weights

    def forward(self, q, k, v, attn_mask, is_causal):
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # query head h reads key/value head h // groups
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out, weights = attention_with_weights(q, k, v, attn_mask, is_causal, self.scale)
        self.weights.append(weights)
        return out


@contextmanager
def recorded(attentions: list[nn.Module]):
    """Within the block, each of these attention modules (their `attend` an ops.Attend) keeps its weights: the
    list yielded gets one (B, H, T, S) tensor per call, in call order; the outputs are SDPA's up to rounding."""
    weights: list[torch.Tensor] = []
    cores = [a.attend for a in attentions]
    if not all(isinstance(core, Attend) for core in cores):
        raise CaptError("recorded(): these modules' attention is already recorded, or is not capt's")
    for a, core in zip(attentions, cores):
        a.attend = KeptAttention(core.scale, weights)
    try:
        yield weights
    finally:
        for a, core in zip(attentions, cores):
            a.attend = core


def cross_attentions(model) -> list[nn.Module]:
    """A T5 model's cross-attention modules, one per decoder block."""
    return [block.layer[1].EncDecAttention for block in model.decoder.block]


def column_groups(n_prefix: int, n_slots: int, n_rows: int, key_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Boolean (B, S) masks of the four groups over one call's key columns, laid out as the models
    put them: [prefix columns][slot(s)][prompt / deep-prompt rows][tokens], tokens right-padded
    (key_mask (B, T) marks the real ones; the first real token is column n_prefix + n_slots + n_rows)."""
    B, T = key_mask.shape
    F = n_prefix + n_slots + n_rows
    groups = {g: torch.zeros(B, F + T, dtype=torch.bool, device=key_mask.device) for g in GROUPS}
    groups["front"][:, :n_prefix] = True
    groups["slot"][:, n_prefix:n_prefix + n_slots] = True
    groups["front"][:, n_prefix + n_slots:F] = True
    groups["first"][:, F] = True
    groups["rest"][:, F + 1:] = key_mask[:, 1:]
    return groups


def group_masses(
    weights: torch.Tensor, groups: dict[str, torch.Tensor], query_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per head, the summed (over real queries) attention mass on each group: weights (B, H, N, S),
    groups (B, S), query_mask (B, N) -> {group: (H,)} sums; divide by query_mask.sum() for means."""
    q = query_mask.to(weights.dtype)[:, None, :, None]  # (B, 1, N, 1)
    return {
        g: (weights * q * cols.to(weights.dtype)[:, None, None, :]).sum(dim=(0, 2, 3)) for g, cols in groups.items()
    }


class Tally:
    """Running sums of the group masses of one attention (encoder / decoder / cross), per layer x head."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.queries = 0

    def add(self, attentions: list[torch.Tensor], groups, query_mask) -> None:
        for g in GROUPS:
            layer_sums = torch.stack([group_masses(w.float(), groups, query_mask)[g] for w in attentions])  # (L, H)
            self.sums[g] = self.sums.get(g, 0) + layer_sums.double()
        self.queries += int(query_mask.sum())

    def result(self) -> dict:
        means = {g: (s / self.queries) for g, s in self.sums.items()}  # (L, H) each
        return {"queries": self.queries,
                "layer_head": {g: [[round(float(x), 6) for x in row] for row in m] for g, m in means.items()},
                "layer": {g: [round(float(x), 6) for x in m.mean(1)] for g, m in means.items()}}


def front_counts(model) -> tuple[int, int, int]:
    """(prefix columns, slots, rows) in front of the tokens, for either family: the prefix seam's columns, the
    capsule slot(s), the front seam's rows (prompt or deep-prompt rows, pooled instance tokens)."""
    slots = 0 if model.method is None else model.method.slots
    rows = 0 if model.front is None else model.front.length
    prefix = model.prefix_attentions()[0].prefix
    return (0 if prefix is None else prefix.length), slots, rows


MAX_MAP_ROWS = 4  # maps.png draws at most this many examples (attention.json keeps all chosen)


def token_label(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False).replace("\n", "\\n") or f"<{token}>"


@torch.no_grad()
def analyse(
    model,
    tokenizer,
    examples,
    max_length: int | None,
    batch_size: int = 8,
    map_layers: list[int] | None = None,
    shown: list[int] | None = None,
    answer_cue: bool | None = None,
) -> dict:
    """The numbers of attention.json for these examples (see the module docstring); `shown`: the indices of the
    examples whose maps are kept (default the first). max_length, answer_cue: the input format (None: as the
    model's method was trained, else the defaults; evaluate.input_format)."""
    shown = sorted(set(shown or [0]))
    if shown[-1] >= len(examples) or shown[0] < 0:
        raise CaptError(f"--examples {','.join(map(str, shown))}: the split has {len(examples)} examples here "
                        f"(0..{len(examples) - 1})")
    layers = len(model.capsule_blocks())  # the blocks whose attention is kept (T5: the encoder's)
    if map_layers is not None and not all(0 <= layer < layers for layer in map_layers):
        raise CaptError(f"--layers {','.join(map(str, map_layers))}: the model has {layers} layers (0..{layers - 1})")
    model.eval()
    device = next(model.parameters()).device
    max_length, answer_cue = input_format(model, max_length, answer_cue)
    encoded = encode_examples(examples, tokenizer, model.seq2seq, max_length, answer_cue)
    check_vocab(model, encoded)
    n_prefix, n_slots, n_rows = front_counts(model)
    F = n_prefix + n_slots + n_rows
    tallies = {"self": Tally()} if not model.seq2seq else {"encoder": Tally(), "cross": Tally()}
    slot_tokens: dict[str, list[float]] = {}  # token string -> [summed mass over examples, examples holding it]
    maps: dict[str, dict] = {}  # example index -> its maps
    for start in range(0, len(encoded), batch_size):
        prompts = encoded.prompts[start:start + batch_size]
        ids, mask = pad(prompts, device=device)  # (B, T), right-padded
        if model.seq2seq:
            with recorded(model.prefix_attentions()) as attentions:  # the encoder blocks' self-attention
                states, enc_mask = model.encode(ids, mask)
            gold = [
                encoded.targets[start + i][ex.label]
                for i, ex in enumerate(encoded.examples[start : start + len(prompts)])
            ]
            dec = decoder_inputs(model, gold, device)  # (B, Td) the gold target, teacher-forced
            dec_mask = pad(gold, device=device)[1]
            with recorded(cross_attentions(model)) as cross:  # one decoder row per encoded input: (B, H, Td, N) each
                model.decode(dec, states, enc_mask)
            groups_enc = column_groups(n_prefix, n_slots, n_rows, mask)
            query_enc = groups_enc["first"][:, n_prefix:] | groups_enc["rest"][:, n_prefix:]  # (B, N) the real tokens
            tallies["encoder"].add(attentions, groups_enc, query_enc)
            # its columns are the encoder states: no prefix columns
            groups_cross = column_groups(0, n_slots, n_rows, mask)
            tallies["cross"].add(cross, groups_cross, dec_mask)
            if n_slots:
                add_slot_tokens(slot_tokens, attentions, prompts, tokenizer, n_slots, F)
        else:
            with recorded(model.prefix_attentions()) as attentions:  # every layer's self-attention
                model(ids, attention_mask=mask, logits_at=torch.zeros(len(prompts), 1, dtype=torch.long, device=device))
            groups = column_groups(n_prefix, n_slots, n_rows, mask)
            query = groups["first"][:, n_prefix:] | groups["rest"][:, n_prefix:]  # (B, N) the real tokens
            tallies["self"].add(attentions, groups, query)
        for i in (i for i in shown if start <= i < start + len(prompts)):
            maps[str(i)] = example_maps(
                model, tokenizer, prompts[i - start], attentions, i - start, n_prefix, n_slots, n_rows, map_layers
            )
    out = {name: tally.result() for name, tally in tallies.items()}
    if model.seq2seq and n_slots:
        n = len(encoded)
        ranked = sorted(((label, mass / n, count) for label, (mass, count) in slot_tokens.items()), key=lambda r: -r[1])
        out["slot_to_tokens"] = {
            "what": "mass the slot row(s) put on each token string, summed within an example, "
            "averaged over "
            f"all {n} examples (0 where absent), layers and heads",
            "top": [{"token": t, "mass": round(m, 6), "examples": c} for t, m, c in ranked[:TOP_TOKENS]],
        }
    else:
        out["slot_to_tokens"] = None  # a causal slot sees only itself and the columns in front of it
    out["front"] = {"prefix_columns": n_prefix, "slots": n_slots, "rows": n_rows}
    out["examples"] = maps
    return out


def add_slot_tokens(slot_tokens: dict, attentions, prompts, tokenizer, n_slots: int, front: int) -> None:
    """T5's slot row(s) look forward: add each token string's attention mass from them (averaged over layers and
    heads, summed within an example) to slot_tokens, token string -> [summed mass, examples holding it]."""
    slot_rows = torch.stack(attentions)[:, :, :, :n_slots, front:].mean(dim=(0, 2, 3))  # (L, B, H, N, S) -> (B, T)
    for b, row in enumerate(prompts):
        per_example: dict[str, float] = {}
        for j, token in enumerate(row):
            label = token_label(tokenizer, token)
            per_example[label] = per_example.get(label, 0.0) + float(slot_rows[b, j])
        for label, mass in per_example.items():
            entry = slot_tokens.setdefault(label, [0.0, 0])
            entry[0] += mass
            entry[1] += 1


def example_maps(
    model, tokenizer, prompt: list[int], attentions, row: int, n_prefix, n_slots, n_rows, map_layers
) -> dict:
    """Head-averaged weights of one batch row at a few layers, over its real rows and columns (front included)."""
    L = len(attentions)
    layers = sorted({l for l in (map_layers or [0, L // 2, L - 1]) if 0 <= l < L})
    T = len(prompt)
    rows = n_slots + n_rows + T  # queries: slot(s), rows, real tokens
    labels = (
        ["[prefix]"] * n_prefix
        + ["[slot]"] * n_slots
        + ["[row]"] * n_rows
        + [token_label(tokenizer, t) for t in prompt]
    )
    maps = {
        str(l): [[round(float(x), 5) for x in r] for r in attentions[l][row].float().mean(0)[:rows, : n_prefix + rows]]
        for l in layers
    }
    return {"keys": labels, "queries": labels[n_prefix:], "layers": maps}


def attention_report(
    model,
    tokenizer,
    examples,
    task,
    split: str,
    data_dir,
    max_length: int | None,
    what: str,
    method: str | None,
    batch_size: int = 8,
    map_layers=None,
    shown: list[int] | None = None,
    answer_cue: bool | None = None,
) -> dict:
    """analyse() plus what it was run on: the command, commit, model and data hashes, the time taken."""
    started = time.time()
    max_length, answer_cue = input_format(model, max_length, answer_cue)
    numbers = analyse(model, tokenizer, examples, max_length, batch_size, map_layers, shown, answer_cue)
    return {
        "what": what,
        "method": method,
        "task": get_task(task).name,
        "split": split,
        "n": len(examples),
        "max_length": max_length,
        "answer_cue": answer_cue,
        "model": model.source["path"],
        "model_type": model.source["model_type"],
        "model_config_sha256": model.source["config_sha256"],
        "model_weights_sha256": model.source.get("weights_sha256"),
        "data_files": data_files(data_dir, [get_task(task)]),
        "command": " ".join(["capt"] + sys.argv[1:]),
        "commit": code_version(),
        "seconds": round(time.time() - started, 1),
        **numbers,
    }


def write_report(report: dict, out: Path) -> list[Path]:
    """OUT/attention.json, and heatmap.png and maps.png where matplotlib is installed; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "attention.json", lambda tmp: Path(tmp).write_text(json.dumps(report) + "\n"))
    written = [out / "attention.json"]
    for name, fig in (("heatmap.png", heatmap_figure(report)), ("maps.png", maps_figure(report))):
        if fig is not None:
            written.append(_save(fig, out / name))
    return written


def main_attention(report: dict) -> tuple[str, dict]:
    """(name, numbers) of the attention the pictures show: Llama's self-attention or T5's encoder."""
    name = "self" if "self" in report else "encoder"
    return name, report[name]


def shown_group(report: dict) -> str:
    front = report["front"]
    return "slot" if front["slots"] else ("front" if front["rows"] or front["prefix_columns"] else "first")


GROUP_WORDS = {"slot": "the capsule slot(s)", "front": "the prompt / prefix rows", "first": "the first token"}


def heatmap_figure(report: dict):
    name, numbers = main_attention(report)
    group = shown_group(report)
    grid = numbers["layer_head"][group]  # (L, H)
    fig = _figure(1.6 + 0.45 * len(grid[0]), 1.5 + 0.17 * len(grid))
    if fig is None:
        return None
    ax = fig.subplots()
    image = ax.imshow(
        grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(1e-6, max(max(r) for r in grid)), origin="lower"
    )
    fig.colorbar(image, ax=ax, label="mean attention mass")
    ax.set(xlabel="head", ylabel="layer", title=f"{report['task']}: mass on {GROUP_WORDS[group]}\n"
                                                  f"({name} attention, {report['what']}, {report['n']} examples)")
    ax.title.set_fontsize(8)
    return fig


def maps_figure(report: dict):
    shown = dict(list(report["examples"].items())[:MAX_MAP_ROWS])
    if not shown:
        return None
    layers = list(next(iter(shown.values()))["layers"])
    fig = _figure(5.2 * len(layers), 5.6 * len(shown))
    if fig is None:
        return None
    grid = fig.subplots(len(shown), len(layers), squeeze=False)
    for axes, (index, example) in zip(grid, shown.items()):
        keys, queries = example["keys"], example["queries"]
        ticks = range(0, len(keys), max(1, len(keys) // 40))
        qticks = range(0, len(queries), max(1, len(queries) // 40))
        for ax, layer in zip(axes, layers):
            ax.imshow(example["layers"][layer], aspect="auto", cmap="magma", vmin=0.0, vmax=0.3)
            ax.set_xticks(list(ticks), [keys[i] for i in ticks], rotation=90, fontsize=5)
            ax.set_yticks(list(qticks), [queries[i] for i in qticks], fontsize=5)
            ax.set_title(f"example {index}, layer {layer}", fontsize=9)
            ax.set_xlabel("key", fontsize=8)
        axes[0].set_ylabel("query", fontsize=8)
    fig.suptitle(
        f"{report['task']} {report['split']}, heads averaged (colour clipped at 0.3): {report['what']}", fontsize=9
    )
    return fig


def read_report(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "attention.json"
    if not path.is_file():
        raise CaptError(f"no attention.json at {path}: give attention.json files written by capt attention (or their "
                        "directories)")
    report = read_json(path, "an attention.json")
    front, numbers = report.get("front"), report.get("self", report.get("encoder"))
    layer = numbers.get("layer") if isinstance(numbers, dict) else None
    if not (isinstance(front, dict) and all(is_whole(front.get(k)) for k in ("slots", "rows", "prefix_columns"))
            and all(isinstance(report.get(k), str) for k in ("what", "task", "split", "model_config_sha256"))
            and isinstance(layer, dict) and {"first", shown_group(report)} <= set(layer)
            and all(isinstance(v, list) and all(is_finite(x) for x in v) for v in layer.values())):
        raise CaptError(f"{path} is not an attention.json written by capt attention (it lacks what its curves are "
                        "drawn from)")
    return report


def curves_figure(reports: list[dict]):
    """Per layer, the mean mass (heads averaged) on the front: the slot(s), or a method's rows, or the first token."""
    fig = _figure(7.5, 4.2)
    if fig is None:
        return None
    ax = fig.subplots()
    for i, report in enumerate(reports):
        _, numbers = main_attention(report)
        group = shown_group(report)
        ax.plot(numbers["layer"][group], "o-", color=f"C{i}", markersize=3, label=f"{report['what']}: "
                                                                                  f"{GROUP_WORDS[group]}")
        if group != "first":  # else the solid line is that already
            ax.plot(numbers["layer"]["first"], ":", color=f"C{i}", label=f"{report['what']}: the first token")
    ax.set(xlabel="layer", ylabel="mean attention mass (heads averaged)", ylim=(0, 1),
           title=f"{reports[0]['task']} {reports[0]['split']}: where the real tokens' attention goes")
    ax.legend(fontsize="x-small")
    ax.grid(alpha=0.3)
    return fig


def curves(paths: list[str], out: Path) -> Path | None:
    """OUT/curves.png from several attention.json files (the same task and model); None without matplotlib."""
    reports = [read_report(p) for p in paths]
    first = (reports[0]["task"], reports[0]["model_config_sha256"])
    odd = next((p for p, r in zip(paths, reports) if (r["task"], r["model_config_sha256"]) != first), None)
    if odd is not None:
        raise CaptError(f"capt attention --curves: the attention.json files are of different tasks or models: {odd} "
                        f"is not of {first[0]} on config sha256 {str(first[1])[:12]} as {paths[0]} is")
    fig = curves_figure(reports)
    out.mkdir(parents=True, exist_ok=True)
    return None if fig is None else _save(fig, out / "curves.png")
