"""The gateway role: an OpenAI-compatible proxy that captures every generation (map: docs/architecture.md)."""
