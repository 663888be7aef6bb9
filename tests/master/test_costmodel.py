"""The cost model on hand-computed examples: floors, replayed tree tau, ceiling and factors."""

import dataclasses

import pytest

from specpilot.services.master import costmodel as cm

HW = cm.Hardware(bandwidth_bytes_s=1e9, flops_s=1e12)


def test_floor_is_the_slower_of_compute_and_bytes():
    # 0.9 GB at 0.9 * 1 GB/s = 1 s of bytes; 0.6 TFLOP at 0.6 * 1 TFLOP/s = 1 s of compute.
    assert cm.Work(flops=0.6e12, bytes=0.45e9).floor_s(HW) == pytest.approx(1.0)
    assert cm.Work(flops=0.3e12, bytes=0.9e9).floor_s(HW) == pytest.approx(1.0)
    assert cm.Work(flops=0.0, bytes=0.0).floor_s(HW) == 0.0


def test_step_work_counts_weights_once_and_flops_per_token():
    shape = cm.Shape(vocab_size=10, dim=4, n_layers=2, n_heads=2, n_kv_heads=1, intermediate=8)
    one = cm.step_work(shape, n_tokens=1, context=0, weight_bytes=2, act_bytes=0)
    three = cm.step_work(shape, n_tokens=3, context=0, weight_bytes=2, act_bytes=0)
    assert shape.kv_dim == 2
    assert one["q_proj"] == cm.Work(flops=2 * 4 * 4 * 2, bytes=4 * 4 * 2 * 2)
    assert one["k_proj"].bytes == 4 * 2 * 2 * 2
    assert one["gate_proj"].bytes == 4 * 8 * 2 * 2
    assert one["lm_head"] == cm.Work(flops=2 * 4 * 10, bytes=4 * 10 * 2)
    assert three["up_proj"].bytes == one["up_proj"].bytes  # weights are read once per forward
    assert three["up_proj"].flops == 3 * one["up_proj"].flops


def test_replay_tau_by_hand():
    # 9 output tokens; the first comes from the prefill. At every position the drafter's candidates
    # match the truth 3 deep.
    depths = [0] + [3] * 8
    tau = cm.replay_tau(depths, budgets=(1, 2, 4))
    # 8 tokens after the prefill. Budget 1: 2 per step -> 4 steps. Budget 2: 3 per step (3, 3, 2).
    # Budget 4: the match is only 3 deep, so 4 per step -> steps of 4 and 4.
    assert tau[1] == pytest.approx(8 / 4)
    assert tau[2] == pytest.approx(8 / 3)
    assert tau[4] == pytest.approx(8 / 2)


def test_replay_follows_the_positions_each_budget_visits():
    # Deep matches only at even positions: budget 1 lands on them (1 -> 3 -> 5), budget 0 on all.
    depths = [0, 1, 0, 1, 0, 1, 0]
    tau = cm.replay_tau(depths, budgets=(0, 1))
    assert tau[0] == 1.0
    assert tau[1] == pytest.approx(6 / 3)  # steps at 1, 3, 5 commit 2 each


def test_replay_without_a_useful_drafter_is_ar():
    assert cm.replay_tau([0, 0, 0, 0], budgets=(1, 8)) == {1: 1.0, 8: 1.0}
    assert cm.replay_tau([], budgets=(4,)) == {4: 1.0}


def test_ceiling_and_factors_by_hand():
    shape = cm.Shape(vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, intermediate=128)
    work1 = cm.floors_s(cm.step_work(shape, 2, 10, 4, 4), HW)
    floor_2 = sum(work1.values())
    kernel_s = 4 * floor_2  # the current step's kernels run at 4x their floors...
    step_s = 2 * kernel_s  # ...and the host doubles it
    c = cm.ceiling(shape=shape, hw=HW, weight_bytes=4, act_bytes=4, context=10, t_ar_s=step_s,
                   step_s=step_s, tau=1.5, n_tokens=2, profile_s={"q_proj": kernel_s, "drafter": 1.0},
                   replay={1: 1.8})
    assert c.factors["kernel"] == pytest.approx(4.0)
    assert c.factors["overhead"] == pytest.approx(2.0)
    assert c.factors["tau"] == pytest.approx(1.8 / 1.5)
    assert c.largest_factor == "kernel"
    assert c.budget == 1 and c.tau_best == 1.8
    assert c.speedup == pytest.approx(1.8 * step_s / floor_2)
    assert c.current_speedup == pytest.approx(1.5)
    # the product of the factors is the gap to the ceiling (same token count here)
    assert c.factors["tau"] * c.factors["kernel"] * c.factors["overhead"] == pytest.approx(c.speedup / c.current_speedup)


def test_kernel_time_is_measured_less_launches_within_floor_and_measured():
    assert cm.kernel_time_s(10.0, 1.0, 8.0) == pytest.approx(2.0)
    assert cm.kernel_time_s(10.0, 1.0, 20.0) == 1.0  # never below the floor
    assert cm.kernel_time_s(10.0, 1.0, 0.0) == 10.0  # launches not measured: all of it is kernel
    assert cm.kernel_time_s(0.5, 1.0, 0.0) == 0.5  # faster than the floor stays as measured


def test_fused_classes_floor_is_the_sum_of_their_parts():
    floors = {"q_proj": 1.0, "k_proj": 0.25, "v_proj": 0.25, "gate_proj": 2.0, "up_proj": 2.0, "o_proj": 1.0}
    assert cm.class_floor_s(floors, "qkv_proj") == 1.5
    assert cm.class_floor_s(floors, "gate_up_proj") == 4.0
    assert cm.class_floor_s(floors, "o_proj") == 1.0
    assert cm.class_floor_s(floors, "unknown") == 0.0
    assert {"qkv_proj", "gate_up_proj"} <= set(cm.KERNEL_CLASSES)


def test_launch_bound_classes_count_as_overhead():
    shape = cm.Shape(vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, intermediate=128)
    floors = cm.floors_s(cm.step_work(shape, 1, 10, 2, 2), HW)
    # An eager GPU step: each class takes 50x its floor, almost all of it waiting for 40 launches.
    launch_s = floors["q_proj"]
    profile = {k: 50 * f for k, f in floors.items()}
    launches = {k: 49 * f / launch_s for k, f in floors.items()}
    step_s = 1.2 * sum(profile.values())
    args = dict(shape=shape, hw=HW, weight_bytes=2, act_bytes=2, context=10, t_ar_s=step_s, step_s=step_s,
                tau=1.0, n_tokens=1, profile_s=profile, replay={1: 1.0})
    blind = cm.ceiling(**args)
    seen = cm.ceiling(**args, launches=launches, launch_s=launch_s)
    assert blind.largest_factor == "kernel" and blind.factors["kernel"] == pytest.approx(50.0)
    assert seen.largest_factor == "overhead"
    assert seen.factors["kernel"] == pytest.approx(1.0)
    assert seen.factors["overhead"] == pytest.approx(60.0)
    product = lambda c: c.factors["kernel"] * c.factors["overhead"]  # noqa: E731
    assert product(seen) == pytest.approx(product(blind))  # the same gap, attributed differently


def test_a_step_of_many_small_kernels_is_floored_by_their_latency():
    """A graphed GPU step of a small model: 240 kernels at 2 us each outweigh the bytes it reads, so the
    ceiling divides by the latency floor (a bigger tree costs no more: it picks the largest budget whose
    replay pays), and a step already near that floor has no *kernel* factor left; with no kernel floor
    (CPU) the byte floors stand."""
    shape = cm.Shape(vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, intermediate=128)
    hw = cm.Hardware(bandwidth_bytes_s=1e12, flops_s=1e14)
    bytes_floor = sum(cm.floors_s(cm.step_work(shape, 5, 10, 2, 2), hw).values())
    launches = {"q_proj": 40.0, "attention": 100.0, "norms": 100.0, "drafter": 999.0}  # 240 of the step's classes
    latency = 240 * 2e-6
    assert latency > 10 * bytes_floor
    step_s = 1.25 * latency
    args = dict(shape=shape, hw=hw, weight_bytes=2, act_bytes=2, context=10, t_ar_s=step_s, step_s=step_s, tau=1.0,
                n_tokens=1, profile_s={"q_proj": 1.1 * latency}, replay={1: 1.5, 4: 2.0})
    c = cm.ceiling(**args, launches=launches, kernel_floor_s=2e-6)
    assert c.latency_floor_s == pytest.approx(latency)
    assert c.budget == 4 and c.speedup == pytest.approx(2.0 * step_s / latency)
    assert c.factors["kernel"] == pytest.approx(1.1)
    cpu = cm.ceiling(**args, launches=launches)
    assert cpu.latency_floor_s == 0.0 and cpu.speedup > 10 * c.speedup and cpu.factors["kernel"] > 10


def test_ceiling_picks_the_best_budget_and_refuses_nonsense():
    shape = cm.Shape(vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, intermediate=128)
    kw = dict(shape=shape, hw=HW, weight_bytes=4, act_bytes=4, context=10, t_ar_s=1e-3, step_s=1e-3, tau=1.0,
              n_tokens=1, profile_s={"q_proj": 1e-4})
    c = cm.ceiling(**kw, replay={1: 1.0, 4: 3.0})
    assert c.budget == 4
    with pytest.raises(ValueError):
        cm.ceiling(**{**kw, "tau": 0.0}, replay={1: 1.0})


def test_predicted_gain_by_hand():
    # AR 10 ms; the current chain of 4 drafts costs 14 ms per step (slope 0.1 per draft) and commits 2.
    model = cm.StepModel(t_ar_s=0.010, step_s=0.014, n_tokens=5, tau=2.0, replay={1: 1.5, 2: 1.8, 4: 2.0, 16: 2.6})
    stock = {"drafter": "ngram", "block_size": 4, "verify": "chain", "tree_nodes": 16}
    assert model.slope == pytest.approx(0.1)
    assert model.current == pytest.approx(2.0 / 1.4)
    # two drafts: 1.8 / 1.2 = 1.5 against 2.0 / 1.4
    assert cm.predicted_gain(model, "block_size", 2, {}, stock) == pytest.approx(1.5 / (2.0 / 1.4))
    # a 16-node tree: 2.6 / 2.6 = 1.0, a loss
    assert cm.predicted_gain(model, "verify", "tree", {}, stock) == pytest.approx(1.0 / (2.0 / 1.4))
    # 6 drafts use the replay at the largest budget not above 6 (4)
    assert cm.predicted_gain(model, "block_size", 6, {}, stock) == pytest.approx((2.0 / 1.6) / (2.0 / 1.4))
    assert cm.predicted_gain(model, "drafter", "parallel", {}, stock) is None  # not replayed
    assert cm.predicted_gain(model, "cuda_graphs", True, {}, stock) is None


def test_another_drafter_is_predicted_from_its_replay_and_draft_time():
    # Same step as above; an "eagle" chain matches deeper (3.0 at 4 drafts) but drafting takes 2 ms.
    model = cm.StepModel(t_ar_s=0.010, step_s=0.014, n_tokens=5, tau=2.0, replay={1: 1.5, 4: 2.0},
                         drafters={"eagle": ({1: 1.8, 2: 2.4, 4: 3.0}, 0.002)})
    stock = {"drafter": "ngram", "block_size": 4, "verify": "chain", "tree_nodes": 16}
    # 3.0 tokens per (10 ms x 1.4 + 2 ms) against 2.0 per 14 ms
    assert cm.predicted_gain(model, "drafter", "eagle", {}, stock) == pytest.approx((3.0 / 1.6) / (2.0 / 1.4))
    # with 2 drafts (the candidate's other settings): 2.4 / (1.2 + 0.2)
    assert cm.predicted_gain(model, "drafter", "eagle", {"block_size": 2}, stock) == pytest.approx(
        (2.4 / 1.4) / (2.0 / 1.4))
    # trees of another drafter are predicted only from a tree replay, and drafters never replayed not at all
    assert cm.predicted_gain(model, "drafter", "eagle", {"verify": "tree"}, stock) is None
    assert cm.predicted_gain(model, "drafter", "parallel", {}, stock) is None
    # with its tree replay: 16 nodes commit 3.6 a step, the step costed as a chain of 16 (slope 0.1 an
    # extra token from the profile: c(16) = 2.6) and the proposal as the chain's
    trees = dataclasses.replace(model, drafter_trees={"eagle": {1: 1.8, 4: 3.1, 16: 3.6}})
    assert cm.predicted_gain(trees, "drafter", "eagle", {"verify": "tree", "tree_nodes": 16}, stock) == pytest.approx(
        (3.6 / (1.0 + 0.1 * 16 + 0.2)) / (2.0 / 1.4))
    # once eagle is the best (profiled), block sizes are predicted from its own replay
    assert cm.predicted_gain(model, "block_size", 2, {"drafter": "eagle"}, stock) is not None


def test_a_drafter_setting_is_predicted_from_its_own_replay():
    # the n-gram drafter replayed with min_match 1 matches deeper at 4 drafts (2.2 against 1.9)
    model = cm.StepModel(t_ar_s=0.010, step_s=0.014, n_tokens=5, tau=2.0, replay={2: 1.8, 4: 2.0},
                         chain_replay={2: 1.5, 4: 1.9},
                         drafters={"ngram_min_match=1": ({2: 1.6, 4: 2.2}, 0.0003)})
    stock = {"drafter": "ngram", "block_size": 4, "verify": "chain", "tree_nodes": 16, "ngram_min_match": 2}
    assert cm.predicted_gain(model, "ngram_min_match", 1, {}, stock) == pytest.approx(2.2 / 1.9)
    assert cm.predicted_gain(model, "ngram_min_match", 1, {"block_size": 2}, stock) == pytest.approx(1.6 / 1.5)
    assert cm.predicted_gain(model, "ngram_min_match", 3, {}, stock) is None  # not replayed
    assert cm.predicted_gain(model, "ngram_min_match", 1, {"verify": "tree"}, stock) is None


def test_chains_are_predicted_from_the_first_candidate():
    model = cm.StepModel(t_ar_s=0.010, step_s=0.014, n_tokens=5, tau=2.0, replay={2: 1.8, 4: 2.0},
                         chain_replay={2: 1.5, 4: 1.9})
    stock = {"drafter": "ngram", "block_size": 4, "verify": "chain", "tree_nodes": 16}
    assert cm.predicted_gain(model, "block_size", 2, {}, stock) == pytest.approx((1.5 / 1.2) / (2.0 / 1.4))
    assert cm.predicted_gain(model, "tree_nodes", 4, {"verify": "tree"}, stock) == pytest.approx((2.0 / 1.4) / (2.0 / 1.4))


def test_a_full_chain_drafter_pays_for_the_tokens_the_profiled_steps_really_verified():
    # The n-gram's 14 ms step (AR 10 ms) verified 2 tokens on average, not its nominal 5: each
    # verified draft token costs 0.4 AR steps, and a drafter proposing 4 every step pays 1 + 1.6.
    model = cm.StepModel(t_ar_s=0.010, step_s=0.014, n_tokens=5, tau=2.0, replay={1: 1.5, 4: 2.0},
                         drafters={"parallel": ({4: 3.0}, 0.001)}, verified_tokens=2.0)
    stock = {"drafter": "ngram", "block_size": 4, "verify": "chain", "tree_nodes": 16}
    assert model.slope == pytest.approx(0.1) and model.token_cost == pytest.approx(0.4)
    assert cm.predicted_gain(model, "drafter", "parallel", {}, stock) == pytest.approx(
        (3.0 / (1.0 + 1.6 + 0.1)) / (2.0 / 1.4))
    # the n-gram's own settings keep the nominal slope (they will not fill every step either)
    assert cm.predicted_gain(model, "block_size", 1, {}, stock) == pytest.approx((1.5 / 1.1) / (2.0 / 1.4))
    # unmeasured: the nominal tokens; nearly nothing verified: at least a quarter of the drafts
    assert cm.StepModel(t_ar_s=0.010, step_s=0.014, n_tokens=5, tau=2.0, replay={}).token_cost == pytest.approx(0.1)
    assert cm.StepModel(t_ar_s=0.010, step_s=0.014, n_tokens=5, tau=2.0, replay={},
                        verified_tokens=1.01).token_cost == pytest.approx(0.4)


def test_a_measured_full_chain_cost_replaces_the_extrapolated_one():
    # Round 11's case: the n-gram's steps imply 0.4 AR steps a draft (c(4) = 2.6), but full chains
    # were timed at c(2) = 1.2 and c(4) = 1.4: the parallel drafter is predicted with the latter.
    measured = {2: 1.2, 4: 1.4, 8: 2.0}
    model = cm.StepModel(t_ar_s=0.010, step_s=0.014, n_tokens=5, tau=2.0, replay={1: 1.5, 4: 2.0},
                         drafters={"parallel": ({4: 3.0}, 0.001)}, verified_tokens=2.0, chain_cost=measured)
    stock = {"drafter": "ngram", "block_size": 4, "verify": "chain", "tree_nodes": 16}
    assert cm.predicted_gain(model, "drafter", "parallel", {}, stock) == pytest.approx(
        (3.0 / (1.4 + 0.1)) / (2.0 / 1.4))
    # between and past the measured lengths: linear from c(0) = 1, then the last slope onward
    assert [model.full_chain_cost(n) for n in (1, 3, 6, 12)] == pytest.approx([1.1, 1.3, 1.7, 2.6])
    assert cm.StepModel(t_ar_s=0.010, step_s=0.014, n_tokens=5, tau=2.0, replay={}, verified_tokens=2.0,
                        ).full_chain_cost(4) == pytest.approx(2.6)


def test_the_tau_ceiling_takes_the_best_replay_of_any_drafter():
    # own n-gram: shallow matches; the parallel drafter's chain matches 3 deep almost everywhere
    own_tree = cm.pooled_replay([[0, 1, 0, 1, 0, 1, 0, 1, 0]])
    parallel_chain = cm.pooled_replay([[0, 3, 3, 3, 3, 3, 3, 3, 3]])
    best, by = cm.envelope({"ngram tree": own_tree, "parallel chain": parallel_chain})
    assert by[1] in ("ngram tree", "parallel chain") and best[1] == max(own_tree[1], parallel_chain[1])
    assert by[4] == "parallel chain" and best[4] == parallel_chain[4] > own_tree[4]
    shape = cm.Shape(vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, intermediate=128)
    kw = dict(shape=shape, hw=HW, weight_bytes=4, act_bytes=4, context=10, t_ar_s=1e-3, step_s=1.2e-3,
              tau=own_tree[4], n_tokens=5, profile_s={"q_proj": 1e-4})
    assert cm.ceiling(**kw, replay=own_tree).factors["tau"] == pytest.approx(max(own_tree.values()) / own_tree[4])
    assert cm.ceiling(**kw, replay=best).factors["tau"] > 1.5  # the parallel drafter's room shows in the factor


def test_candidates_are_predicted_against_the_profiled_system_whatever_their_step_shape():
    # Profiled: the n-gram chain of 4 (14 ms against AR 10 ms, 2.0 tokens a step: 1.43x over AR).
    # Full chains measured at c(2) = 1.1, c(4) = 1.6.
    model = cm.StepModel(t_ar_s=0.010, step_s=0.014, n_tokens=5, tau=2.0, replay={2: 1.8, 4: 2.0},
                         chain_replay={2: 1.5, 4: 1.9}, chain_cost={2: 1.1, 4: 1.6}, profiled={"block_size": 4},
                         drafters={"parallel": ({2: 2.2, 4: 2.6}, 0.001), "ngram_min_match=1": ({2: 1.6, 4: 2.2}, 0.0)})
    stock = {"drafter": "ngram", "block_size": 4, "verify": "chain", "tree_nodes": 16, "ngram_min_match": 2}
    current = 2.0 / 1.4
    # the parallel drafter paired with 2 drafts: its chain at 2 over c(2) and its draft time
    assert cm.predicted_gain(model, "drafter", "parallel", {"block_size": 2}, stock) == pytest.approx(
        2.2 / (1.1 + 0.1) / current)
    # a drafter setting at the profiled shape: the ratio of the two replays (as before) ...
    assert cm.predicted_gain(model, "ngram_min_match", 1, {"block_size": 4}, stock) == pytest.approx(2.2 / 1.9)
    # ... paired with another shape: its chain like a drafter's, against the profiled system
    assert cm.predicted_gain(model, "ngram_min_match", 1, {"block_size": 2}, stock) == pytest.approx(1.6 / 1.1 / current)


def test_the_lm_heads_floor_is_what_a_lossless_argmax_reads():
    """On an fp32 CPU deployment the certified argmax head reads a bf16 copy: the ceiling's LM-head floor
    is bf16's there (else a measured win of `screened_head` would read as a measurement fault)."""
    assert cm.head_bytes_per_weight("cpu (2 threads)", 4.0) == 2.0
    assert cm.head_bytes_per_weight("cuda:0 NVIDIA H200", 2.0) == 2.0
    assert cm.head_bytes_per_weight("cuda:0 NVIDIA H200", 4.0) == 4.0
    shape = cm.Shape(vocab_size=65536, dim=512, n_layers=2, n_heads=8, n_kv_heads=2, intermediate=1024)
    full = cm.step_work(shape, 1, 64, 4.0)
    screened = cm.step_work(shape, 1, 64, 4.0, head_bytes=2.0)
    assert screened["lm_head"].bytes < 0.51 * full["lm_head"].bytes and screened["q_proj"] == full["q_proj"]


def test_a_batched_step_reads_weights_once_and_attention_per_row():
    shape = cm.Shape(vocab_size=10, dim=4, n_layers=2, n_heads=2, n_kv_heads=1, intermediate=8)
    one = cm.step_work(shape, n_tokens=3, context=5, weight_bytes=2, act_bytes=1)
    four = cm.step_work(shape, n_tokens=3, context=5, weight_bytes=2, act_bytes=1, rows=4)
    packed = cm.step_work(shape, n_tokens=12, context=5, weight_bytes=2, act_bytes=1)
    assert four["up_proj"] == packed["up_proj"]  # linears: 12 tokens either way, weights once
    assert four["attention"].flops == 4 * one["attention"].flops  # each row attends to its own 5 + 3
    assert four["attention"].flops < packed["attention"].flops  # not to the 12 packed tokens' growing prefix
    assert four["attention"].bytes == 4 * one["attention"].bytes  # each row reads its own KV


def test_the_batched_ceiling_prefers_shorter_drafts_when_rows_make_them_costly():
    shape = cm.Shape(vocab_size=1000, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate=256)
    # 67 FLOPs a byte at the floors: one row's steps stay memory-bound, 16 rows of 9 tokens are compute-bound
    hw = cm.Hardware(bandwidth_bytes_s=1e10, flops_s=1e12)
    replay = {1: 1.9, 2: 2.6, 4: 3.3, 8: 3.9}
    one = cm.batched_ceiling(shape=shape, hw=hw, weight_bytes=4, act_bytes=4, context=100, rows=1,
                             t_ar_rows_s=1e-3, replay=replay)
    many = cm.batched_ceiling(shape=shape, hw=hw, weight_bytes=4, act_bytes=4, context=100, rows=16,
                              t_ar_rows_s=4e-3, replay=replay, measured_c={1: 1.7, 2: 2.2, 4: 3.3})
    assert one.budget == 8 and many.budget == 4
    assert many.measured_budget == 2 and many.measured_speedup == pytest.approx(2.6 / 2.2)
    assert many.by_budget[4]["measured"] == pytest.approx(1.0) and "measured" not in many.by_budget[8]
    with pytest.raises(ValueError):
        cm.batched_ceiling(shape=shape, hw=hw, weight_bytes=4, act_bytes=4, context=1, rows=0, t_ar_rows_s=1.0,
                           replay=replay)


def test_the_batched_overhead_counts_the_per_row_part_of_a_step():
    # the 17:07 round's phase 0 (session 27): a one-row overhead below 1 (a profiling artefact) hid the
    # per-row attention calls that made 8 rows of one token 1.9x one row of 8 tokens
    assert cm.batched_overhead(0.56, 50.4e-3, 26.5e-3) == pytest.approx(50.4 / 26.5)
    assert cm.batched_overhead(1.5, 50.4e-3, 26.5e-3) == pytest.approx(1.5 * 50.4 / 26.5)
    assert cm.batched_overhead(1.5, 20e-3, 25e-3) == 1.5  # rows cheaper than one row's tokens: no per-row part
    assert cm.batched_overhead(0.56, 50.4e-3, 0.0) == 0.56  # not measured (older events): the one-row factor


def test_a_profile_brings_other_drafters_trees_to_the_envelope_and_the_predictions():
    """The worker's per-request replies, pooled by the controller, reach the master's replays (the
    envelope) and step model (predictions) with each other drafter's tree beside its chain."""
    from specpilot import schema
    from specpilot.services.controller.phases import _alternative_drafters
    from specpilot.services.master.main import replays, step_model

    replies = [{"drafters": {"parallel": {"chain_depths": [0, 2, 2, 0, 1], "depths": [0, 3, 3, 1, 1], "draft_s": 0.001},
                             "eagle": {"chain_depths": [0, 1, 0, 0, 0], "draft_s": 0.004}}}] * 2
    pooled = _alternative_drafters(replies)
    assert pooled["parallel"]["depths"] == [[0, 3, 3, 1, 1]] * 2 and "depths" not in pooled["eagle"]
    prof = schema.ProfileMeasured(deployment="d", device="cuda", t_ar_s=0.001, step_s=0.0012, n_tokens=5, tau=1.5,
                                  replay_depths=[[0, 1, 1, 0, 0]] * 2, chain_depths=[[0, 1, 0, 0, 0]] * 2,
                                  drafters=pooled, options={"drafter": "ngram"})
    tables = replays(prof)
    assert {"ngram tree", "ngram chain", "parallel chain", "parallel tree", "eagle chain"} == set(tables)
    assert tables["parallel tree"][4] > tables["parallel chain"][4]
    model = step_model(prof)
    assert model.drafter_trees == {"parallel": tables["parallel tree"]}
