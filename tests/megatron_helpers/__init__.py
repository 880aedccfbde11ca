"""Helpers for the Megatron integration tests (tests/test_megatron_*.py)."""
