"""A model family with its training batch, as the planner needs it (shapes only).

The command line names models as ``gpipe-repro models`` does (family + builder options); memory also
depends on what a training step feeds them: token ids of ``seq_len`` for the language models, images
of ``image_size`` for AmoebaNet, with the paper's batch sizes by default. The result is the project's
one workload type, :class:`gpipe_repro.models.workload.Workload`, with its ``batch`` set; its
:meth:`~gpipe_repro.models.workload.Workload.planner_inputs` builds the model on the meta device, so
even Transformer-1663 (84B parameters) costs seconds and no memory.
"""
from __future__ import annotations

from typing import Any

from gpipe_repro.models import check_option, get_family
from gpipe_repro.models.workload import Workload
from gpipe_repro.paper import TABLE1_AMOEBANET, TABLE1_TRANSFORMER

SUPPORTED = ("transformer-lm", "amoebanet-d", "amoebanet-b", "gpt2")


def workload(family: str, batch: int | None = None, **options: Any) -> Workload:
    """`family` with builder `options` and its batch (see the module docstring).

    Extra options: ``seq_len`` (language models, default 1024) and ``image_size`` (AmoebaNet,
    default 224)."""
    if family not in SUPPORTED:
        raise ValueError(f"the memory planner's command line supports {', '.join(SUPPORTED)}, not "
                         f"{family!r}; for other models use gpipe_repro.memory.MemoryPlanner in Python "
                         "with the model's layers, a sample batch and the loss")
    options = dict(options)
    n: int
    if family in ("transformer-lm", "gpt2"):
        default_len = TABLE1_TRANSFORMER["seq_len"] if family == "transformer-lm" else 1024
        seq_len = options.pop("seq_len", default_len)
        check_option(family, "seq_len", seq_len, default_len)
        n = batch or (TABLE1_TRANSFORMER["batch"] if family == "transformer-lm" else 8)
        shown = {**options, "seq_len": seq_len}
        kind, shape = "tokens", (seq_len,)  # type: tuple[str, tuple[int, ...]]
        classes = int(options.get("vocab_size") or get_family(family).options().get("vocab_size") or 2)
    else:
        size = options.get("image_size", TABLE1_AMOEBANET["image_size"])
        check_option(family, "image_size", size, TABLE1_AMOEBANET["image_size"])
        options["image_size"] = size
        n = batch or TABLE1_AMOEBANET["batch"]
        shown = dict(options)
        kind, shape = "image", (int(options.get("in_channels", 3)), size, size)
        classes = int(options.get("num_classes") or get_family(family).options().get("num_classes") or 2)
    name = f"{family}({', '.join(f'{k}={v}' for k, v in shown.items())})"
    return Workload.create(name, family, kind, shape, classes, batch=n, **options)


__all__ = ["workload", "SUPPORTED"]
