"""trainer: the recipe (``train``), one optimizer step (``step``), loss maths (``loss``), buffer and batching (``buffer``)."""
