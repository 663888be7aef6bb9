"""The controller's checks and designs: whole answers (max_new_tokens or a stop token), sealed trial order,
warm-up requests."""

from specpilot.services.controller.checks import incomplete
from specpilot.services.controller.evaluate import Evaluator

EOS = 256  # the tiny model's stop token


def test_an_early_stop_on_the_targets_stop_token_is_a_whole_answer(tmp_path):
    ev = Evaluator(tmp_path, "tiny-cpu", max_new_tokens=8)
    reference = [[1, 2, 3, 4, 5, 6, 7, 8]]  # ran to max_new_tokens: no reference shows a stop token
    assert incomplete([[1, 2, 9, EOS]], reference, ev.stop_ids(), 8) == ""


def test_a_truncated_answer_is_incomplete(tmp_path):
    ev = Evaluator(tmp_path, "tiny-cpu", max_new_tokens=8)
    reference = [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert "output 0 is incomplete: 3 tokens" in incomplete([[1, 2, 9]], reference, ev.stop_ids(), 8)
    assert incomplete([[1, 2, 3, 4, 5, 6, 7, 8]], reference, ev.stop_ids(), 8) == ""


def test_sealed_trials_run_every_pair_of_systems_in_both_orders():
    from itertools import combinations

    from specpilot.services.controller.phases import sealed_order

    names = ["ar", "stock", "final"]
    for first in range(0, 6, 2):
        two = [sealed_order(names, first), sealed_order(names, first + 1)]
        for a, b in combinations(names, 2):
            assert sorted(o.index(a) < o.index(b) for o in two) == [False, True]


def test_a_gpu_worker_answers_every_request_untimed_first_a_cpu_worker_one_short_one():
    """CUDA graphs are captured on first use per step shape and context bucket: timed, those
    captures were ~15% trial-to-trial noise on the H200, so on a GPU the warm-up is a full pass of
    requests of the timed lengths, but of other content (a memoising candidate gains nothing)."""
    from specpilot.services.controller.workers import WARMUP_TOKENS, warm_up_requests

    prompts = [[1, 2], [3, 4, 5], [6]]
    warm = warm_up_requests(prompts, 64, "cuda:1")
    assert warm == [([5, 4], 64), ([6, 6, 6], 64), ([2], 64)]
    assert [len(p) for p, _ in warm] == [len(p) for p in prompts]
    assert not {tuple(p) for p, _ in warm} & {tuple(p) for p in prompts}
    assert warm_up_requests(prompts, 64, "cpu") == [([5, 4], WARMUP_TOKENS)]
