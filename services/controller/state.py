"""What the controller knows between patches, folded from events: pure, no I/O.

The ledger is the one source of truth. At start-up the controller folds the ledger's events into a fresh
`State` (`RESTORED_FROM`); afterwards it folds every event it emits or consumes (`evolve`), so the state
never holds anything the ledger does not. The git branch ``best/<deployment>`` in the systems repository
is derived from it (re-pointed when they disagree), never read as a source. `specpilot time`, which runs
without a bus, folds the events of its own local log the same way (`LOCAL_LOG`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specpilot import schema

RESTORED_FROM = (schema.DeploymentRegistered, schema.BestAdvanced, schema.CeilingComputed, schema.TimingMeasured)
LOCAL_LOG = "local-events.jsonl"  # under DATA/controller: the events `specpilot time` emitted, one a line


@dataclass(frozen=True)
class Best:
    commit: str
    options: dict


@dataclass
class State:
    registered: dict[str, str] = field(default_factory=dict)  # deployment -> its stock commit
    best: dict[str, Best] = field(default_factory=dict)  # deployment -> current best (absent: stock)
    noise: dict[str, float] = field(default_factory=dict)  # "deployment@device" -> noise of the gain
    # "deployment@device" -> trials the noise figure was measured over (0: reused, the design's own count)
    noise_trials: dict[str, int] = field(default_factory=dict)
    ceiling: dict[str, float] = field(default_factory=dict)  # deployment -> physical ceiling (speedup)
    options_at: dict[str, dict] = field(default_factory=dict)  # every best commit so far -> its options

    def best_options(self, deployment: str) -> dict:
        return dict(self.best[deployment].options) if deployment in self.best else {}

    def base_options(self, deployment: str, base_commit: str) -> dict:
        """The options of the system a patch was written on: a former best's, stock's for "" or the
        deployment's registered stock commit, the current best's for a commit this state never saw."""
        if base_commit in self.options_at:
            return dict(self.options_at[base_commit])
        if not base_commit or base_commit == self.registered.get(deployment):
            return {}
        return self.best_options(deployment)


def noise_key(deployment: str, device: str) -> str:
    return f"{deployment}@{device}"


def evolve(state: State, event: schema.Event) -> State:
    """Fold one event into ``state`` (in place; returned for chaining)."""
    match event:
        case schema.DeploymentRegistered(source="controller"):
            state.registered[event.deployment] = event.stock_commit
        case schema.BestAdvanced():
            state.best[event.deployment] = Best(event.commit, dict(event.options))
            state.options_at[event.commit] = dict(event.options)
        case schema.CeilingComputed():
            state.ceiling[event.deployment] = event.ceiling_speedup
        case schema.TimingMeasured(kind="noise"):
            state.noise[noise_key(event.deployment, event.device)] = event.noise
            state.noise_trials[noise_key(event.deployment, event.device)] = len(event.incumbent_s)
        case _:
            pass
    return state


def fold(events) -> State:
    state = State()
    for e in events:
        evolve(state, e)
    return state
