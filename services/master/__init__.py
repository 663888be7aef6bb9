"""The master service."""
