"""The built-in serving node: engine (model + batching + hot swap), updater (registry -> engine), app, entry point."""
