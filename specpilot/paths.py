"""Where SpecPilot keeps its files. Every default location is written here once.

The data directory holds the NATS server's store and config, per-service credentials, the DuckDB
ledger, cached model tensors, the controller's git repository of systems, and plots. It defaults to
``$SPECPILOT_DATA`` or ``$XDG_DATA_HOME/specpilot`` (``~/.local/share/specpilot``). Facts about this
machine that every data directory on it may reuse (the controller's timing noise) live in the machine
cache, ``$SPECPILOT_MACHINE_CACHE`` or ``$XDG_CACHE_HOME/specpilot`` (``~/.cache/specpilot``).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def default_data_dir() -> Path:
    if env := os.environ.get("SPECPILOT_DATA"):
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "specpilot"


def model_cache_dir(data_dir: Path | None = None) -> Path:
    """Converted model tensors and tokenizers (engine cache)."""
    return (data_dir or default_data_dir()) / "models"


def machine_cache_dir() -> Path:
    """Measurements of this machine shared by its data directories (`machine_cache_dir() / "noise"`)."""
    if env := os.environ.get("SPECPILOT_MACHINE_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specpilot"
