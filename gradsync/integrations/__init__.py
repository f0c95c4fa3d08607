"""Adapters for training frameworks: ``lightning`` (a Lightning strategy). Accelerate needs none:
see docs/integrations.md. Each imports its framework only when imported itself."""
