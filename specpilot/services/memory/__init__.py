"""The memory service."""
