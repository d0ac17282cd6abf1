"""The distribution a generation was sampled from: which sampling knobs an engine applied (no torch).

An engine shapes the model's logits before it samples: logit bias, then the repetition, frequency
and presence penalties, then temperature, min-p, top-k and top-p. The log-probability of a token
under the shaped ("processed") distribution is what importance sampling needs, so the built-in
engine samples from ``flywheel.logprobs.processed_logprobs`` under a :class:`Processing` and the
trainer recomputes the same function on its own logits for the ratio; with equal weights the two
agree to float rounding. This module holds the parameters, and imports no torch, so the gateway
can record them; ``flywheel/logprobs.py`` holds the maths.

The order and each step mirror vLLM's V1 sampler (``vllm/v1/sample/sampler.py``, ``Sampler.forward``
and ``Sampler.sample``, 0.18.0 and 0.33.0 alike; docs/vllm.md):

1. logit bias added (``LogitBiasLogitsProcessor`` in ``vllm/v1/sample/logits_processor/builtin.py``;
   vLLM clamps each bias to [-100, 100], flywheel refuses values outside it);
2. penalties (``apply_penalties`` in ``vllm/model_executor/layers/utils.py``): a token seen in the
   prompt or the output so far has its logit divided by the repetition penalty when positive,
   multiplied when not; then ``frequency_penalty x (count in the output)`` and
   ``presence_penalty x (seen in the output)`` are subtracted (OpenAI's definition: output only);
3. greedy (``temperature`` below 1e-5, vLLM's ``_SAMPLING_EPS``): argmax, nothing else applies;
4. temperature: logits divided by it;
5. min-p (``MinPLogitsProcessor``): tokens whose probability is below ``min_p x`` the largest are dropped;
6. top-k then top-p (``apply_top_k_top_p`` in ``vllm/v1/sample/ops/topk_topp_sampler.py``): top-k
   keeps every token at least as likely as the k-th (ties kept; ``top_k`` 0 or -1 is off); top-p
   sorts ascending and drops tokens whose cumulative probability is at most ``1 - top_p``, always
   keeping the most likely one;
7. ``log_softmax`` of what is left: vLLM's ``processed_logprobs``.

:func:`applied` says which parameters an engine applied to a request: the client's value, else the
model's generation defaults (:func:`generation_defaults`: vLLM's ``--generation-config auto``
reads the same keys from ``generation_config.json``), else OpenAI's neutral defaults.
:func:`unsupported_knobs` names request fields that change the distribution in ways this module
cannot recompute (structured output, banned or required tokens, beam search...): the built-in
engine refuses them, and a generation sampled with them is recorded but never trained on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from flywheel.settings import Settings

#: Below this temperature an engine decodes greedily (vLLM's ``_SAMPLING_EPS``).
GREEDY_BELOW = 1e-5
#: Parameters a model's ``generation_config.json`` may set and vLLM then applies by default
#: (``ModelConfig.get_diff_sampling_param``, vllm/config/model.py); ``max_new_tokens`` is ``max_tokens``.
GENERATION_CONFIG_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
#: The keys :func:`generation_defaults` gives (what a node's heartbeat may announce).
DEFAULT_KEYS = frozenset(GENERATION_CONFIG_KEYS) - {"max_new_tokens"} | {"max_tokens"}


@dataclass(frozen=True)
class Processing:
    """The knobs that shape the sampled distribution (hashable: an engine batches equal ones together)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: (token id, bias) pairs, sorted.
    logit_bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, source: Any) -> Processing:
        """The processing of a mapping (:func:`applied`'s) or of anything with these attributes
        (``SamplingParams``, ``Turn``); ``logit_bias`` keys may be strings (JSON)."""
        get = source.get if isinstance(source, Mapping) else lambda key: getattr(source, key, None)
        values = {f.name: get(f.name) for f in fields(cls) if f.name != "logit_bias"}
        values = {k: v for k, v in values.items() if v is not None}
        bias = get("logit_bias") or {}
        values["top_k"] = max(int(values.get("top_k") or 0), 0)
        return cls(**values, logit_bias=tuple(sorted((int(k), float(v)) for k, v in bias.items())))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def neutral(self) -> bool:
        """Sampling from the model's own distribution (``log_softmax`` of the logits)."""
        return self == NEUTRAL


NEUTRAL = Processing()


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults a model directory's ``generation_config.json`` sets, as vLLM applies
    them by default (module docstring): only the keys of :data:`GENERATION_CONFIG_KEYS` that are set,
    ``max_new_tokens`` renamed ``max_tokens``. ``{}`` when the file is absent or sets none."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    out = {key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def node_defaults(settings: Settings, model_dir: str | Path | None = None) -> dict[str, Any]:
    """The sampling defaults a node's engine applies (``node.generation_config``): those of the
    model directory (default ``model.path``) under ``auto``, none under ``vllm``."""
    model_dir = model_dir or settings.model.path
    if settings.node.generation_config == "vllm" or not model_dir:
        return {}
    return generation_defaults(model_dir)


#: OpenAI's (and vLLM's) value for a parameter the client and the model's defaults leave unset.
OPENAI_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Processing) if f.name != "logit_bias"}
#: Parameters vLLM takes from the request model's own defaults, never from generation_config.json
#: (``presence_penalty`` and ``frequency_penalty`` default to 0.0 in vLLM's request models).
_REQUEST_ONLY = ("presence_penalty", "frequency_penalty")


def applied(body: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling parameters an engine applies to a request ``body``: for each knob the client's
    value, else the model's default (``defaults``, from :func:`generation_defaults`), else OpenAI's.
    Also ``seed``, ``n``, ``logit_bias`` (string token ids) and ``max_tokens`` as sent or defaulted."""
    out: dict[str, Any] = {}
    for key, neutral in OPENAI_DEFAULTS.items():
        value = body.get(key)
        if value is None and key not in _REQUEST_ONLY:
            value = defaults.get(key)
        out[key] = neutral if value is None else value
    if out["top_k"] == -1:  # vLLM's other "off"
        out["top_k"] = 0
    bias = body.get("logit_bias")
    out["logit_bias"] = {str(k): float(v) for k, v in bias.items()} if isinstance(bias, Mapping) and bias else None
    out["seed"] = body.get("seed")
    out["n"] = body.get("n") or 1
    out["max_tokens"] = body.get("max_completion_tokens") or body.get("max_tokens") or defaults.get("max_tokens")
    return out


def _off(value: Any) -> bool:
    return value in (None, False, 0, "", [], {})


#: Request fields that reshape the distribution beyond :class:`Processing` (vLLM's sampling
#: params and structured outputs), with the test for the value that leaves it alone.
_UNSUPPORTED: dict[str, Any] = {
    "min_tokens": _off,  # eos and stop tokens masked for the first tokens
    "bad_words": _off,
    "allowed_token_ids": _off,
    "stop_token_ids": _off,
    "ignore_eos": _off,
    "logits_processors": _off,
    "use_beam_search": _off,
    "length_penalty": lambda v: v in (None, 1, 1.0),
    "best_of": lambda v: v in (None, 1),
    "typical_p": lambda v: v in (None, 1, 1.0),
    "guided_json": _off, "guided_regex": _off, "guided_choice": _off, "guided_grammar": _off,
    "structured_outputs": _off,
    "response_format": lambda v: v is None or (isinstance(v, Mapping) and v.get("type") in (None, "text")),
}


def unsupported_knobs(body: Mapping[str, Any]) -> list[str]:
    """The request fields of ``body`` that reshape the sampled distribution in a way
    ``flywheel.logprobs.processed_logprobs`` does not reproduce (sorted). A ``tool_choice`` that forces a call
    (``"required"`` or a named function) counts: vLLM enforces it with structured output."""
    out = [key for key, neutral in _UNSUPPORTED.items() if key in body and not neutral(body[key])]
    choice = body.get("tool_choice")
    if body.get("tools") and (choice == "required" or isinstance(choice, Mapping)):
        out.append("tool_choice")
    return sorted(out)
