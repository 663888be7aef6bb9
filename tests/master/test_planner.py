"""The rules planner: memory entries first, then sweeps by factor, nothing twice, regime-aware."""

import dataclasses

import pytest

from specpilot.engine.options import EngineOptions, option, sweeps
from specpilot.services.master import planner
from specpilot.services.master.planner import History

CPU = {"device_kind": "cpu", "dtype": "fp32", "model_family": "llama", "mode": "batch1"}
GPU = {**CPU, "device_kind": "cuda", "dtype": "bf16"}
KNOWN = {"verify", "tree_nodes", "block_size", "ngram_min_match", "drafter", "cuda_graphs", "compile", "weight_format"}


def _plan(factors, facts=CPU, history=History(), entries=(), best=None, devices=1, coder="sweep", known=KNOWN,
          predict=None):
    return planner.plan(factors=factors, facts=facts, best_options=best or {}, known_options=set(known),
                        entries=list(entries), history=history, coder=coder, devices=devices, predict=predict)


def test_the_largest_factor_is_attacked_first_and_cpu_gets_no_gpu_mechanisms():
    (d,) = _plan({"tau": 1.5, "kernel": 3.0, "overhead": 2.0})
    assert d.provider == "sweep" and d.factor == "tau"  # kernel and overhead sweeps are GPU-only
    assert d.hints == {"option": "verify", "values": ["tree"], "base": {}}
    assert d.expected_patches == 1


def test_on_a_gpu_overhead_mechanisms_come_first_when_overhead_dominates():
    (d,) = _plan({"tau": 1.5, "kernel": 1.2, "overhead": 9.0}, facts=GPU)
    assert d.hints["option"] == "cuda_graphs"
    ds = _plan({"tau": 1.5, "kernel": 1.2, "overhead": 9.0}, facts=GPU, devices=3)
    assert [x.hints["option"] for x in ds] == ["cuda_graphs", "compile", "verify"]


def test_w12_is_a_kernel_mechanism_of_bf16_gpu_deployments_only():
    ds = _plan({"kernel": 2.0}, facts=GPU, devices=10)
    assert ds[0].factor == "kernel" and ds[0].hints["option"] == "weight_format" and ds[0].hints["values"] == ["w12"]
    fp32 = _plan({"kernel": 2.0}, facts={**GPU, "dtype": "fp32"}, devices=10)
    assert "weight_format" not in [d.hints.get("option") for d in fp32]  # it would round fp32 weights
    assert "weight_format" not in [d.hints.get("option") for d in _plan({"kernel": 2.0}, devices=10)]  # a CPU


def test_fusion_options_follow_graphs_and_fused_gemv_brings_fused_kernels_along():
    known = KNOWN | {"fused_kernels", "fused_gemv"}
    ds = _plan({"tau": 1.5, "kernel": 1.0, "overhead": 300.0}, facts=GPU, devices=4, known=known)
    assert [d.hints["option"] for d in ds] == ["cuda_graphs", "fused_kernels", "fused_gemv", "compile"]
    assert ds[2].hints["base"] == {"fused_kernels": True}  # the option only means something on fused blocks
    (d,) = _plan({"overhead": 300.0}, facts=GPU, known=known, best={"cuda_graphs": True, "fused_kernels": True})
    assert d.hints == {"option": "fused_gemv", "values": [True], "base": {"cuda_graphs": True, "fused_kernels": True},
                       "requires": {"fused_kernels": True}}
    assert all(d.hints["option"] not in ("fused_kernels", "fused_gemv") for d in _plan({"overhead": 9.0}, known=known,
                                                                                       devices=10))  # a CPU: none


def test_nothing_is_tried_twice_and_unknown_options_are_skipped():
    tried = frozenset({("verify", repr("tree")), ("block_size", repr(2))})
    ds = _plan({"tau": 2.0}, history=History(tried_options=tried), devices=10, known=KNOWN - {"drafter"})
    options = [d.hints["option"] for d in ds]
    assert "verify" not in options and "drafter" not in options
    block = next(d for d in ds if d.hints["option"] == "block_size")
    assert block.hints["values"] == [6, 8]
    # a dependent option brings what it needs into its base
    nodes = next(d for d in ds if d.hints["option"] == "tree_nodes")
    assert nodes.hints["base"]["verify"] == "tree"


def test_the_best_options_are_the_base_and_current_values_are_not_proposed():
    ds = _plan({"tau": 2.0}, best={"block_size": 6, "verify": "tree"}, devices=10)
    block = next(d for d in ds if d.hints["option"] == "block_size")
    assert block.hints["values"] == [2, 8] and block.hints["base"] == {"block_size": 6, "verify": "tree"}
    assert all(d.hints["option"] != "verify" for d in ds)


def test_memory_entries_of_this_machine_kind_come_first_once():
    entry = {"entry_id": "e1", "title": "tree", "delta": "", "options": {"verify": "tree"}, "same_machine": True}
    (d,) = _plan({"tau": 2.0}, entries=[entry])
    assert d.provider == "memory" and d.memory_entry_id == "e1" and d.hints["entry"]["options"] == {"verify": "tree"}
    (d,) = _plan({"tau": 2.0}, entries=[entry], history=History(applied_entries=frozenset({"e1"})))
    assert d.provider == "sweep"


AMX = {"device_kind": "cpu", "device": "amx", "threads": 1, "dtype": "fp32"}
AVX512 = {**AMX, "device": "avx512-bf16"}


def test_machine_kinds_compare_device_isa_threads_and_dtype():
    assert planner.same_machine_kind(AMX, dict(AMX))
    assert not planner.same_machine_kind(AMX, AVX512) and not planner.same_machine_kind(AMX, {**AMX, "threads": 2})
    assert not planner.same_machine_kind({}, AMX) and not planner.same_machine_kind(AMX, None)


def test_an_entry_from_another_machine_kind_is_a_hypothesis_ranked_by_the_cost_model():
    """The shipped entry (parallel drafter, block 2, recorded on an AMX machine) went first on an AVX-512
    machine and lost 25% (2026-12-07), and a CPU round's block size led an H100 round and lost (2026-12-05):
    an entry from elsewhere is ranked with this machine's sweeps by its predicted gain."""
    entry = {"entry_id": "e-amx", "delta": "", "options": {"drafter": "parallel", "block_size": 2}, "machine": AMX}

    def predicts(gain):
        return lambda option, value, base: {"drafter": gain, "verify": 1.5}.get(option)

    ds = _plan({"tau": 2.0}, entries=[entry], devices=20, predict=predicts(1.3))
    assert ds[0].provider == "sweep" and ds[0].hints["option"] == "verify"  # ranked, not first by rule
    hypothesis = next(d for d in ds if d.memory_entry_id == "e-amx")
    assert "another kind of machine" in hypothesis.rationale and "1.30x" in hypothesis.rationale
    ds = _plan({"tau": 2.0}, entries=[entry], devices=20, predict=predicts(0.7))  # a clear predicted loss: not timed
    assert all(d.memory_entry_id != "e-amx" for d in ds)
    # a code entry, or no cost model: last among what the wave times
    (alone,) = _plan({"tau": 2.0}, entries=[{**entry, "options": {"linear_backend": "stream"}}], devices=1,
                     history=History(tried_options=frozenset((o, repr(v)) for o, vs, _ in sweeps()["tau"] for v in vs)),
                     known=KNOWN | {"linear_backend"})
    assert alone.memory_entry_id == "e-amx" and "not predictable" in alone.rationale
    (d,) = _plan({"tau": 2.0}, entries=[{**entry, "same_machine": True}])  # found on this kind: first
    assert d.memory_entry_id == "e-amx"


def test_an_llm_coder_gets_an_open_direction_for_the_largest_factor():
    (d,) = _plan({"tau": 1.1, "overhead": 4.0}, facts=GPU, coder="anthropic")
    assert d.provider == "anthropic" and d.factor == "overhead" and "overhead" in d.title


def test_nothing_left_means_no_directions():
    tried = frozenset((o, repr(v)) for o, vs, _ in sweeps()["tau"] for v in vs)
    assert _plan({"tau": 2.0}, history=History(tried_options=tried)) == []


def test_values_the_cost_model_predicts_to_lose_are_not_timed_and_the_best_predicted_go_first():
    guesses = {("block_size", 2): 0.95, ("block_size", 6): 0.8, ("block_size", 8): 1.2, ("verify", "tree"): 0.85,
               ("tree_nodes", 8): 0.92, ("tree_nodes", 32): 0.5}
    ds = _plan({"tau": 2.0}, devices=10, predict=lambda o, v, base: guesses.get((o, v)))
    options = {d.hints["option"]: d for d in ds}
    assert "verify" not in options  # predicted to lose more than 10%
    # 6 screened out; 2 is an alternative the model ranks clearly below 8: planned again if 8 loses
    assert options["block_size"].hints["values"] == [8]
    assert options["block_size"].hints["predicted_gain"] == {"8": 1.2}
    assert "predicted_gain" not in options["ngram_min_match"].hints  # the model cannot say: timed
    # the prediction sees what the option needs (tree_nodes means a tree)
    seen = []
    _plan({"tau": 2.0}, devices=10, predict=lambda o, v, base: seen.append((o, base.get("verify"))))
    assert ("tree_nodes", "tree") in seen and ("block_size", None) in seen
    # directions ordered by their best predicted value; unknowns count as a share of their factor
    # (the drafter waits for a later wave: the n-gram setting before it needs drafter = ngram)
    assert [d.hints["option"] for d in ds] == ["block_size", "ngram_min_match", "tree_nodes"]


def test_predictions_and_factor_priors_are_ranked_together_across_factors():
    known = KNOWN | {"linear_backend"}
    # CPU: a drafter predicted at +22% goes before the kernel option (1.88 ** 0.25 = 1.17)
    guesses = {("drafter", "parallel"): 1.22, ("drafter", "eagle"): 0.93}
    ds = _plan({"tau": 1.01, "kernel": 1.88, "overhead": 1.3}, devices=10, known=known,
               predict=lambda o, v, base: guesses.get((o, v)))
    assert [d.hints["option"] for d in ds][:2] == ["drafter", "linear_backend"]
    assert ds[0].hints["values"] == ["parallel"]  # eagle, predicted 0.93, waits for parallel's verdict
    guesses[("drafter", "eagle")] = 1.19  # too close to tell apart: both timed, best predicted first
    (d,) = _plan({"tau": 1.01}, known=known, predict=lambda o, v, base: guesses.get((o, v)))
    assert d.hints["values"] == ["parallel", "eagle"]
    # GPU: graphs (6 ** 0.25 = 1.57) before a tree predicted at +20%
    ds = _plan({"tau": 1.2, "kernel": 1.5, "overhead": 6.0}, facts=GPU, devices=10,
               predict=lambda o, v, base: 1.2 if o == "verify" else None)
    assert [d.hints["option"] for d in ds][:2] == ["cuda_graphs", "compile"]


def test_budget_estimates_from_earlier_timings():
    # 6 trials x 2 runs x 3 requests in 120 s: 3.33 s per request-run
    est = planner.budget_estimates([planner.TimingSample(wall_s=120.0, trials=6, requests=3)], 4, 3)
    candidate_s, sealed_s = est
    assert candidate_s == pytest.approx(120.0 * planner.CANDIDATE_OVERHEAD)
    assert sealed_s == pytest.approx(120.0 / 36 * 4 * (3 * 3 + 2))
    assert planner.budget_estimates([], 4, 3) is None
    assert planner.budget_estimates([planner.TimingSample(0.0, 6, 3)], 4, 3) is None  # old events: no wall time


def test_fit_to_budget_cuts_sweeps_to_what_fits():
    sweep = planner.Direction(title="sweep block_size over [2, 6, 8]", factor="tau", provider="sweep",
                              hints={"option": "block_size", "values": [2, 6, 8]})
    llm = planner.Direction(title="tau: ...", factor="tau", provider="anthropic")
    assert planner.fit_to_budget([sweep], remaining_s=1000, candidate_s=100) == [sweep]
    (cut,) = planner.fit_to_budget([sweep], remaining_s=250, candidate_s=100)
    assert cut.hints["values"] == [2, 6] and cut.title == "sweep block_size over [2, 6]"
    assert planner.fit_to_budget([sweep, llm], remaining_s=99, candidate_s=100) == []
    assert planner.fit_to_budget([llm], remaining_s=150, candidate_s=100) == [llm]
    # one controller times the wave's candidates one after another: directions share the slots, first first
    cut = planner.fit_to_budget([sweep, llm], remaining_s=350, candidate_s=100)
    assert [d.hints.get("values") for d in cut] == [[2, 6, 8]]
    cut = planner.fit_to_budget([llm, sweep], remaining_s=350, candidate_s=100)
    assert cut[0] == llm and cut[1].hints["values"] == [2, 6]
    # before any timing (a budgeted round's first wave): one candidate a timing device
    (first,) = planner.fit_slots([sweep, llm], 1)
    assert first.hints["values"] == [2] and first.title == "sweep block_size over [2]"
    assert planner.fit_slots([llm, sweep], 2) == [llm, dataclasses.replace(sweep, title="sweep block_size over [2]",
                                                                           hints={**sweep.hints, "values": [2]})]


def test_directions_of_one_wave_do_not_undo_each_other():
    # the drafter paired with 2 drafts: a block-size sweep and an n-gram setting (which needs the n-gram
    # drafter) would undo it when timed on top; the kernel option is independent
    known = KNOWN | {"linear_backend"}
    ds = _plan({"tau": 1.64, "kernel": 1.2}, devices=4, known=known,
               predict=lambda o, v, base: _chain_model(o, v, base) or (1.03 if o in ("block_size", "ngram_min_match") else None))
    planned = [d.hints["option"] for d in ds]
    assert planned[0] == "drafter" and "linear_backend" in planned
    assert "block_size" not in planned and "ngram_min_match" not in planned
    # a requirement another direction sets to the same value is no clash (fused_gemv on fused_kernels)
    assert "tree_nodes" in planned and "verify" in planned


def test_a_sweep_does_not_repeat_what_a_memory_entry_of_the_wave_sets():
    entry = {"entry_id": "e1", "title": "parallel", "delta": "", "options": {"drafter": "parallel", "block_size": 2},
             "same_machine": True}
    ds = _plan({"tau": 1.64, "kernel": 1.2}, entries=[entry], devices=9, known=KNOWN | {"linear_backend"},
               predict=_chain_model)
    assert ds[0].provider == "memory"
    swept = [d.hints.get("option") for d in ds[1:]]
    assert "linear_backend" in swept
    assert not {"drafter", "block_size", "ngram_min_match"} & set(swept)  # the last needs drafter = ngram


def test_directions_per_wave():
    assert planner.directions_per_wave(0, "cpu", 1) == 2  # one is timed while the other's patches are written
    assert planner.directions_per_wave(0, "cuda", 4) == 4 and planner.directions_per_wave(0, "cuda", 0) == 1
    assert planner.directions_per_wave(3, "cpu", 1) == 3


def test_entries_taught_by_this_deployments_promotions_are_not_applied_again():
    entries = [{"entry_id": "entry-own", "evidence": ["patch-1", "timing-1", "verdict-1", "advanced-1"], "same_machine": True},
               {"entry_id": "entry-other", "evidence": ["patch-9", "advanced-9"], "same_machine": True}]
    applied = planner.entries_in_lineage(entries, {"advanced-1", "advanced-2"})
    assert applied == {"entry-own"}
    dirs = planner.plan(factors={"tau": 1.2}, facts={"device_kind": "cpu"}, best_options={}, known_options=set(),
                        entries=entries, history=planner.History(applied_entries=frozenset(applied)))
    assert [d.memory_entry_id for d in dirs] == ["entry-other"]


def test_values_the_cost_model_cannot_rank_go_one_a_wave():
    """With a profile (``predict``) that cannot judge an option, a sweep times only its first value a
    wave; the next value comes in a later wave, once the first is tried (a candidate costs a timing)."""
    known = KNOWN | {"linear_backend"}
    (d,) = _plan({"kernel": 3.0}, known=known, predict=lambda option, value, base: None)
    assert d.hints["option"] == "linear_backend" and d.hints["values"] == ["stream"]
    tried = History(tried_options=frozenset({("linear_backend", repr("stream"))}))
    (d,) = _plan({"kernel": 3.0}, known=known, predict=lambda option, value, base: None, history=tried,
                 best={"linear_backend": "stream"})
    assert d.hints["values"] == ["onednn_all"]
    # without a profile at all (no predict) a sweep still proposes every fresh value
    (d,) = _plan({"kernel": 3.0}, known=known)
    assert d.hints["values"] == ["stream", "onednn_all", "onednn"]
    # predicted values keep the whole ranked list
    ds = _plan({"tau": 2.0}, devices=10, predict=lambda option, value, base: 1.2 if option == "block_size" else None)
    assert next(d for d in ds if d.hints["option"] == "block_size").hints["values"] == [2, 6, 8]


def test_a_new_option_is_offered_from_its_field_alone():
    """A throwaway option declared only in a test-only subclass: the planner offers it, on the devices
    its OptionInfo names, with what it requires in its base, and the CLI and dict parsing know it."""
    from dataclasses import dataclass

    from specpilot.engine.options import options_from_dict, requirements

    @dataclass(frozen=True)
    class WithTurbo(EngineOptions):
        turbo: int = option(0, "a test-only knob", sweep=(2, 3), factor="kernel", devices=("cpu",),
                            requires={"verify": "tree"}, minimum=0)

    dirs = planner.plan(factors={"kernel": 4.0}, facts=CPU, best_options={}, known_options={"turbo"}, entries=[],
                        history=History(), devices=5, options=WithTurbo)
    (turbo,) = [d for d in dirs if d.hints.get("option") == "turbo"]
    assert turbo.factor == "kernel" and turbo.hints == {"option": "turbo", "values": [2, 3], "base": {"verify": "tree"},
                                                        "requires": {"verify": "tree"}}
    assert not [d for d in planner.plan(factors={"kernel": 4.0}, facts=GPU, best_options={}, known_options={"turbo"},
                                        entries=[], history=History(), devices=5, options=WithTurbo)
                if d.hints.get("option") == "turbo"]  # its OptionInfo says CPU only
    assert requirements(WithTurbo)["turbo"] == {"verify": "tree"} and "turbo" not in requirements()
    assert options_from_dict({"turbo": "3"}, WithTurbo()).turbo == 3
    with pytest.raises(ValueError, match="turbo"):
        options_from_dict({"turbo": -1}, WithTurbo())
    assert "turbo" not in {d.hints.get("option") for d in _plan({"kernel": 4.0}, devices=10)}  # stock has none


def _chain_model(o, v, base):
    """Session 20's profile (SmolLM2 fp32 on 2 cores, docs/FIGURES.md, "Joint drafter and block-size
    prediction"), by hand: the current n-gram chain of 4 gives 1.13x over AR; a full chain of n drafts
    costs c(2) = 1.06, c(4) = 1.62 AR steps; the parallel drafter's chain commits 1.76 tokens at 2
    drafts and 1.97 at 4. Predicted: tau / c(n) over the current."""
    cost, tau = {2: 1.06, 4: 1.62, 6: 1.87, 8: 2.11}, {2: 1.76, 4: 1.97, 6: 1.97, 8: 2.06}
    if o != "drafter" or v != "parallel" or base.get("verify") == "tree":
        return None
    n = base.get("block_size", 4)
    return tau[n] / cost[n] / 1.13


def test_a_drafter_is_predicted_with_its_best_block_size_and_offered_as_the_pair():
    (d,) = _plan({"tau": 1.64, "kernel": 1.2}, predict=_chain_model)
    # alone (at the best's 4 drafts): 1.97 / 1.62 / 1.13 = 1.08; paired with 2 drafts: 1.47
    assert d.hints["option"] == "drafter" and d.hints["values"] == ["parallel"]
    assert d.hints["joint"] == {"'parallel'": {"block_size": 2}}
    assert d.hints["predicted_gain"] == {"'parallel'": pytest.approx(1.76 / 1.06 / 1.13, abs=1e-3)}
    assert "block_size=2" in d.title
    # the sweep coder turns it into one candidate holding both settings
    from specpilot.services.subagent.offline import sweep
    (proposal,) = sweep(d.hints)
    assert proposal.options == {"drafter": "parallel", "block_size": 2}
    # a pair is only offered when it beats the value alone by the margin; the best's own length is kept
    (d,) = _plan({"tau": 1.64}, best={"block_size": 2}, predict=_chain_model)
    assert "joint" not in d.hints and d.hints["base"] == {"block_size": 2}


def test_batching_mechanisms_are_offered_to_batched_deployments_only():
    batch_options = {"batch_node_budget", "batch_adaptive_block", "prefill_chunk"}
    known = KNOWN | batch_options
    batch1 = _plan({"tau": 2.0, "overhead": 1.5}, devices=20, known=known)
    assert not {d.hints["option"] for d in batch1} & batch_options
    batched = _plan({"tau": 2.0, "overhead": 1.5}, facts={**CPU, "mode": "batched"}, devices=20, known=known)
    offered = {d.hints["option"]: d for d in batched}
    assert batch_options <= set(offered)
    assert offered["batch_node_budget"].factor == "tau" and offered["prefill_chunk"].factor == "overhead"
    # made for this mode, they come first
    assert [d.hints["option"] for d in batched[:3]] == ["batch_node_budget", "batch_adaptive_block", "prefill_chunk"]
    # with the batched overhead factor (its per-row part, `costmodel.batched_overhead`) the largest, one
    # attention call over every row is in the first wave (two directions on a CPU), before the tau mechanisms
    known = known | {"batch_attention"}
    batched = _plan({"tau": 1.23, "kernel": 1.26, "overhead": 1.9}, facts={**CPU, "mode": "batched"}, devices=20,
                    known=known)
    assert [(d.hints["option"], d.hints["values"]) for d in batched[:2]] == [("prefill_chunk", [64, 128]),
                                                                            ("batch_attention", ["padded"])]


def test_a_value_the_deployment_has_as_stock_is_never_proposed():
    known = KNOWN | {"linear_backend"}
    stock = {"linear_backend": "stream", "block_size": 6}
    ds = _plan({"tau": 2.0, "kernel": 2.0}, devices=20, known=known, predict=None)
    assert any(d.hints["option"] == "linear_backend" and "stream" in d.hints["values"] for d in ds)
    ds = planner.plan(factors={"tau": 2.0, "kernel": 2.0}, facts=CPU, best_options={}, known_options=known, entries=[],
                      history=History(), devices=20, stock_options=stock)
    values = {d.hints["option"]: d.hints["values"] for d in ds}
    assert "stream" not in values.get("linear_backend", []) and 6 not in values.get("block_size", [])
    ds = planner.plan(factors={"tau": 2.0}, facts=CPU, best_options={"block_size": 2}, known_options=known,
                      entries=[], history=History(), devices=20, stock_options=stock)
    assert 6 in {v for d in ds for v in d.hints.get("values", []) if d.hints.get("option") == "block_size"}


def test_a_sweep_that_failed_before_any_patch_in_an_earlier_round_is_planned_again():
    """Session 28: a round whose every direction failed on a stale stock (no patch made) left a later round
    on the same ledger nothing to try. Failed directions of earlier rounds no longer count as tried; in the
    round itself they do (a failure that repeats must not fill the waves); a swept value that was timed does."""
    from specpilot import schema

    def planned(round_id, i, option, values):
        return schema.DirectionPlanned(round_id=round_id, direction_id=f"{round_id}-d{i}", title="", provider="sweep",
                                       hints={"option": option, "values": values})

    events = [planned("r1", 0, "batch_attention", ["padded"]),
              schema.DirectionFailed(round_id="r1", direction_id="r1-d0", reason="WorkspaceError"),
              planned("r1", 1, "block_size", [2, 6]),
              schema.PatchProposed(round_id="r1", direction_id="r1-d1", patch_id="p", diff=""),
              schema.DirectionFailed(round_id="r1", direction_id="r1-d1", reason="the second value failed"),
              planned("r2", 0, "prefill_chunk", [64]),
              schema.DirectionFailed(round_id="r2", direction_id="r2-d0", reason="WorkspaceError"),
              schema.DirectionPlanned(round_id="r1", direction_id="r1-d2", title="", provider="memory",
                                      memory_entry_id="entry-1")]
    h = planner.history_from(events, round_id="r2")
    assert h.tried_options == {("block_size", "2"), ("block_size", "6"), ("prefill_chunk", "64")}
    assert h.applied_entries == {"entry-1"}
    assert ("batch_attention", "'padded'") in planner.history_from(events, round_id="r1").tried_options
