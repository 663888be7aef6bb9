"""The controller's state is a fold of the ledger's events: rebuilt the same from the log, nothing else."""

from specpilot import schema
from specpilot.services.controller.state import RESTORED_FROM, Best, State, evolve, fold, noise_key


def test_the_state_is_folded_from_events():
    env = {"deployment": "tiny-cpu"}
    events = [
        schema.DeploymentRegistered(**env, source="controller", stock_commit="s0"),
        schema.DeploymentRegistered(deployment="forged", source="master", stock_commit="x"),  # not the controller's
        schema.TimingMeasured(**env, kind="noise", device="cpu", noise=0.004, incumbent_s=[1.0] * 8,
                              candidate_s=[1.0] * 8),
        schema.TimingMeasured(**env, kind="candidate", device="cpu", noise=0.9),  # a candidate's timing: not noise
        schema.CeilingComputed(**env, ceiling_speedup=3.5),
        schema.BestAdvanced(**env, commit="c1", options={"verify": "tree"}),
        schema.BestAdvanced(**env, commit="c2", options={"verify": "tree", "block_size": 6}),
        schema.PatchProposed(**env, direction_id="d", patch_id="p", diff="", options={}),  # ignored
    ]
    state = fold(events)
    assert state.registered == {"tiny-cpu": "s0"}
    assert state.noise == {noise_key("tiny-cpu", "cpu"): 0.004}
    assert state.noise_trials == {noise_key("tiny-cpu", "cpu"): 8}  # what a look's pooled SD is scaled by
    assert state.ceiling == {"tiny-cpu": 3.5}
    assert state.best == {"tiny-cpu": Best("c2", {"verify": "tree", "block_size": 6})}
    assert state.best_options("tiny-cpu") == {"verify": "tree", "block_size": 6} and state.best_options("x") == {}
    assert evolve(State(), events[0]).registered == {"tiny-cpu": "s0"}
    # the options of the system a patch was written on: a former best's, stock's, or (unknown) the best's
    assert state.base_options("tiny-cpu", "c1") == {"verify": "tree"}
    assert state.base_options("tiny-cpu", "") == {} and state.base_options("tiny-cpu", "s0") == {}
    assert state.base_options("tiny-cpu", "never-seen") == {"verify": "tree", "block_size": 6}
    assert {type(e) for e in events if type(e) is not schema.PatchProposed} <= set(RESTORED_FROM)


def test_a_run_without_a_bus_restores_from_its_own_log(tmp_path):
    """`specpilot time`: no bus, so the controller's events go to its local log and come back from it."""
    import asyncio

    from specpilot.services.controller.main import Controller

    cause = schema.PatchProposed(deployment="tiny-cpu", direction_id="d", patch_id="p", diff="", options={},
                                 source="subagent")
    first = Controller(tmp_path, None)
    stamped = asyncio.run(first.emit(schema.TimingMeasured(kind="noise", device="cpu", noise=0.01), cause))
    assert stamped.source == "controller" and stamped.causation_id == cause.event_id
    assert first.state.noise == {noise_key("tiny-cpu", "cpu"): 0.01}  # folded as it was emitted
    again = Controller(tmp_path, None)
    assert again.state.noise == {}
    asyncio.run(again.restore())
    assert again.state.noise == first.state.noise
