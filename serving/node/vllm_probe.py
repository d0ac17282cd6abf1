"""The start-up probe of a vLLM server's ``--logprobs-mode``: refuse raw logprobs, which the trainer cannot use.

vLLM returns the logprobs of the model's raw logits by default (``--logprobs-mode raw_logprobs``);
flywheel needs those of the distribution it sampled from (``processed_logprobs``). The server does
not say which mode it runs, so :func:`logprobs_mode` asks two one-token completions of one prompt,
every sampling option explicit (the model folder's ``generation_config.json`` changes nothing),
with the top two logprobs:

- ``A``: temperature 1, no top-k, top-p, min-p or penalties: raw and processed agree, so its two
  top logprobs give the raw logit gap ``g`` between the two most likely tokens;
- ``B``: temperature :data:`TEMPERATURE` (2), ``top_k = 2``. Raw: ``A``'s numbers again. Processed:
  the log-softmax of two logits ``g / T`` apart: ``(-log(1 + e^(-g/T)), that - g/T)``.

The first position's distribution does not depend on the token sampled, so the two answers
describe the same distribution. :func:`classify` decides "processed" when ``B`` is within
:data:`TOLERANCE` of the processed prediction and not of ``A``, "raw" in the opposite case, and
nothing otherwise (then the next prompt is tried). A peaked model does not fool it: ``A`` = (0, -g)
and processed ``B`` = (0, -g/2) are further apart the larger ``g``. Limits: a position whose top
two tokens are tied and where the rest of the vocabulary has no mass reads the same in both modes
(undecided), and ``raw_logits``/``processed_logits`` match neither prediction (refused too).
It checks the server's mode once, at start-up; nothing here inspects later requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

TEMPERATURE = 2.0
TOLERANCE = 0.05
PROMPTS = ("The", "Hello, my name is", "1, 2, 3,")
FIX = ("start vLLM with --logprobs-mode processed_logprobs (its default, raw_logprobs, returns the "
       "logprobs before temperature, top-k/top-p and penalties, which the trainer cannot use)")


class LogprobsModeError(RuntimeError):
    """vLLM returns logprobs that are not those of the distribution it sampled from, or the probe
    could not tell."""


def request(model: str, prompt: str, *, temperature: float, top_k: int) -> dict[str, Any]:
    """One probe completion: one token, the top two logprobs, every sampling option explicit."""
    return {"model": model, "prompt": prompt, "max_tokens": 1, "logprobs": 2, "return_tokens_as_token_ids": True,
            "temperature": temperature, "top_k": top_k, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "n": 1, "stream": False}


def top_two(answer: Any) -> list[tuple[str, float]]:
    """The two most likely tokens of a text completion's first position, most likely first."""
    try:
        entry = answer["choices"][0]["logprobs"]["top_logprobs"][0]
        pairs = sorted(((str(t), float(lp)) for t, lp in entry.items()), key=lambda p: -p[1])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise LogprobsModeError(f"vLLM's answer to the logprobs probe has no top logprobs ({exc!r}): "
                                f"{answer!r:.300}") from None
    if len(pairs) < 2:
        raise LogprobsModeError(f"vLLM returned {len(pairs)} top logprob(s) where 2 were asked for")
    return pairs[:2]


def classify(a: list[tuple[str, float]], b: list[tuple[str, float]], temperature: float = TEMPERATURE,
             tolerance: float = TOLERANCE) -> str | None:
    """"processed", "raw", or None (undecided) for the two probe answers' top two (module docstring)."""
    if {t for t, _ in a} != {t for t, _ in b}:
        return None
    (_, a1), (_, a2) = a
    (_, b1), (_, b2) = b
    gap = (a1 - a2) / temperature
    first = -math.log1p(math.exp(-gap))
    processed = max(abs(b1 - first), abs(b2 - (first - gap)))
    raw = max(abs(b1 - a1), abs(b2 - a2))
    if processed <= tolerance < raw:
        return "processed"
    if raw <= tolerance < processed:
        return "raw"
    return None


def logprobs_mode(post: Callable[[dict[str, Any]], Any], model: str) -> str:
    """Probe the server through ``post`` (a ``/v1/completions`` body -> its JSON answer); return
    "processed", or raise :class:`LogprobsModeError` saying why and how to fix it."""
    seen = []
    for prompt in PROMPTS:
        a = top_two(post(request(model, prompt, temperature=1.0, top_k=0)))
        b = top_two(post(request(model, prompt, temperature=TEMPERATURE, top_k=2)))
        verdict = classify(a, b)
        if verdict == "processed":
            return verdict
        if verdict == "raw":
            raise LogprobsModeError(f"vLLM returns raw logprobs: at temperature {TEMPERATURE:g} with top_k=2 the "
                                    f"top two logprobs were {b}, the same as at temperature 1 ({a}); {FIX}")
        seen.append(f"{prompt!r}: T=1 {a}, T={TEMPERATURE:g} top_k=2 {b}")
    raise LogprobsModeError("the logprobs probe could not tell whether vLLM returns processed logprobs "
                            f"({'; '.join(seen)}); {FIX}, and use a model whose first tokens are not exact ties")
