"""The embedded default model: a tiny causal LM for a simulated letter-sorting assistant.

- :mod:`~flywheel.tinymodel.task`: the task (problems, held-out set, correctness, plausible mistakes).
- :mod:`~flywheel.tinymodel.tokenizer`: the word-level tokenizer and the chat template.
- :mod:`~flywheel.tinymodel.build`: builds and caches the model directory (``ensure_default_model``).
- :mod:`~flywheel.tinymodel.sampling`: loading, sampling with token ids and logprobs, weight export.

Importing this package imports neither torch nor transformers; the submodules that need them do.
"""
