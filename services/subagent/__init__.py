"""The subagent service."""
