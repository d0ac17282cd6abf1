"""flywheel's shared kernel: wire contracts, settings, bus, database, weights, CLI."""

__version__ = "0.1.0"
