"""The pipeline schedule as data: each stage's ordered list of actions.

This is the only place that decides *what runs when*. The local runtime, the distributed runtime, the
simulator, the memory planner and the Gantt charts all consume a :class:`Schedule`; none of them has
its own idea of the order. GPipe with K=3 stages and M=4 micro-batches, drawn with unit-time compute
and instant links (``print(gpipe_schedule(3, 4, "never").render())``)::

    stage 0 |F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 U |
    stage 1 |.  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .  U |
    stage 2 |.  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  U |

Fill (the forward wave), drain (the backward wave in reverse micro-batch order), then one synchronous
update per stage, after an AGREE barrier (below). The dots are the bubble, (K-1)/(M+K-1) of the time
when cells are balanced.

With re-materialization a checkpointed micro-batch has a RECOMPUTE right before its BACKWARD. With
``recompute_ahead`` the RECOMPUTE is placed *before* the stage waits for that micro-batch's gradient,
so the recomputation overlaps the wait (the paper's reason its bubble is smaller than theory).

A schedule also has a text form, one line per stage, that round-trips (``Schedule.from_text(s.to_text())
== s``), in the spirit of PyTorch pipelining's ``_Action.from_str`` / ``_dump_csv``::

    schedule gpipe stages=2 micro_batches=2 training=1
    stage 0: F0 sa0 F1 sa1 rg1 B1 rg0 B0 A U
    stage 1: ra0 F0 ra1 F1 B1 sg1 B0 sg0 A U

Tokens are an action's short name and its micro-batch (F forward, R recompute, B backward, A agree,
U optimizer step, sa/ra send/receive activation, sg/rg send/receive gradient, and for the zero-bubble
split of B: I input gradient, W weight gradient).

Schedules: ``gpipe`` (fill-drain), ``1f1b`` (PipeDream-flush) and ``zb-h1`` (zero bubble, Qi et al.,
ICLR 2024: B split into I, which the previous stage waits for, and W, which fills the bubble)::

    stage 0 |F0 F1 F2 F3 .  .  .  I0 W0 I1 F4 I2 W1 I3 F5 W2 F6 I4 W3 F7 W4 I5 W5 I6 W6 .  .  I7 W7 U  |
    stage 3 |.  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 W1 F4 I4 W2 W3 F5 I5 F6 I6 W4 W5 F7 I7 W6 W7 .  .  U  |

(K=4, M=8, stages 0 and 3 of ``make_schedule("zb-h1", 4, 8, "never").render()``.) ``interleaved``
(Narayanan et al., SC'21) cuts the model into K*v cells, v per process round robin: its stages are the
cells and :attr:`Schedule.processes` holds each process's program (text lines ``process r: F0@2 ...``,
each token naming its stage); the interpreter and the local runtime run the programs as they are.
``zb-v`` (Qi et al., section 6) puts the zero-bubble split on 2K chunks placed in a V, process p
holding chunks p and 2K-1-p; ``dualpipe-v`` is DualPipeV (DeepSeek-V3's DualPipe folded into that
V) in PyTorch's order, each forward/backward pair PyTorch overlaps written as two consecutive
actions, for M >= 2K.

tests/golden/ holds generated schedules in this form, and a :class:`ScheduleError` prints the schedule
with the failing action marked.

Every training schedule has, on every stage, one AGREE right before its OPTIMIZER_STEP: the point
where all stages' gradients are final and the stages agree (one small all-reduce in the distributed
runtime) on the step's loss, its global gradient norm and whether any gradient overflowed. It is a
barrier: no stage passes its AGREE before every stage has reached its own, so no cell updates before
every action of every stage has succeeded (all-or-nothing steps), and global clipping and the fp16
overflow check read the agreed numbers.

The package, one responsibility per module: :mod:`.actions` (action kinds, actions, ScheduleError),
:mod:`.core` (the Schedule), :mod:`.validate`, :mod:`.text` (text form and picture),
:mod:`.generators` (gpipe, 1f1b, zb-h1), :mod:`.interleaved`, :mod:`.zero_bubble_v`,
:mod:`.dualpipe_v`, :mod:`.partial_split` (a zero-bubble schedule splitting only its last
micro-batches' backwards), :mod:`.registry` (by name). Every
public name is importable from ``gpipe_repro.engine.schedule``.
"""
from __future__ import annotations

from gpipe_repro.engine.schedule.actions import (
    BACKWARDS,
    BARRIERS,
    CHECKPOINT_MODES,
    COMPUTE,
    RECVS,
    SENDS,
    Action,
    ActionKind,
    ScheduleError,
)
from gpipe_repro.engine.schedule.core import Schedule
from gpipe_repro.engine.schedule.dualpipe_v import dualpipe_v_schedule
from gpipe_repro.engine.schedule.generators import (
    checkpointed_microbatches,
    gpipe_schedule,
    one_f_one_b_schedule,
    zero_bubble_h1_schedule,
)
from gpipe_repro.engine.schedule.interleaved import (
    INTERLEAVED_VIRTUAL_STAGES,
    forward_on_processes,
    interleaved_schedule,
)
from gpipe_repro.engine.schedule.partial_split import split_last
from gpipe_repro.engine.schedule.registry import (
    SCHEDULES,
    SPLIT_SCHEDULES,
    V_SCHEDULES,
    cells_per_process,
    check_split_backwards,
    make_schedule,
    num_processes,
    owner_of_cells,
)
from gpipe_repro.engine.schedule.zero_bubble_v import zero_bubble_v_schedule

__all__ = ["CHECKPOINT_MODES", "ActionKind", "COMPUTE", "BACKWARDS", "SENDS", "RECVS", "BARRIERS", "Action",
           "ScheduleError", "Schedule", "checkpointed_microbatches", "gpipe_schedule",
           "one_f_one_b_schedule", "zero_bubble_h1_schedule", "interleaved_schedule",
           "zero_bubble_v_schedule", "dualpipe_v_schedule", "SCHEDULES", "V_SCHEDULES",
           "make_schedule", "num_processes", "forward_on_processes", "INTERLEAVED_VIRTUAL_STAGES",
           "cells_per_process", "owner_of_cells", "SPLIT_SCHEDULES", "split_last",
           "check_split_backwards"]
