"""Calibration: identical layers timed once, FLOPs exact and linear in the micro-batch, costs cached
per micro-batch size, meta models materialized layer by layer."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from gpipe_repro.sim import calibration as cal
from gpipe_repro.sim.calibration import DEVICES, Workload, calibrate, robust_seconds, trace_shapes
from gpipe_repro.sim.calibration import run as cal_run

TINY_LM = Workload.create("tiny LM", "transformer-lm", "tokens", (8,), 50, L=5, d_model=16,
                          d_ff=32, num_heads=2, vocab_size=50)
TINY_AMOEBA = Workload.create("tiny AmoebaNet", "amoebanet-d", "image", (3, 16, 16), 5, L=12, F=8,
                              num_classes=5, image_size=16, aux_head=False)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPIPE_REPRO_CACHE", str(tmp_path))
    return tmp_path


def test_identical_layers_form_one_group() -> None:
    layers = TINY_LM.build("meta")
    inputs, outputs, groups = trace_shapes(layers, TINY_LM.sample(3)[0])
    assert len(layers) == 7                       # embed, 5 layers, head
    assert groups == [0, 1, 1, 1, 1, 1, 2]
    assert all(t.device.type == "meta" for t in outputs)
    assert tuple(outputs[3].shape) == (3, 8, 16)
    # AmoebaNet (4 normal cells per stack): the last two cells of each stack read inputs of the
    # stack's shape and share a group; the first two after a reduction differ from them.
    _, _, amoeba_groups = trace_shapes(TINY_AMOEBA.build("meta"), TINY_AMOEBA.sample(2)[0])
    assert len(amoeba_groups) == 18 and len(set(amoeba_groups)) == 15


def test_a_48_layer_model_costs_one_layers_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[int] = []
    real = cal.time_layer_actions

    def counting(layer: nn.Module, x: object, device: object, **kw: object) -> tuple[float, ...]:
        timed.append(kw["index"])  # type: ignore[arg-type]
        return real(layer, x, device, repeats=1, warmup=0, **{k: v for k, v in kw.items()
                                                              if k not in ("repeats",)})

    monkeypatch.setattr(cal_run, "time_layer_actions", counting)
    deep = Workload.create("deep", "transformer-lm", "tokens", (4,), 20, L=48, d_model=8, d_ff=16,
                           num_heads=2, vocab_size=20)
    calib = calibrate(deep, [2], repeats=1, in_sequence=False)
    assert timed == [0, 1, 49]                    # embed, one transformer layer, head
    costs = calib.at(2)
    assert len(costs) == 50 and all(c == costs[1] for c in costs[1:49])
    assert all(c.forward > 0 and c.backward > 0 for c in costs[1:])


def test_in_sequence_times_every_layer_where_it_sits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole model timed in stage order: every layer timed where it sits, identical layers given
    their pooled median (steady, and the partitioner's ties break the same way every run), the
    FLOP counts still per group; the automatic choice takes it where the model fits in memory and
    falls back to one layer per group where it does not."""
    calls: list[int] = []
    real = cal.time_model_actions

    def counting(layers: list[nn.Module], x: object, device: object, **kw: object) -> list[tuple[float, ...]]:
        calls.append(len(layers))
        out = real(layers, x, device, **{**kw, "repeats": 1, "warmup": 0})
        assert len(out) == len(layers) and all(len(row) == 8 for row in out)
        assert out[0][6] is None and all(row[6] is not None and min(row) >= 0 for row in out[1:])
        return [(1e-3 * (1 + i),) * 8 for i in range(len(out))]      # tell the layers apart

    monkeypatch.setattr(cal_run, "time_model_actions", counting)
    calib = calibrate(TINY_LM, [2], repeats=1)                       # fits: in sequence
    assert calls == [7]
    costs = calib.at(2)
    # layers 1-5 form one group: their pooled median (4 ms) for each, the first and last their own
    assert [c.forward for c in costs] == pytest.approx([1e-3] + [4e-3] * 5 + [7e-3])
    assert costs[2].accumulate == pytest.approx(4e-3) == costs[2].backward
    assert costs[2].flops == costs[1].flops and calib.groups[1] == calib.groups[2]
    monkeypatch.setattr(cal_run, "fits_in_sequence", lambda *a: False)
    calibrate(TINY_LM, [3], repeats=1)                               # too big: one per group
    assert calls == [7]


def test_flops_are_exact_and_linear_in_the_microbatch_size() -> None:
    lin = Workload.create("lm", "transformer-lm", "tokens", (8,), 50, L=2, d_model=16, d_ff=32,
                          num_heads=2, vocab_size=50)
    c = calibrate(lin, [2, 6], method="flops", device_model=DEVICES["nominal"])
    small, big = c.at(2), c.at(6)
    for a, b in zip(small, big):
        assert b.flops == pytest.approx(3 * a.flops, rel=0.02)   # attention is quadratic in T, not N
        assert b.output_bytes == 3 * a.output_bytes
    head = small[-1]
    tokens = 2 * 8
    assert head.forward_flops == 2 * tokens * 16 * 50             # the vocabulary projection
    assert head.forward == pytest.approx(head.forward_flops / DEVICES["nominal"].flop_rate)
    assert c.device == "flops: nominal"


def test_calibrations_are_cached_per_size(monkeypatch: pytest.MonkeyPatch,
                                          private_cache: Path) -> None:
    first = calibrate(TINY_LM, [2], repeats=1)
    assert len(list((private_cache / "calibration").glob("*.json"))) == 1

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached size was measured again")

    monkeypatch.setattr(cal_run, "_calibrate_size", fail)
    again = calibrate(TINY_LM, [2], repeats=1)
    assert again.at(2) == first.at(2) and again.groups == first.groups
    with pytest.raises(AssertionError, match="measured again"):
        calibrate(TINY_LM, [3], repeats=1)


def test_time_calibration_times_every_action_of_the_schedule() -> None:
    c = calibrate(TINY_AMOEBA, [2], repeats=2)
    costs = c.at(2)
    assert len(costs) == len(c.groups)
    for layer in costs:
        assert min(layer.forward, layer.forward_nograd, layer.recompute, layer.backward) > 0
        assert layer.optimizer >= 0 and layer.output_bytes > 0
    assert costs[-1].output_bytes == 2 * 5 * 4           # logits
    assert c.optimizer_call > 0
    assert c.device.startswith("cpu:") and "1 thread" in c.device
    parts = c.partition_costs(2, "always")
    assert parts[3] == pytest.approx(costs[3].forward_nograd + costs[3].recompute + costs[3].backward
                                     + costs[3].accumulate)
    assert c.partition_costs(2, "never")[3] == pytest.approx(costs[3].forward + costs[3].backward
                                                             + costs[3].accumulate)
    assert all(layer.accumulate >= 0 for layer in costs)
    relu = cal.time_layer_actions(nn.ReLU(), torch.ones(2, 4), "cpu", repeats=2)
    assert len(relu) == 8 and relu[5] == 0.0      # no parameters: nothing to accumulate into
    # the zero-bubble split as the stage executor runs it, except where the input takes no gradient
    assert costs[0].backward_input is None and costs[0].backward_weight is None
    assert all(c.backward_input is not None and c.backward_weight is not None for c in costs[1:])


def test_materialize_gives_real_finite_layers_from_meta() -> None:
    with torch.device("meta"):
        layer = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    real = cal.materialize(layer, "cpu")
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in real.parameters())
    assert torch.equal(real[1].running_var, torch.ones(4))
    assert real(torch.randn(3, 4)).shape == (3, 4)


def test_robust_seconds_is_a_trimmed_mean() -> None:
    assert robust_seconds([1.0, 1.2, 0.8, 1.0, 9.0]) == pytest.approx((1.0 + 1.0 + 1.2) / 3)
    assert robust_seconds([1.0] * 8 + [0.1, 50.0]) == pytest.approx(1.0)
    assert robust_seconds([1.0, 3.0]) == pytest.approx(2.0)      # too few to trim


def test_unknown_method_and_missing_gpu_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="method"):
        calibrate(TINY_LM, [2], method="guess")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cpu"):
            calibrate(TINY_LM, [2], device="cuda")


def test_rounds_keep_the_median_round_and_key_the_cache(monkeypatch: pytest.MonkeyPatch,
                                                        private_cache: Path) -> None:
    """A burst of load during one round of one layer does not reach the calibration."""
    rounds = iter(range(1000))

    def fake(layer: nn.Module, x: object, device: object, **kw: object) -> tuple[float, ...]:
        n = next(rounds)
        slow = 50.0 if n == 4 else 1.0           # round 2 of layer 1 (of 3 timed) hit a burst
        return (slow * 1e-3, 1e-3, 1e-3, 2e-3, 1e-4, 0.0, 1e-3, 1e-3)

    monkeypatch.setattr(cal_run, "time_layer_actions", fake)
    c = calibrate(TINY_LM, [2], repeats=1, rounds=3, in_sequence=False)
    assert all(cost.forward == pytest.approx(1e-3) for cost in c.at(2))
    names = {p.name for p in (private_cache / "calibration").glob("*.json")}
    calibrate(TINY_LM, [2], repeats=1, rounds=1, in_sequence=False)
    assert len({p.name for p in (private_cache / "calibration").glob("*.json")} - names) == 1
    with pytest.raises(ValueError, match="rounds"):
        calibrate(TINY_LM, [2], rounds=0)


def test_one_pass_flop_counts_equal_a_forward_and_a_forward_backward_counted_apart() -> None:
    """The calibration reads the forward and the total FLOPs off one counter; they equal a no-grad
    forward counted alone and a forward + backward counted alone, layer by layer: a language model,
    an AmoebaNet (BatchNorm, tuple boundaries, pass-through inputs) and a translation model (a
    tuple input)."""
    from gpipe_repro.engine.layer_costs import layer_flop_counts, layer_flops
    from gpipe_repro.models.translation import translation_transformer

    amoeba = Workload.create("AmoebaNet", "amoebanet-d", "image", (3, 16, 16), 5, L=3, F=4,
                             num_classes=5, image_size=16, aux_head=True)
    with torch.device("meta"):
        translation = list(translation_transformer(1, 32, 2, d_model=16, head_dim=8, vocab_size=40))
    cases = [(TINY_LM.build("meta"), TINY_LM.sample(3)[0]), (amoeba.build("meta"), amoeba.sample(3)[0]),
             (translation, (torch.randint(1, 40, (3, 7)), torch.randint(1, 40, (3, 5))))]
    for layers, sample in cases:
        ins, _, _ = trace_shapes(layers, sample)
        counts = [layer_flop_counts(layer, x) for layer, x in zip(layers, ins)]
        assert counts == [(cal.forward_flops(layer, x), layer_flops(layer, x))
                          for layer, x in zip(layers, ins)]
        assert all(total >= forward for forward, total in counts) and any(f > 0 for f, _ in counts)


def test_flops_counted_by_one_calibration_are_reused_by_the_next_of_the_same_layers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A FLOP calibration after a time calibration of the same workload and size traces and counts
    nothing again and gives the counts a fresh one gives; use_cache=False traces and counts afresh."""
    counted: list[int] = []
    traced: list[int] = []
    real_count, real_trace = cal_run.layer_flop_counts, cal_run.trace_signatures

    def counting(layer: nn.Module, x: object) -> tuple[int, int]:
        counted.append(1)
        return real_count(layer, x)

    def tracing(layers: list[nn.Module], sample: object) -> object:
        traced.append(1)
        return real_trace(layers, sample)

    monkeypatch.setattr(cal_run, "_FLOP_COUNTS", {})
    monkeypatch.setattr(cal_run, "_TRACES", {})
    monkeypatch.setattr(cal_run, "layer_flop_counts", counting)
    monkeypatch.setattr(cal_run, "trace_signatures", tracing)
    timed = calibrate(TINY_LM, [2], repeats=1, use_cache=False)
    assert len(counted) == 3 and len(traced) == 1      # embed, one transformer layer, head
    reused = calibrate(TINY_LM, [2], method="flops")
    assert len(counted) == 3 and len(traced) == 1
    fresh = calibrate(TINY_LM, [2], method="flops", use_cache=False)
    assert len(counted) == 6 and len(traced) == 2
    assert reused.groups == fresh.groups == timed.groups
    for a, b, c in zip(timed.at(2), reused.at(2), fresh.at(2)):
        assert (a.forward_flops, a.flops) == (b.forward_flops, b.flops) == (c.forward_flops, c.flops)
        assert b == c


def test_rounds_go_on_while_the_costs_are_uncertain_and_record_their_uncertainty(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady timings stop at the least rounds; timings that vary round to round get more rounds,
    up to max_rounds, and the calibration records how uncertain its costs stayed."""
    import itertools

    def timer(spread: float) -> object:
        wobble = itertools.cycle([1.0, 1.0 + spread, 1.0 - spread, 1.0 + spread / 2])
        calls: list[int] = []

        def fake(layer: nn.Module, x: object, device: object, **kw: object) -> tuple[float, ...]:
            calls.append(1)
            w = next(wobble)
            return (w * 1e-3, w * 1e-3, w * 1e-3, w * 2e-3, 1e-4, 0.0, 1e-3, 1e-3)
        fake.calls = calls  # type: ignore[attr-defined]
        return fake

    steady, noisy = timer(0.0), timer(0.2)
    monkeypatch.setattr(cal_run, "time_layer_actions", steady)
    c = calibrate(TINY_LM, [2], repeats=1, rounds=3, max_rounds=9, in_sequence=False, use_cache=False)
    assert len(steady.calls) == 3 * 3 and c.uncertainty_at(2) == 0.0       # 3 timed layers x 3
    monkeypatch.setattr(cal_run, "time_layer_actions", noisy)
    c = calibrate(TINY_LM, [2], repeats=1, rounds=3, max_rounds=9, in_sequence=False, use_cache=False)
    assert len(noisy.calls) == 3 * 9 and c.uncertainty_at(2) > cal_run.UNCERTAINTY_TARGET
    assert cal.Calibration.from_json(c.to_json()).uncertainty == c.uncertainty
    with pytest.raises(ValueError, match="max_rounds"):
        calibrate(TINY_LM, [2], rounds=3, max_rounds=2)


def test_sizes_are_timed_in_interleaved_rounds_so_a_drift_moves_them_alike(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Several micro-batch sizes: the first rounds of every size in order, the rest in reverse
    order (A A B B B B A A), as the measurement kernel alternates what it compares. On a host that slows
    down steadily over the calibration, sizes timed one after the other (A A A B B B) made the
    later size's costs look dearer by the drift; interleaved, the ratio of the two sizes' costs
    (what a normalized cell of the table is) stays near its true value."""
    clock = {"round": 0}
    order: list[int] = []

    def drifting(layers: list[nn.Module], inputs: torch.Tensor, device: torch.device, *, loss: object,
                 repeats: int) -> list[tuple[float, ...]]:
        clock["round"] += 1
        order.append(int(inputs.shape[0]))
        slow = 1.0 + 0.05 * clock["round"]              # 5% slower every round
        return [(1e-3 * inputs.shape[0] * slow,) * 6 + (None, None) for _ in layers]

    monkeypatch.setattr(cal_run, "time_model_actions", drifting)
    c = calibrate(TINY_LM, [2, 4], repeats=1, rounds=4, use_cache=False, in_sequence=True)
    assert order == [2, 2, 4, 4, 4, 4, 2, 2]            # 2 rounds each in order, then reversed
    ratio = c.at(4)[1].forward / c.at(2)[1].forward      # truly 2.0
    assert abs(ratio / 2.0 - 1) < 0.05
    clock["round"] = 0
    order.clear()
    one = [calibrate(TINY_LM, [size], repeats=1, rounds=4, use_cache=False, in_sequence=True)
           for size in (2, 4)]                           # one after the other: the drift shows
    assert one[1].at(4)[1].forward / one[0].at(2)[1].forward / 2.0 - 1 > 0.15
