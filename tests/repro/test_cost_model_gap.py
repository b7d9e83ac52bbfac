"""The cost-model diagnostic's pieces that need no timing: the unseen models build and run, and a
timeline is summed per (stage, action kind)."""
from __future__ import annotations

import torch

from experiments import unseen_models
from experiments.cost_model_gap import MODELS, per_action, render
from gpipe_repro.engine.timeline import Event, Timeline


def test_the_unseen_models_map_their_inputs_to_class_scores() -> None:
    shapes = {"residual_mlp": (768,), "conv_pyramid": (3, 32, 32), "transformer_blocks": (32, 256)}
    for name, shape in shapes.items():
        model = getattr(unseen_models, name)()
        assert model(torch.randn(2, *shape)).shape == (2, 10)
    assert {MODELS[k][0].split(":")[1] for k in ("alt-residual", "pyramid", "transformer")} == set(shapes)


def test_per_action_sums_durations_by_stage_and_kind() -> None:
    t = Timeline(2, [Event(0, "forward", 0, 0.0, 1.0), Event(0, "forward", 1, 1.0, 3.0),
                     Event(1, "backward", 0, 0.0, 0.5)], {})
    assert per_action(t) == {(0, "forward"): 3.0, (1, "backward"): 0.5}


def test_render_names_every_row() -> None:
    result = {"model": "m", "K": 2, "M": 4, "microbatch": 16, "checkpoint": "never", "balance": [1, 1],
              "simulated_step_s": 0.01, "measured_step_s": 0.011, "error": 0.1,
              "rows": [{"stage": 0, "kind": "forward", "simulated_s": 0.001, "measured_s": 0.002,
                        "ratio": 2.0},
                       {"stage": 0, "kind": "agree", "simulated_s": 0.0, "measured_s": 0.001,
                        "ratio": None}]}
    text = render(result)
    assert "forward" in text and "2.00" in text and "agree" in text
