"""PNG charts of a round: the cost model's gap factors and the sealed speedups (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def factor_chart(factors: dict[str, float], ceiling_speedup: float, path: Path) -> Path:
    """Bars of the tau / kernel / overhead factors (how far each is from its floor)."""
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3))
    names = list(factors)
    ax.bar(names, [factors[n] for n in names], color=["#4c72b0", "#dd8452", "#55a868"][: len(names)])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("gap to the floor (x)")
    ax.set_title(f"cost model: ceiling {ceiling_speedup:.1f}x over AR")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sealed_chart(sealed: dict[str, Any], path: Path) -> Path:
    """Speedup over AR on the sealed requests (95% intervals): stock, final and the peer."""
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    names, values, lows, highs = [], [], [], []
    for name in ("stock", "final"):
        row = sealed.get(name, {})
        if "over_ar" in row:
            lo, hi = row.get("over_ar_ci95", [row["over_ar"]] * 2)
            names.append(name)
            values.append(row["over_ar"])
            lows.append(row["over_ar"] - lo)
            highs.append(hi - row["over_ar"])
    peer = sealed.get("peer", {})
    if isinstance(peer, dict) and "speedup" in peer:
        names.append("transformers\nprompt lookup")
        values.append(peer["speedup"])
        lows.append(0.0)
        highs.append(0.0)
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(names, values, yerr=[lows, highs], capsize=4, color="#4c72b0")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speedup over AR (sealed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
