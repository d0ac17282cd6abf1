"""flywheel's shared kernel: wire contracts, settings, bus, database, weights, model loading."""

__version__ = "0.1.0"
