"""trainer: loss maths (``loss``), sample buffer and batching (``buffer``), the recipe (``trainer.train:train``)."""
