"""Model shapes as the cost model and the services read them: torch-free, so any service may import it.

`Shape` is the subset of `specpilot.engine.model.ModelConfig` the byte floors need; `shape_of(config)` takes
it from any object with those attributes (a ModelConfig), for events (`ProfileMeasured.shape`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shape:
    """What the floors need to know of a decoder."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate: int

    @property
    def kv_dim(self) -> int:
        return self.dim // self.n_heads * self.n_kv_heads


def shape_of(config: Any) -> dict[str, int]:
    """The `Shape` fields of a model config, as a dict (what events carry)."""
    return {f.name: int(getattr(config, f.name)) for f in dataclasses.fields(Shape)}
