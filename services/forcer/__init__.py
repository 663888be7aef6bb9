"""The forcer service."""
