"""Shared fixtures live in tests/fixtures/*; each module is a pytest plugin listed here."""

pytest_plugins = [
    "tests.fixtures.services",  # PostgreSQL, SQLite, Redis: real services, unique names per test
    "tests.fixtures.kafka",  # a Kafka-protocol broker (Tansu) started by the suite, or KAFKA_BOOTSTRAP_SERVERS
    "tests.fixtures.model",  # the quick tiny model, built once per session
    "tests.fixtures.browser",  # headless Chromium (Debian's chromium) driven by Playwright
]
