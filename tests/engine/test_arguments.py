"""GPipe's argument checks (gpipe_repro/engine/arguments.py), called directly: no model is built."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gpipe_repro.engine.arguments import (
    as_layers,
    batch_key,
    check_arguments,
    declared_reduction,
)

GOOD: dict[str, Any] = dict(num_layers=4, partitions=2, micro_batches=4, checkpoint="except_last",
                            loss_fn=None, loss_reduction=None, clip_grad_norm=None, precision="fp32",
                            schedule="gpipe", runtime="local", objective="bottleneck", replicas=1,
                            batchnorm_stats="per_replica", bucket_cap_mb=25.0, devices=None)


def test_a_good_configuration_passes() -> None:
    check_arguments(**GOOD)


@pytest.mark.parametrize("change,message", [
    ({"partitions": 0}, "partitions must be an integer >= 1"),
    ({"partitions": 5}, r"partitions=5 is larger than the number of layers \(4\)"),
    ({"micro_batches": 1.5}, "micro_batches must be an integer >= 1"),
    ({"checkpoint": "sometimes"}, "checkpoint must be one of"),
    ({"loss_reduction": "none"}, "loss_reduction must be 'mean' or 'sum'"),
    ({"loss_fn": nn.MSELoss(reduction="sum"), "loss_reduction": "mean"}, "leave loss_reduction out"),
    ({"loss_fn": nn.MSELoss(reduction="none")}, "needs a scalar loss per micro-batch"),
    ({"clip_grad_norm": 0}, "clip_grad_norm must be a number > 0"),
    ({"precision": "fp8"}, "precision must be one of"),
    ({"schedule": "zigzag"}, "schedule must be one of"),
    ({"schedule": "interleaved", "partitions": 4, "micro_batches": 3},
     r"schedule='interleaved' with partitions=4 and micro_batches=3: .*M=3 is not a multiple of 2"),
    ({"schedule": "dualpipe-v", "partitions": 4, "micro_batches": 3},
     r"schedule='dualpipe-v' .*M >= 2K.*use micro_batches=4 or more"),
    ({"runtime": "mpi"}, "runtime must be one of"),
    ({"objective": "fastest"}, "objective must be one of"),
    ({"replicas": 0}, "replicas must be an integer >= 1"),
    ({"replicas": 2}, "replicas=2 needs runtime='distributed'"),
    ({"batchnorm_stats": "global"}, "batchnorm_stats must be one of"),
    ({"bucket_cap_mb": -1}, "bucket_cap_mb must be a number > 0"),
    ({"devices": ["cpu"]}, "1 devices given for partitions=2"),
])
def test_each_bad_argument_is_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_arguments(**{**GOOD, **change})


def test_the_first_bad_argument_in_signature_order_is_reported() -> None:
    with pytest.raises(ValueError, match="micro_batches"):
        check_arguments(**{**GOOD, "micro_batches": 0, "precision": "fp8", "devices": []})


def test_declared_reduction_reads_the_loss() -> None:
    assert declared_reduction(nn.CrossEntropyLoss()) == "mean"
    assert declared_reduction(nn.KLDivLoss(reduction="batchmean")) == "mean"
    assert declared_reduction(nn.MSELoss(reduction="sum")) == "sum"
    assert declared_reduction(lambda out, tgt: out.sum()) is None


def test_as_layers_refuses_what_is_not_a_sequence_of_modules() -> None:
    lin = nn.Linear(2, 2)
    assert as_layers(nn.Sequential(lin, nn.ReLU()))[0] is lin
    with pytest.raises(TypeError, match="nn.Sequential or a list"):
        as_layers(lin)   # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no layers"):
        as_layers([])
    with pytest.raises(TypeError, match="layer 1 is a int"):
        as_layers([lin, 3])   # type: ignore[list-item]
    assert as_layers([lin, lin]) == [lin, lin]    # one module at two places: engine.tied separates them


def test_batch_key_compares_shapes_and_dtypes_not_data() -> None:
    x = torch.zeros(4, 3)
    assert batch_key((x, 1), None) == batch_key((torch.ones(4, 3), 1), None)
    assert batch_key(x, None) != batch_key(x.double(), None)
    assert batch_key(x, None) != batch_key(torch.zeros(5, 3), None)
    assert batch_key((x, 1), None) != batch_key((x, 2), None)


def _my_backend(graph: Any, inputs: Any) -> Any:
    return graph


def test_the_same_compile_backend_on_every_rank_was_refused_as_different() -> None:
    """The ranks compared compile= by its repr, which holds a function's address: the same backend
    function on every rank was refused as different. It is described by module and name, a dict by
    its sorted items, other objects without addresses."""
    from gpipe_repro.engine.arguments import same_everywhere
    described = same_everywhere({"backend": _my_backend, "options": {"b": 1, "a": object()}})
    assert described == [("backend", f"{__name__}._my_backend"),
                         ("options", [("a", "object: <object object>"), ("b", 1)])]
    assert "0x" not in str(described)
