"""The gateway role: OpenAI-compatible proxy with capture (app), event building (capture), entry point (main)."""
