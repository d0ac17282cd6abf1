"""The demo's default model: a tiny causal LM for a simulated letter-sorting assistant.

- :mod:`~demo.tinymodel.task`: the task (problems, held-out set, correctness, plausible mistakes).
- :mod:`~demo.tinymodel.tokenizer`: the word-level tokenizer and the chat template.
- :mod:`~demo.tinymodel.build`: builds and caches the model directory (``ensure_default_model``).
- :mod:`~demo.tinymodel.evaluate`: the task's held-out success rate.

Loading, sampling and weight export are the kernel's, for any local model (:mod:`flywheel.lm`).
Importing this package imports neither torch nor transformers; the submodules that need them do.
"""
