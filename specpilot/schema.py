"""Every SpecPilot event, in one place.

Contract:
- An event is a frozen, keyword-only msgspec ``Struct`` with a stable, explicit tag (never reused)
  and the common envelope (``Event``). Names are past tense.
- ``ALL_EVENTS`` is the one tagged union; ``encode``/``decode`` are the one encoder and decoder.
  ``encode`` is canonical: the same event always gives the same bytes (fields in declaration
  order), so the ledger's hash chain can be recomputed from the stored payloads.
- Each type names the services that may publish it (``sources``); the recorder refuses an event
  whose subject's source is not among them (``SecurityViolation``).
- Fields are only ever added with defaults, so old events keep decoding: ``tests/golden`` holds
  encoded events of every type that must keep decoding.

What this module does not do: I/O, subjects (see ``subjects``), validation beyond types.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import os
import time
from typing import Any, ClassVar

import msgspec

Scalar = str | int | float | bool
Options = dict[str, Scalar]

MASTER, SUBAGENT, CONTROLLER, FORCER, MEMORY = "master", "subagent", "controller", "forcer", "memory"
SERVICES: tuple[str, ...] = (MASTER, SUBAGENT, CONTROLLER, FORCER, MEMORY)


def new_event_id(now_ns: int | None = None) -> str:
    """A UUIDv7 string: 48-bit Unix milliseconds, then random bits, so ids sort by time."""
    ms = (now_ns if now_ns is not None else time.time_ns()) // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | (rand >> 68 & 0xFFF) << 64 | 0b10 << 62
    value |= rand & ((1 << 62) - 1)
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def derived_id(cause_event_id: str, key: str) -> str:
    """A UUIDv7-shaped id derived from a cause: the cause's millisecond prefix (so it sorts right after its
    cause) and the hash bits of ``key`` (naming the cause and what answers it), the same every time (a
    redelivered cause's answer is the same event: the stream's dedupe and the ledger's primary key absorb
    it). The publisher's bus mints it (`mint`)."""
    hexid = cause_event_id.rpartition(":")[2].replace("-", "")  # the cause's id without its minter
    ms = hexid[:12] if len(hexid) == 32 else "0" * 12
    h = hashlib.sha256(key.encode()).hexdigest()
    raw = f"{ms}7{h[:3]}{'89ab'[int(h[15], 16) % 4]}{h[3:18]}"
    return f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:32]}"


def minted_by(event_id: str) -> str | None:
    """The service an event id names as its minter (``<source>:<rest>``); None for an id without one (ids
    recorded before they carried their source: a UUIDv7 or a round's name has no colon)."""
    source, sep, rest = event_id.partition(":")
    return source if sep and rest else None


def mint(source: str, event_id: str) -> str:
    """``event_id`` as ``source`` publishes it: prefixed ``<source>:`` unless it names a minter already (a
    foreign one the recorder then refuses: `bus.authorised`)."""
    return event_id if minted_by(event_id) is not None else f"{source}:{event_id}"


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """The envelope every event carries."""

    sources: ClassVar[frozenset[str]] = frozenset()

    event_id: str = msgspec.field(default_factory=new_event_id)
    ts_ns: int = msgspec.field(default_factory=time.time_ns)
    round_id: str = ""
    deployment: str = ""
    source: str = ""
    causation_id: str = ""  # the event this one reacts to
    correlation_id: str = ""  # the chain of work it belongs to (e.g. a direction or patch)

    @property
    def tag(self) -> str:
        return type(self).__struct_config__.tag  # type: ignore[return-value]


def _only(*names: str) -> frozenset[str]:
    return frozenset(names)


# --- set-up and analysis -------------------------------------------------------------------------


class DeploymentRegistered(Event, frozen=True, kw_only=True, tag="deployment.registered"):
    """A deployment spec and the commit of its stock system in the controller's repository."""

    sources: ClassVar[frozenset[str]] = _only(CONTROLLER, MASTER)
    spec: dict[str, Any] = {}
    stock_commit: str = ""


class RoundStarted(Event, frozen=True, kw_only=True, tag="round.started"):
    """A round began on a deployment with the given providers."""

    sources: ClassVar[frozenset[str]] = _only(MASTER)
    rounds: int = 1  # waves (0: until nothing is left to try or the budget ends)
    planner: str = ""
    coder: str = ""
    devices: list[str] = []
    directions: int = 0  # directions a wave plans (0: 2 on a CPU, one per device on GPUs)
    sealed_requests: int = 0  # Phase 4: sealed requests to run (0: all)
    sealed_trials: int = 3
    minutes: float = 0.0  # wall-clock budget: no candidate starts that would end after the sealed final would (0: none)


class HardwareMeasured(Event, frozen=True, kw_only=True, tag="hardware.measured"):
    """Peak bandwidth and FLOP/s measured on the device (the cost model's denominators)."""

    sources: ClassVar[frozenset[str]] = _only(MASTER, CONTROLLER)
    device: str
    bandwidth_bytes_s: float
    flops_s: float
    launch_s: float = 0.0  # host time of one eager operator launch (0: not measured)
    kernel_floor_s: float = 0.0  # device time of one tiny kernel replayed back to back in a CUDA graph (0: CPU)
    method: str = ""
    # the kind of machine (device kind, ISA or GPU, worker threads, dtype): what memory entries are compared by
    machine: dict[str, Any] = {}


class ProfileMeasured(Event, frozen=True, kw_only=True, tag="profile.measured"):
    """The time of one step split by kernel class, in seconds."""

    sources: ClassVar[frozenset[str]] = _only(MASTER, CONTROLLER)
    device: str
    system_commit: str = ""
    step_s: float
    classes_s: dict[str, float] = {}
    tau: float = 0.0
    block_size: int = 0
    t_ar_s: float = 0.0  # the AR step of the same system on the same requests
    n_tokens: int = 0  # tokens per verification (root included) of the profiled system
    # tokens per step's forward actually run (root included), a mean: below n_tokens when the drafter
    # proposes fewer (an n-gram without a match verifies the root alone); 0: not measured
    verified_tokens: float = 0.0
    context: int = 0  # mean cached positions attended to during the profiled steps
    dtype: str = ""
    shape: dict[str, int] = {}  # the target's dimensions (specpilot.engine.model.ModelConfig)
    replay_depths: list[list[int]] = []  # per request: how deep the drafter's candidates match the target, by position
    chain_depths: list[list[int]] = []  # the same for the drafter's first candidate only (a chain)
    launches: dict[str, float] = {}  # operator launches per step by kernel class (specpilot.harness.profile.launches)
    # Every other drafter of the target, replayed on the same outputs: {"chain_depths": [[...]] per
    # request, "draft_s": seconds per chain proposal, and for other drafters "depths": its trees'}
    # (specpilot.harness.replay.alternative_drafters)
    drafters: dict[str, dict[str, Any]] = {}
    # c(n) of a full chain of n drafts, measured (specpilot.harness.replay.chain_cost): n -> t(1 + n) / t(1)
    chain_cost: dict[int, float] = {}
    options: dict[str, Any] = {}  # the profiled system's options (overrides on the deployment's stock)
    # A batched deployment (rows > 1): the measured step of ``rows`` rows of one token (batched AR), that of
    # one row of ``rows`` tokens (the same linear work, no per-row part), and
    # c(n, rows) = t(rows x (1 + n)) / t(rows x 1) by draft count n (specpilot.harness.step_cost.step_cost)
    rows: int = 1
    t_ar_rows_s: float = 0.0
    t_one_row_s: float = 0.0
    batch_cost: dict[int, float] = {}


class CeilingComputed(Event, frozen=True, kw_only=True, tag="ceiling.computed"):
    """The cost-model ceiling and its three factors (tau, kernel, overhead)."""

    sources: ClassVar[frozenset[str]] = _only(MASTER)
    ceiling_speedup: float
    factors: dict[str, float] = {}
    floors_s: dict[str, float] = {}
    latency_floor_s: float = 0.0  # the step's kernels at the device's floor of a kernel (costmodel: latency floor)
    replay_tau: dict[str, float] = {}  # node budget -> the most tokens a step commits in exact replay, any drafter
    replay_by: dict[str, str] = {}  # node budget -> which replay reaches it ("ngram tree", "parallel chain", ...)
    # a batched deployment: `costmodel.BatchedCeiling` (rows, speedup at the floors and with the measured
    # step costs, the budgets reaching them, and the table by node budget); ceiling_speedup is then its
    # speedup at the floors
    batched: dict[str, Any] = {}


class DirectionPlanned(Event, frozen=True, kw_only=True, tag="direction.planned"):
    """One direction for one subagent on one device."""

    sources: ClassVar[frozenset[str]] = _only(MASTER)
    direction_id: str
    title: str
    rationale: str = ""
    factor: str = ""
    provider: str = ""
    device: str = ""
    memory_entry_id: str = ""
    hints: dict[str, Any] = {}
    evidence: dict[str, Any] = {}  # what the agent is told (specpilot.evidence.bundle), bounded in size


# --- patches and verdicts ------------------------------------------------------------------------


class PatchProposed(Event, frozen=True, kw_only=True, tag="patch.proposed"):
    """A subagent's patch: a diff against the current best, plus the options that enable it."""

    sources: ClassVar[frozenset[str]] = _only(SUBAGENT, MASTER)
    direction_id: str
    patch_id: str
    diff: str
    options: Options = {}
    base_commit: str = ""
    provider: str = ""
    notes: str = ""


class DirectionFailed(Event, frozen=True, kw_only=True, tag="direction.failed"):
    """A subagent could not turn a direction into any patch (provider error, no valid value, ...)."""

    sources: ClassVar[frozenset[str]] = _only(SUBAGENT)
    direction_id: str
    provider: str = ""
    reason: str = ""


class ConversationUsed(Event, frozen=True, kw_only=True, tag="conversation.used"):
    """What one LLM conversation cost (a subagent's coder or the master's planner), finished or not."""

    sources: ClassVar[frozenset[str]] = _only(MASTER, SUBAGENT)
    purpose: str  # "coder" | "planner"
    direction_id: str = ""  # the coder's direction ("" for the planner)
    provider: str = ""  # e.g. "anthropic:claude-..."
    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    ended: str = ""  # "finished" | "turns" | "wall" | "tokens" | "error"
    tools: list[str] = []  # tool calls in order


class PatchRefused(Event, frozen=True, kw_only=True, tag="patch.refused"):
    """The controller's policy refused a patch before running it."""

    sources: ClassVar[frozenset[str]] = _only(CONTROLLER)
    patch_id: str
    rule: str
    reason: str


class PatchTested(Event, frozen=True, kw_only=True, tag="patch.tested"):
    """The candidate's tests and default check ran in the sandbox."""

    sources: ClassVar[frozenset[str]] = _only(CONTROLLER)
    patch_id: str
    passed: bool
    default_outputs_identical: bool = False
    detail: str = ""
    sandbox: dict[str, Any] = {}
    # The best the patch was merged onto when another promotion moved it past the patch's base (its
    # candidate is the integration of both); "" when the patch was written on the best it is timed against.
    integrated_onto: str = ""
    options: dict[str, Any] = {}  # the candidate's options: the best's, with the patch's changes from its base


class TimingMeasured(Event, frozen=True, kw_only=True, tag="timing.measured"):
    """Raw paired timing samples; ``kind`` is ``candidate`` or ``noise`` (stock vs stock)."""

    sources: ClassVar[frozenset[str]] = _only(CONTROLLER)
    patch_id: str = ""
    kind: str = "candidate"
    device: str = ""
    incumbent_commit: str = ""
    candidate_commit: str = ""
    incumbent_s: list[float] = []
    candidate_s: list[float] = []
    order: list[str] = []
    load: list[float] = []
    noise: float = 0.0
    requests: int = 0  # requests per run (each trial is two runs)
    wall_s: float = 0.0  # wall-clock seconds of the whole timing, worker starts included
    interleaved: bool = False  # both workers alive in each trial, taking turns request by request
    request_s: list[list[float]] = []  # seconds of each request, per run, in each trial's `order`
    carryover: dict[str, float] = {}  # interleaved: effect, lower_bound, p_value (stats.carryover)
    # untimed seconds (start-up and warm-up) of each worker of each system (bounded: stats.untimed_excess)
    incumbent_untimed_s: list[float] = []
    candidate_untimed_s: list[float] = []
    reused_from: str = ""  # noise: taken from this machine's cache ("<data dir>: <event id>"), not measured here


class VerdictIssued(Event, frozen=True, kw_only=True, tag="verdict.issued"):
    """Promote or reject, with every statistic behind the decision."""

    sources: ClassVar[frozenset[str]] = _only(CONTROLLER)
    patch_id: str
    decision: str  # "promote" | "reject"
    reason: str = ""
    gain: float = 0.0
    lower_bound: float = 0.0
    upper_bound: float = 0.0
    bar: float = 0.0
    noise: float = 0.0
    n_trials: int = 0
    outputs_identical: bool = True
    forcing_passed: bool | None = None
    ceiling: float = 0.0
    timing_event_id: str = ""
    signature: str = ""


class ForcingRequested(Event, frozen=True, kw_only=True, tag="forcing.requested"):
    """Ask the forcer to prove a system's outputs are the stock target's own choices."""

    sources: ClassVar[frozenset[str]] = _only(CONTROLLER)
    request_id: str
    patch_id: str = ""
    system_commit: str = ""
    outputs: list[dict[str, Any]] = []  # [{"prompt_ids": [...], "tokens": [...]}]


class ForcingReported(Event, frozen=True, kw_only=True, tag="forcing.reported"):
    """Token-forcing result: counts, rates, intervals, p-values, audited events."""

    sources: ClassVar[frozenset[str]] = _only(FORCER)
    request_id: str
    patch_id: str = ""
    passed: bool
    reason: str = ""
    stats: dict[str, Any] = {}
    audited: list[dict[str, Any]] = []


class IntegrationProposed(Event, frozen=True, kw_only=True, tag="integration.proposed"):
    """The master asks the controller to time promoted patches together before advancing."""

    sources: ClassVar[frozenset[str]] = _only(MASTER)
    integration_id: str
    patch_ids: list[str] = []


class BestAdvanced(Event, frozen=True, kw_only=True, tag="best.advanced"):
    """The current best system moved to a new commit."""

    sources: ClassVar[frozenset[str]] = _only(CONTROLLER)
    commit: str
    previous_commit: str = ""
    patch_id: str = ""
    options: Options = {}
    gain: float = 0.0


class SealedFinalRequested(Event, frozen=True, kw_only=True, tag="sealed.final.requested"):
    """Phase 4: the master asks the controller to run the final system, stock and AR on the sealed split."""

    sources: ClassVar[frozenset[str]] = _only(MASTER)
    requests: int = 0  # sealed requests to run (0: all of them)
    trials: int = 3


class SealedFinalReported(Event, frozen=True, kw_only=True, tag="sealed.final.reported"):
    """Phase 4: final, stock and AR on the sealed split."""

    sources: ClassVar[frozenset[str]] = _only(CONTROLLER)
    final_commit: str = ""
    results: dict[str, Any] = {}
    lossless: bool = False


# --- memory --------------------------------------------------------------------------------------


class MemoryEntryProposed(Event, frozen=True, kw_only=True, tag="memory.entry.proposed"):
    """A validated mechanism offered to structured memory (by the controller on a promotion, or by
    memory itself for an entry imported from another data directory: ``origin`` and its evidence)."""

    sources: ClassVar[frozenset[str]] = _only(CONTROLLER, MASTER, MEMORY)
    entry_id: str
    title: str = ""
    delta: str = ""  # unified diff against stock
    options: Options = {}
    requirements: dict[str, Any] = {}  # predicates on the deployment
    contract: str = ""  # the correctness contract it was checked under
    evidence: list[str] = []  # event ids
    source_commit: str = ""
    source_files: dict[str, str] = {}  # path -> sha256 of every file of the source system under engine/ and kernels/
    stock_files: dict[str, str] = {}  # the same for the stock the delta is against (as registered by the controller)
    origin: str = ""  # imported: where it was exported from (`specpilot memory import`)
    # the kind of machine it was found on (device kind, ISA or GPU, worker threads, dtype; {}: not recorded)
    machine: dict[str, Any] = {}
    imported_evidence: list[dict[str, Any]] = []  # imported: the evidence events themselves, as recorded there


class MemoryEntryAccepted(Event, frozen=True, kw_only=True, tag="memory.entry.accepted"):
    sources: ClassVar[frozenset[str]] = _only(MEMORY)
    entry_id: str


class MemoryEntryRejected(Event, frozen=True, kw_only=True, tag="memory.entry.rejected"):
    sources: ClassVar[frozenset[str]] = _only(MEMORY)
    entry_id: str
    reason: str = ""


class SecurityViolation(Event, frozen=True, kw_only=True, tag="security.violation"):
    """A message whose type its publisher may not emit; recorded instead of that message."""

    sources: ClassVar[frozenset[str]] = _only(MEMORY)
    subject: str
    claimed_type: str = ""
    claimed_source: str = ""
    reason: str = ""
    seq: int = 0
    payload_sha256: str = ""


class RoundFinished(Event, frozen=True, kw_only=True, tag="round.finished"):
    sources: ClassVar[frozenset[str]] = _only(MASTER)
    summary: dict[str, Any] = {}


ALL_EVENTS: tuple[type[Event], ...] = (
    DeploymentRegistered,
    RoundStarted,
    HardwareMeasured,
    ProfileMeasured,
    CeilingComputed,
    DirectionPlanned,
    PatchProposed,
    DirectionFailed,
    ConversationUsed,
    PatchRefused,
    PatchTested,
    TimingMeasured,
    VerdictIssued,
    ForcingRequested,
    ForcingReported,
    IntegrationProposed,
    BestAdvanced,
    SealedFinalRequested,
    SealedFinalReported,
    MemoryEntryProposed,
    MemoryEntryAccepted,
    MemoryEntryRejected,
    SecurityViolation,
    RoundFinished,
)
AnyEvent = functools.reduce(operator.or_, ALL_EVENTS)  # the tagged union msgspec decodes into
BY_TAG: dict[str, type[Event]] = {t.__struct_config__.tag: t for t in ALL_EVENTS}  # type: ignore[misc]

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)


class DecodeError(ValueError):
    """Raised for bytes that are not a valid SpecPilot event."""


def encode(event: Event) -> bytes:
    """Canonical JSON bytes of an event."""
    return _encoder.encode(event)


def decode(data: bytes) -> Event:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not a SpecPilot event: {exc}") from exc


def stamp(event: Event, **envelope: Any) -> Event:
    """A copy of ``event`` with envelope fields set (e.g. ``source``, ``causation_id``)."""
    return msgspec.structs.replace(event, **envelope)
