"""The task's held-out metric: the success rate of one sampled answer per problem.

Sampled exactly as the product samples (the chat format, the product's sampling settings, by
default temperature 1, the model's eos), so the number is the success rate a user would see;
deterministic for a given ``seed``.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from demo.tinymodel.task import Problem, is_correct, user_message
from flywheel.lm import chat_prompt_ids, completion_text, generate
from flywheel.sampling import NEUTRAL, Processing


def evaluate(
    model: PreTrainedModel,
    tokenizer,
    problems: list[Problem],
    *,
    seed: int = 0,
    batch_size: int = 64,
    max_new_tokens: int = 16,
    processing: Processing = NEUTRAL,
) -> float:
    """Success rate over ``problems`` with one answer each, sampled under ``processing`` (the
    held-out metric)."""
    if not problems:
        raise ValueError("no problems to evaluate")
    eos = tokenizer.eos_token_id
    solved = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": user_message(p)}]) for p in chunk]
        samples = generate(
            model, prompts, max_new_tokens=max_new_tokens, processing=processing, seed=seed + start, eos_token_id=eos
        )
        solved += sum(is_correct(p, completion_text(tokenizer, s.token_ids)) for p, s in zip(chunk, samples, strict=True))
    return solved / len(problems)
