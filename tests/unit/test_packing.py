"""Packed batches and chunked logprobs (trainer/batch.py, trainer/head.py): the same numbers as
padded rows and full-vocabulary logits, without attention across segments or a [tokens x vocab] tensor."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from flywheel.events import ScoredTrajectory, Segment, Turn
from flywheel.logprobs import history, processed_logprobs
from flywheel.sampling import Processing
from flywheel.settings import TrainerSettings
from trainer.batch import collate
from trainer.head import token_logprobs
from trainer.step import train_step

VOCAB = 200


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).float().eval()


def session(i: int, turns: int, rng: random.Random, **sampling: float) -> ScoredTrajectory:
    """A multi-turn sample: two segments, each a context then ``turns`` (prompt, completion) pairs."""
    segments = []
    for _ in range(2):
        tokens, mask, logprobs, marks = [], [], [], []
        for _ in range(turns):
            prompt, completion = rng.randint(1, 9), rng.randint(1, 9)
            tokens += [rng.randrange(VOCAB) for _ in range(prompt + completion)]
            mask += [0] * prompt + [1] * completion
            logprobs += [0.0] * prompt + [rng.uniform(-6, -1) for _ in range(completion)]
            marks.append(Turn(generation_id=f"g{i}-{len(segments)}-{len(marks)}", start=len(tokens) - completion,
                              end=len(tokens), behaviour_version=0, **sampling))
        segments.append(Segment(tokens=tokens, mask=mask, logprobs=logprobs, turns=marks))
    rewards = [rng.uniform(-1, 1) for _ in range(2 * turns)]
    return ScoredTrajectory(event_id=f"e{i}", tenant="t", session_id=f"s{i}", trajectory_id=f"t{i}", model_line="m",
                            segments=segments, turn_rewards=rewards, total_reward=sum(rewards), reward_spec_version="x")


def samples(seed: int = 0) -> list[ScoredTrajectory]:
    rng = random.Random(seed)
    return [session(0, 3, rng), session(1, 1, rng), session(2, 2, rng, temperature=0.8, top_p=0.9),
            session(3, 2, rng, temperature=1.3, frequency_penalty=0.4, repetition_penalty=1.2), session(4, 4, rng)]


def full_logits_logprobs(model: torch.nn.Module, batch) -> torch.Tensor:
    """What the trainer computed before chunking: the whole [B, T, V] logits of padded rows."""
    logits = model(input_ids=batch.tokens, attention_mask=batch.attention).logits.float()
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    out = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    for row, begin, start, end, processing in batch.processed:
        sampled = batch.tokens[row, start:end]
        seen, counts = history(batch.tokens[row, begin:start], sampled, VOCAB)
        logp = processed_logprobs(logits[row, start - 1 : end - 1], processing, seen=seen, output_counts=counts)
        out[row, start:end] = logp.gather(-1, sampled[:, None]).squeeze(-1)
    return out * (batch.mask > 0)


def equal(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    finite = torch.isfinite(a)
    assert (a[finite] - b[finite]).abs().max().item() < tol


@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_logprobs_equal_the_full_logits_values_and_gradients(model, chunk) -> None:
    batch = collate(samples(), [0.0] * 5)
    assert batch.processed  # temperature/top-p and penalised turns are recomputed under their processing
    weights = torch.rand(batch.mask.shape)
    mine = token_logprobs(model, batch, chunk)
    (torch.where(torch.isfinite(mine), mine, 0.0) * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = full_logits_logprobs(model, batch)
    (torch.where(torch.isfinite(reference), reference, 0.0) * weights).sum().backward()
    equal(mine, reference)
    for name, p in model.named_parameters():
        assert (grads[name] - p.grad).abs().max().item() < 1e-5, name
    model.zero_grad()


def test_packed_rows_give_the_padded_rows_values(model) -> None:
    padded, packed = collate(samples(), [0.0] * 5), collate(samples(), [0.0] * 5, packed=True)
    assert packed.tokens.shape[0] == 1 and int(packed.attention.sum()) == packed.tokens.shape[1]  # no padding
    with torch.no_grad():
        a, b = token_logprobs(model, padded, 16), token_logprobs(model, packed, 16)
    equal(a[padded.mask > 0], b[packed.mask > 0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: checked on a GPU machine")
def test_on_cuda_in_bf16_packed_rows_give_the_padded_rows_values(model) -> None:
    """Flash varlen attention (torch.nn.attention.varlen) against SDPA over padded rows, bf16 autocast."""
    gpu = copy.deepcopy(model).cuda()
    padded, packed = (collate(samples(), [0.0] * 5, packed=p).to(torch.device("cuda")) for p in (False, True))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = token_logprobs(gpu, padded, 16), token_logprobs(gpu, packed, 16)
    equal(a[padded.mask > 0], b[packed.mask > 0], tol=5e-2)


@pytest.mark.parametrize("lengths", [[9, 7, 8, 9], [40, 3, 2, 5], [17]])  # one call / one per segment / alone
def test_varlen_attention_equals_attention_over_each_segment(lengths) -> None:
    """Both CPU paths (similar segments batched as padded rows, others one slice at a time), values
    and gradients, against plain causal SDPA on each segment alone (GQA: 4 query heads, 2 KV)."""
    from trainer.head import varlen_attention

    torch.manual_seed(0)
    T = sum(lengths)
    q, k, v = (torch.randn(1, h, T, 8, requires_grad=True) for h in (4, 2, 2))
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int32)
    module = torch.nn.Module()
    mine, _ = varlen_attention(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=max(lengths))
    expected = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b].repeat_interleave(2, 1), v[:, :, a:b].repeat_interleave(2, 1), is_causal=True,
        scale=0.3) for a, b in zip(bounds[:-1], bounds[1:])], dim=2).transpose(1, 2)
    assert mine.shape == expected.shape == (1, T, 4, 8)
    weights = torch.randn_like(mine)
    grads = torch.autograd.grad((mine * weights).sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad((expected * weights).sum(), (q, k, v))):
        assert (a - b).abs().max().item() < 1e-5
    assert (mine - expected).abs().max().item() < 1e-5


def test_no_segment_attends_to_another(model) -> None:
    """Changing every token of the first segment changes nothing in the rest of the packed row."""
    batch = collate(samples(), [0.0] * 5, packed=True)
    first = int(batch.cu_seqlens[1])
    scrambled = batch.tokens.clone()
    scrambled[0, :first] = (scrambled[0, :first] + 1) % VOCAB
    with torch.no_grad():
        a = token_logprobs(model, batch)
        b = token_logprobs(model, type(batch)(**{**batch.__dict__, "tokens": scrambled}))
    rest = batch.mask[0, first:] > 0
    equal(a[0, first:][rest], b[0, first:][rest], tol=0.0 + 1e-6)
    assert not torch.allclose(a[0, :first], b[0, :first])


def test_packed_and_padded_steps_train_the_same(model) -> None:
    """The whole step (micro-batches, loss, gradients, update) in fp32: equal to 1e-5."""
    results = []
    for packing in (False, True):
        m = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-3)
        cfg = TrainerSettings(packing=packing, micro_batch_tokens=96, logprob_chunk_tokens=8)
        metrics = train_step(m, optimizer, samples(), 0, cfg, measure_parity=True)
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        results.append((metrics, grads, {n: p.detach().clone() for n, p in m.named_parameters()}))
    (m1, g1, w1), (m2, g2, w2) = results
    for key in ("loss", "clip_frac", "mean_ratio", "kl", "tokens", "parity", "parity_max"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-6), key
    for name in g1:
        assert (g1[name] - g2[name]).abs().max().item() < 1e-5, name
        assert (w1[name] - w2[name]).abs().max().item() < 1e-5, name


def test_no_tensor_of_tokens_x_vocab_is_kept_for_the_backward(model) -> None:
    """Of the vocabulary-wide tensors autograd keeps (logits and their like), none holds more than
    ``chunk`` positions (the full-logits path keeps several of every position)."""
    batch = collate(samples(), [0.0] * 5, packed=True)
    tokens = int((batch.mask > 0).sum())

    def largest_saved(fn) -> int:
        sizes = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dim() and t.shape[-1] == VOCAB:
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return max(sizes)

    chunk = 8
    assert largest_saved(lambda: token_logprobs(model, batch, chunk)) < chunk * VOCAB
    assert largest_saved(lambda: full_logits_logprobs(model, collate(samples(), [0.0] * 5))) >= tokens * VOCAB


def test_a_processed_turn_longer_than_a_chunk_keeps_its_penalty_history() -> None:
    """Chunk by chunk, the history before a chunk's first row counts the earlier chunks' tokens."""
    sampled = torch.tensor([3, 1, 3, 3, 2, 1])
    whole = history([5], sampled, 8)
    parts = [history([5], sampled[a:b], 8, earlier=sampled[:a]) for a, b in [(0, 2), (2, 5), (5, 6)]]
    assert torch.equal(torch.cat([s for s, _ in parts]), whole[0])
    assert torch.equal(torch.cat([c for _, c in parts]), whole[1])
    assert Processing(frequency_penalty=0.5).penalised
