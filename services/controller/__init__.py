"""The controller service."""
