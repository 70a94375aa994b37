"""The explicit attention path (capt.cli.analysis.recorded): the same outputs as SDPA, transformers' weights.

The analysis (capt attention) reads the attention weights, which SDPA never returns, so each
model's attention core can be swapped for one written out by hand (analysis.attention_with_weights). Checked here
on tiny random checkpoints in fp32: logits equal the SDPA path's (1e-5) with and without padding
and with every method's rows in front; weights equal transformers' eager attention weights on a
plain model; every row of every weight tensor sums to one.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

from capt.cli.analysis import cross_attentions, front_counts, recorded
from capt.load import load_model
from capt.methods import CapsuleConfig, attach, detach, method_tensors

TOL = 1e-5
VOCAB = 150


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for key, p in hf.named_parameters():
            p.normal_(1.0, 0.1) if key.endswith("norm.weight") else p.normal_(0.0, 0.3)
    directory = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(directory)
    model = load_model(directory)
    yield hf, model
    detach(model)


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2, num_decoder_layers=2,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
                      feed_forward_proj="relu", attn_implementation="eager")
    hf = T5ForConditionalGeneration(config).eval()
    directory = tmp_path_factory.mktemp("t5")
    hf.save_pretrained(directory)
    model = load_model(directory)
    yield hf, model
    detach(model)


def padded(lengths, T=None, seed=1):
    """Random ids (B, T), right-padded to the longest, and their mask."""
    g = torch.Generator().manual_seed(seed)
    T = T or max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def randomize(model):
    """Non-zero method tensors, so that the rows in front change the outputs."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in method_tensors(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


METHOD_CASES = [None, ("capt", "add"), ("capt", "prepend"), ("deep-prompt", 2), ("prompt", 3), ("prefix", 2)]


def attach_case(model, case):
    detach(model)
    if case is None:
        return
    name, arg = case
    if name == "capt":
        attach(model, "capt", capsules=CapsuleConfig(integration=arg, blocks="all"))
    else:
        attach(model, name, n=arg)
    randomize(model)


def assert_rows_sum_to_one(attentions):
    for w in attentions:
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", METHOD_CASES)
@pytest.mark.parametrize("padding", [False, True])
def test_llama_explicit_path_equals_sdpa(llama, case, padding):
    _, model = llama
    attach_case(model, case)
    ids, mask = padded([9, 6, 4] if padding else [9, 9, 9])
    with torch.no_grad():
        sdpa = model(ids, attention_mask=mask if padding else None)
        with recorded(model.prefix_attentions()) as attentions:
            explicit = model(ids, attention_mask=mask if padding else None)
    torch.testing.assert_close(explicit, sdpa, atol=TOL, rtol=0)
    front = model.front_length()
    assert len(attentions) == model.config.num_hidden_layers
    assert attentions[0].shape == (3, model.config.num_attention_heads, front - front_counts(model)[0] + 9, front + 9)
    assert_rows_sum_to_one(attentions)


def test_llama_weights_equal_transformers_eager(llama):
    hf, model = llama
    detach(model)
    ids, mask = padded([9, 6, 4])
    with torch.no_grad():
        with recorded(model.prefix_attentions()) as attentions:
            model(ids, attention_mask=mask)
        theirs = hf(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(theirs) == len(attentions)
    for ours, ref in zip(attentions, theirs):
        # padded query rows differ by convention: compare real rows
        real = mask.bool()[:, None, :, None].expand_as(ours)
        torch.testing.assert_close(ours[real], ref[real], atol=TOL, rtol=0)


@pytest.mark.parametrize("case", [c for c in METHOD_CASES])
@pytest.mark.parametrize("padding", [False, True])
def test_t5_explicit_path_equals_sdpa(t5, case, padding):
    _, model = t5
    attach_case(model, case)
    ids, mask = padded([9, 6, 4] if padding else [9, 9, 9])
    dec, _ = padded([4, 4, 4], seed=2)
    dec[:, 0] = 0
    with torch.no_grad():
        states, enc_mask = model.encode(ids, mask if padding else None)
        sdpa = model.decode(dec, states, enc_mask)
        with recorded(model.prefix_attentions()) as attentions:
            states2, enc_mask2 = model.encode(ids, mask if padding else None)
        with recorded(cross_attentions(model)) as cross:
            explicit = model.decode(dec, states2, enc_mask2)
    torch.testing.assert_close(states2, states, atol=TOL, rtol=0)
    torch.testing.assert_close(explicit, sdpa, atol=TOL, rtol=0)
    N = states.shape[1]
    assert [w.shape for w in attentions] == [(3, 4, N, front_counts(model)[0] + N)] * 2
    assert [w.shape for w in cross] == [(3, 4, 4, N)] * 2
    assert_rows_sum_to_one(attentions + cross)


def test_t5_cross_weights_with_shared_encoder_rows(t5):
    """Two decoder rows per encoded input (candidates): one call per encoded input, its queries side by side,
    whose weights are the decoder rows' own, one row after the other."""
    _, model = t5
    attach_case(model, ("capt", "add"))
    ids, mask = padded([9, 6])
    dec, _ = padded([3, 3, 3, 3], seed=2)
    with torch.no_grad():
        states, enc_mask = model.encode(ids, mask)
        with recorded(cross_attentions(model)) as shared:
            model.decode(dec, states, enc_mask)
        with recorded(cross_attentions(model)) as separate:
            model.decode(dec, states.repeat_interleave(2, 0), enc_mask.repeat_interleave(2, 0))
    for a, b in zip(shared, separate):  # (2, H, 2 * 3, S) against (4, H, 3, S)
        torch.testing.assert_close(a.unflatten(2, (2, 3)).transpose(1, 2).reshape(b.shape), b, atol=TOL, rtol=0)


def test_t5_weights_equal_transformers_eager(t5):
    hf, model = t5
    detach(model)
    ids, mask = padded([9, 6, 4])
    dec, _ = padded([4, 4, 4], seed=2)
    dec[:, 0] = 0
    with torch.no_grad():
        with recorded(model.prefix_attentions()) as attentions:
            states, enc_mask = model.encode(ids, mask)
        with recorded(cross_attentions(model)) as cross:
            model.decode(dec, states, enc_mask)
        out = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, output_attentions=True)
    for ours, ref in zip(attentions + cross, list(out.encoder_attentions) + list(out.cross_attentions)):
        torch.testing.assert_close(ours, ref, atol=TOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# Training-free instance tokens (capt eval --method pooled --n K)

from capt.baselines import chunk_index, pooled_rows, set_pooled  # noqa: E402


def test_chunks_on_hand_made_rows():
    mask = torch.tensor([[1] * 10, [0, 0, 0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]]).bool()
    assert chunk_index(mask, 4).tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 3, 3],  # 10 = 3 + 3 + 2 + 2
                                             [-1, -1, -1, -1, -1, 0, 0, 1, 2, 3],  # 5 = 2 + 1 + 1 + 1, left padding
                                             [0, 1, -1, -1, -1, -1, -1, -1, -1, -1]]  # 2 tokens: chunks 2 and 3 empty
    assert chunk_index(mask, 1).tolist()[1] == [-1] * 5 + [0] * 5
    h = torch.arange(10.0)[None, :, None].expand(3, 10, 2)  # token j's embedding is (j, j)
    rows = pooled_rows(h, mask, 4)  # (3, 4, 2)
    assert rows[0, :, 0].tolist() == [1.0, 4.0, 6.5, 8.5]
    assert rows[1, :, 0].tolist() == [5.5, 7.0, 8.0, 9.0]
    assert rows[2, :, 0].tolist() == [0.0, 1.0, 0.0, 0.0]  # empty chunks give zeros


def test_pooled_rows_are_a_prompt_made_of_chunk_means(llama):
    """On the plain model, k pooled rows act as prompt tuning's rows equal to the chunk means of the embeddings."""
    _, model = llama
    detach(model)
    ids, _ = padded([10])
    with torch.no_grad():
        means = pooled_rows(model.model.embed_tokens(ids), torch.ones_like(ids).bool(), 3)[0]  # (3, d)
        set_pooled(model, 3)
        pooled = model(ids)
        set_pooled(model, 0)
        attach(model, "prompt", n=3)
        method_tensors(model)["prompt"].copy_(means)
        reference = model(ids)
    torch.testing.assert_close(pooled, reference, atol=TOL, rtol=0)
    detach(model)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_pooled_on_deep_prompt_is_padding_invariant(llama, t5, family):
    """With a deep-prompt model under the pooled rows: each row's logits do not depend on its batch's padding,
    and the deep-prompt rows still matter (they sit after the pooled rows at every block)."""
    _, model = llama if family == "llama" else t5
    attach_case(model, ("deep-prompt", 2))
    set_pooled(model, 2)
    ids, mask = padded([9, 5])
    dec = torch.zeros(2, 1, dtype=torch.long)

    def logits(i, m):
        return (
            model(i, attention_mask=m)
            if family == "llama"
            else model(i, attention_mask=m, decoder_input_ids=dec[: len(i)])
        )

    with torch.no_grad():
        both = logits(ids, mask)
        alone = logits(ids[1:, :5], mask[1:, :5])
        torch.testing.assert_close(both[1, :5] if family == "llama" else both[1], alone[0], atol=TOL, rtol=0)
        for rows in list(method_tensors(model).values())[1:]:  # blocks 1.. (block 0's rows are the front seam's)
            rows.copy_(torch.randn(rows.shape, generator=torch.Generator().manual_seed(9)))
        changed = logits(ids, mask)
    assert (changed - both).abs().max() > 1e-3
    detach(model)
    assert model.front is None and all(b.entry is None for b in model.capsule_blocks())
