"""Advantages and the clipped truncated-IS policy loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.events import ScoredTrajectory, Segment, Turn
from trainer.loss import policy_loss, token_advantages

pytestmark = pytest.mark.unit


def test_token_advantages_place_turn_rewards_on_completion_tokens() -> None:
    s1 = Segment(tokens=[1, 2, 3, 4, 5, 6], mask=[0, 1, 1, 0, 0, 1], logprobs=[0.0] * 6,
                 turns=[Turn(generation_id="a", start=1, end=3, behaviour_version=0),
                        Turn(generation_id="b", start=5, end=6, behaviour_version=0)])
    s2 = Segment(tokens=[7, 8], mask=[0, 1], logprobs=[0.0, -1.0],
                 turns=[Turn(generation_id="c", start=1, end=2, behaviour_version=0)])
    adv = token_advantages([1.0, -1.0, 0.5], [s1, s2], baseline=0.25)
    assert adv[0].tolist() == [0.0, 0.75, 0.75, 0.0, 0.0, -1.25]
    assert adv[1].tolist() == [0.0, 0.25]
    with pytest.raises(ValueError, match="2 turn rewards for 3 turns"):
        token_advantages([1.0, 2.0], [s1, s2], baseline=0.0)


def test_hand_computed_values_and_gradients() -> None:
    # Behaviour prob 0.5 everywhere; new-policy ratios 1.1 (A=+1), 1.5 (A=+1), 3.0 (A=-1), 0.5 (A=-1).
    ratios = [1.0, 1.1, 1.5, 3.0, 0.5]
    logp_b = torch.full((1, 5), math.log(0.5))
    logp_new = (logp_b + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    adv = torch.tensor([[5.0, 1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]])
    out = policy_loss(logp_new, logp_b, adv, mask, clip_eps=0.2, is_cap=2.0)
    # token 1: unclipped, 1.1;   token 2: clipped at 1.2 (no gradient);
    # token 3: min(-3, -1.2) = -3 is the unclipped branch, truncated to -2 (cap), gradient weight 2;
    # token 4: min(-0.5, -0.8) = -0.8 is the clipped branch (no gradient).
    assert out.loss.item() == pytest.approx(-(1.1 + 1.2 - 2.0 - 0.8) / 4)
    out.loss.backward()
    assert logp_new.grad is not None
    assert logp_new.grad[0].tolist() == pytest.approx([0.0, -1.1 / 4, 0.0, 2.0 / 4, 0.0])
    assert out.clip_frac == pytest.approx(0.5)
    assert out.trunc_frac == pytest.approx(0.25)
    assert out.mean_ratio == pytest.approx((1.1 + 1.5 + 3.0 + 0.5) / 4)
    assert out.mean_abs_log_ratio == pytest.approx(sum(abs(math.log(r)) for r in ratios[1:]) / 4)
    assert out.tokens == 4


def test_below_the_cap_the_gradient_is_ppo_clip() -> None:
    g = torch.Generator().manual_seed(torch.seed())
    B, T = 3, 7
    logp_b = -torch.rand(B, T, generator=g) * 3
    logp_new = (logp_b + (torch.rand(B, T, generator=g) - 0.5) * 0.8).requires_grad_(True)  # ratios in [0.67, 1.49]
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[0, 0] = 1.0
    out = policy_loss(logp_new, logp_b, adv, mask, clip_eps=0.2, is_cap=2.0)
    out.loss.backward()
    ours = logp_new.grad.clone()

    ref_new = logp_new.detach().clone().requires_grad_(True)
    r = torch.exp(ref_new - logp_b)
    ppo = torch.min(r * adv, r.clamp(0.8, 1.2) * adv)
    ref = -(ppo * mask).sum() / mask.sum()
    ref.backward()
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(ours, ref_new.grad, atol=1e-6)
    assert out.trunc_frac == 0.0


def test_gradient_step_moves_probability_in_the_direction_of_the_advantage() -> None:
    for sign in (1.0, -1.0):
        logits = torch.zeros(1, 4, requires_grad=True)  # a 4-token vocabulary, uniform policy
        token = 2
        opt = torch.optim.SGD([logits], lr=0.5)
        logp_b = torch.full((1, 1), math.log(0.25))
        before = torch.softmax(logits, -1)[0, token].item()
        logp_new = torch.log_softmax(logits, -1)[:, token].unsqueeze(1)
        out = policy_loss(logp_new, logp_b, torch.full((1, 1), sign), torch.ones(1, 1), clip_eps=0.2, is_cap=2.0)
        out.loss.backward()
        opt.step()
        after = torch.softmax(logits, -1)[0, token].item()
        assert (after - before) * sign > 0


def test_padding_and_empty_batches_are_inert() -> None:
    logp_new = torch.tensor([[float("-inf"), -1.0]], requires_grad=True)
    out = policy_loss(logp_new, torch.tensor([[float("-inf"), -1.0]]), torch.ones(1, 2), torch.tensor([[0.0, 1.0]]),
                      clip_eps=0.2, is_cap=2.0)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0)
    assert logp_new.grad.tolist() == [[0.0, -1.0]]
    empty = policy_loss(torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3),
                        clip_eps=0.2, is_cap=2.0)
    assert empty.loss.item() == 0.0 and empty.tokens == 0


def test_group_baselines() -> None:
    from trainer.loss import group_baselines

    samples = [("p1", [1.0]), ("p1", [0.0, 0.5]), ("p2", [2.0]), (None, [-1.0])]
    # batch mean = (1 + 0 + 0.5 + 2 - 1) / 5 = 0.5; group p1 = (1 + 0 + 0.5) / 3 = 0.5 (two samples share it)
    assert group_baselines(samples) == pytest.approx([0.5, 0.5, 0.5, 0.5])
    samples = [("p1", [1.0]), ("p1", [0.0]), ("p2", [3.0]), ("p2", [5.0]), ("p3", [1.0])]
    assert group_baselines(samples) == pytest.approx([0.5, 0.5, 4.0, 4.0, 2.0])
    assert group_baselines([]) == []


# --- the trainer's buffer and batching (trainer/buffer.py) ----------------------------------------------


def scored(event_id: str, versions: list[int], *, rewards: list[float] | None = None,
           trajectory_id: str | None = None, revision: int = 0, temperature: float = 1.0) -> ScoredTrajectory:
    from flywheel.events import ScoredTrajectory

    tokens, mask, logprobs, turns = [9], [0], [0.0], []
    for k, v in enumerate(versions):
        tokens += [10 + k, 20 + k]
        mask += [0, 1]
        logprobs += [0.0, -0.5 - k]
        turns.append(Turn(generation_id=f"{event_id}-{k}", start=len(tokens) - 1, end=len(tokens), behaviour_version=v,
                          temperature=temperature))
    segs = [Segment(tokens=tokens, mask=mask, logprobs=logprobs, turns=turns)]
    rewards = rewards if rewards is not None else [1.0] * len(versions)
    return ScoredTrajectory(event_id=event_id, tenant="t", session_id=event_id, trajectory_id=trajectory_id or event_id,
                            revision=revision, model_line="m", segments=segs, turn_rewards=rewards, total_reward=sum(rewards),
                            reward_spec_version="x")


def test_buffer_staleness_duplicates_and_fifo() -> None:
    from trainer.buffer import SampleBuffer, behaviour_version

    buf = SampleBuffer(max_staleness=2)
    assert behaviour_version(scored("a", [5, 3, 4])) == 3
    assert buf.add(scored("a", [5, 3]), None, current_version=5) is None  # 5 - 3 = 2: kept
    assert buf.add(scored("b", [2, 5]), None, current_version=5) == "stale"  # oldest turn decides
    assert buf.add(scored("a", [5, 3]), None, current_version=5) == "duplicate"
    assert buf.add(scored("e", []), None, current_version=5) == "empty"
    assert buf.add(scored("c", [5]), None, current_version=5) is None
    assert buf.take(3) == [] and len(buf) == 2
    stale = buf.purge_stale(current_version=6)  # a (version 3) is now 3 behind
    assert [e.sample.event_id for e in stale] == ["a"]
    assert buf.add(scored("d", [6]), None, current_version=6) is None
    assert [e.sample.event_id for e in buf.take(2)] == ["c", "d"]
    assert buf.counters() == {"buffered": 0, "added": 3, "taken": 2, "dropped_duplicate": 1, "dropped_empty": 1,
                              "dropped_stale": 2}


def test_buffer_trains_each_trajectory_once_newest_revision_first() -> None:
    from trainer.buffer import SampleBuffer

    buf = SampleBuffer(max_staleness=4)
    assert buf.add(scored("a0", [0], trajectory_id="a", revision=0), None, 0) is None
    assert buf.add(scored("b0", [0], trajectory_id="b", revision=0), None, 0) is None
    assert buf.add(scored("a1", [0], trajectory_id="a", revision=1), None, 0) is None  # replaces a0
    assert buf.add(scored("a0x", [0], trajectory_id="a", revision=0), None, 0) == "superseded"  # older than queued
    assert buf.take(2) == []  # superseded entries must be purged (and their records released) first
    assert [e.sample.event_id for e in buf.purge_stale(0)] == ["a0"]
    assert [e.sample.event_id for e in buf.take(2)] == ["b0", "a1"]
    assert buf.add(scored("a2", [0], trajectory_id="a", revision=2), None, 0) == "already_trained"
    assert buf.counters()["dropped_superseded"] == 2 and buf.counters()["dropped_already_trained"] == 1


def test_greedy_turns_are_not_trained_and_processed_ones_are_recomputed() -> None:
    from trainer.batch import collate, trainable_mask

    hot, cold, warm = scored("h", [0, 0]), scored("c", [0, 0], temperature=0.0), scored("w", [0, 0], temperature=0.7)
    assert trainable_mask(hot.segments[0]) == (hot.segments[0].mask, {})
    mask, masked = trainable_mask(cold.segments[0])
    assert sum(mask) == 0 and masked == {"greedy": 2}
    batch = collate([hot, cold, warm], [0.0, 0.0, 0.0])
    assert batch.mask[0].sum() == 2 and batch.mask[1].sum() == 0 and batch.mask[2].sum() == 2
    assert batch.completion_tokens == 6 and batch.masked == {"greedy": 2}
    # Only the warm sample's turns are recomputed under their processing (rows are segments).
    assert {row for row, *_ in batch.processed} == {2} and all(p.temperature == 0.7 for *_, p in batch.processed)


def test_offset_tracker_commits_only_done_prefixes() -> None:
    from flywheel.bus.base import Record
    from trainer.buffer import OffsetTracker

    recs = [Record("t", p, o, None, b"") for p, o in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]]
    tracker = OffsetTracker()
    for r in recs:
        tracker.track(r)
    tracker.done(recs[0])
    tracker.done(recs[2])  # offset 1 of partition 0 still waits in the buffer
    tracker.done(recs[4])
    assert tracker.committable() == [recs[0]]
    tracker.done(recs[1])
    tracker.done(recs[3])
    assert sorted(tracker.committable(), key=lambda r: r.partition) == [recs[2], recs[4]]
    assert tracker.committable() == []


def test_collate_pads_rows_and_aligns_advantages() -> None:
    from trainer.batch import collate

    a = scored("a", [0, 0], rewards=[1.0, 0.0])  # tokens 9 10 20 11 21, trainable at 2 and 4
    b = scored("b", [0], rewards=[2.0])  # tokens 9 10 20
    batch = collate([a, b], baselines=[0.5, 1.0])
    assert batch.tokens.tolist() == [[9, 10, 20, 11, 21], [9, 10, 20, 0, 0]]
    assert batch.attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 0, 1], [0, 0, 1, 0, 0]]
    assert batch.logp_behaviour.tolist() == [[0.0, 0.0, -0.5, 0.0, -1.5], [0.0, 0.0, -0.5, 0.0, 0.0]]
    assert batch.advantages.tolist() == [[0.0, 0.0, 0.5, 0.0, -0.5], [0.0, 0.0, 1.0, 0.0, 0.0]]
    assert batch.positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]
    assert batch.sample_index.tolist() == [[0, 0, 0, 0, 0], [1, 1, 1, -1, -1]]
    assert batch.cu_seqlens is None and not batch.packed


def test_collate_packs_segments_back_to_back_in_one_row() -> None:
    from trainer.batch import collate

    a = scored("a", [0, 0], rewards=[1.0, 0.0])  # tokens 9 10 20 11 21, trainable at 2 and 4
    b = scored("b", [0], rewards=[2.0], temperature=0.7)  # tokens 9 10 20, processed
    batch = collate([a, b], baselines=[0.5, 1.0], packed=True)
    assert batch.tokens.tolist() == [[9, 10, 20, 11, 21, 9, 10, 20]]
    assert batch.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert batch.cu_seqlens.tolist() == [0, 5, 8] and batch.max_seqlen == 5
    assert batch.mask.tolist() == [[0, 0, 1, 0, 1, 0, 0, 1]]
    assert batch.advantages.tolist() == [[0.0, 0.0, 0.5, 0.0, -0.5, 0.0, 0.0, 1.0]]
    assert batch.sample_index.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]
    # b's turn sits at 2..3 of its segment, which starts at 5 of the row; its history starts there.
    assert [(row, begin, start, end) for row, begin, start, end, _ in batch.processed] == [(0, 5, 7, 8)]
