"""When a promotion changes the target model itself, the controller re-profiles the new best before its
verdict (`services.controller.main.changes_model` decides): the round's cost model would otherwise plan
the next wave from the old system's step costs."""

from services.controller.main import changes_model


def test_model_options_and_dtype_change_the_model():
    assert changes_model("tiny-cpu", {}, {"linear_backend": "onednn_all"})
    assert changes_model("tiny-cpu", {"linear_backend": "onednn"}, {"linear_backend": "onednn_all"})
    assert changes_model("tiny-cpu", {}, {"dtype": "bf16"})
    assert changes_model("tiny-cpu", {"drafter": "parallel"}, {"drafter": "parallel", "weight_format": "w12"})


def test_decoding_options_and_restated_stock_do_not():
    assert not changes_model("tiny-cpu", {}, {"drafter": "parallel", "block_size": 8, "verify": "tree"})
    assert not changes_model("tiny-cpu", {"linear_backend": "onednn_all"},
                             {"linear_backend": "onednn_all", "ngram_min_match": 1})
    assert not changes_model("tiny-cpu", {}, {"dtype": "fp32", "linear_backend": "default"})  # stock, said aloud
