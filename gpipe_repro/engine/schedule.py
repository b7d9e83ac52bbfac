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

tests/golden/ holds generated schedules in this form, and a :class:`ScheduleError` prints the schedule
with the failing action marked.

Every training schedule has, on every stage, one AGREE right before its OPTIMIZER_STEP: the point
where all stages' gradients are final and the stages agree (one small all-reduce in the distributed
runtime) on the step's loss, its global gradient norm and whether any gradient overflowed. It is a
barrier: no stage passes its AGREE before every stage has reached its own, so no cell updates before
every action of every stage has succeeded (all-or-nothing steps), and global clipping and the fp16
overflow check read the agreed numbers.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

__all__ = ["CHECKPOINT_MODES", "ActionKind", "COMPUTE", "SENDS", "RECVS", "BARRIERS", "Action",
           "ScheduleError", "Schedule", "checkpointed_microbatches", "gpipe_schedule",
           "one_f_one_b_schedule", "SCHEDULES", "make_schedule", "num_processes", "forward_on_processes",
           "INTERLEAVED_VIRTUAL_STAGES"]

CHECKPOINT_MODES = ("always", "except_last", "never")


class ActionKind(str, Enum):
    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"
    OPTIMIZER_STEP = "optimizer_step"
    AGREE = "agree"   # barrier: every stage's gradients are final; the stages agree (see module doc)
    # Zero-bubble split of BACKWARD (Qi et al., ICLR 2024): the input gradient (what the previous
    # stage waits for) and the weight gradient (what nobody waits for, placed to fill the bubble).
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"


COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.RECOMPUTE, ActionKind.BACKWARD,
                     ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT, ActionKind.OPTIMIZER_STEP})
# A micro-batch's backward on a stage is either one BACKWARD or a BACKWARD_INPUT then a BACKWARD_WEIGHT.
BACKWARDS = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})
SENDS = frozenset({ActionKind.SEND_ACT, ActionKind.SEND_GRAD})
RECVS = frozenset({ActionKind.RECV_ACT, ActionKind.RECV_GRAD})
BARRIERS = frozenset({ActionKind.AGREE})
_SHORT = {ActionKind.FORWARD: "F", ActionKind.RECOMPUTE: "R", ActionKind.BACKWARD: "B",
          ActionKind.OPTIMIZER_STEP: "U", ActionKind.SEND_ACT: "sa", ActionKind.RECV_ACT: "ra",
          ActionKind.SEND_GRAD: "sg", ActionKind.RECV_GRAD: "rg", ActionKind.AGREE: "A",
          ActionKind.BACKWARD_INPUT: "I", ActionKind.BACKWARD_WEIGHT: "W"}


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    stage: int
    microbatch: int | None = None

    def __str__(self) -> str:
        return f"{_SHORT[self.kind]}{'' if self.microbatch is None else self.microbatch}"

    def peer(self) -> Action:
        """The matching receive of a send, or the matching send of a receive."""
        k, s, m = self.kind, self.stage, self.microbatch
        return {ActionKind.SEND_ACT: Action(ActionKind.RECV_ACT, s + 1, m),
                ActionKind.RECV_ACT: Action(ActionKind.SEND_ACT, s - 1, m),
                ActionKind.SEND_GRAD: Action(ActionKind.RECV_GRAD, s - 1, m),
                ActionKind.RECV_GRAD: Action(ActionKind.SEND_GRAD, s + 1, m)}[k]


class ScheduleError(ValueError):
    """A schedule that a runtime could not execute correctly.

    With `schedule` the message is followed by the schedule in text form, the actions in `at` marked
    ``>>F3<<`` and their lines flagged ``<-- ERROR`` (as PyTorch's ``_format_pipeline_order`` does)."""

    def __init__(self, message: str, schedule: Schedule | None = None,
                 at: Iterable[Action] = ()) -> None:
        super().__init__(message)
        self.message, self.schedule, self.at = message, schedule, tuple(at)

    def __str__(self) -> str:
        if self.schedule is None:
            return self.message
        return f"{self.message}\n{self.schedule.to_text(mark=self.at)}"


@dataclass(frozen=True)
class Schedule:
    name: str
    num_stages: int
    num_microbatches: int
    stages: tuple[tuple[Action, ...], ...]
    training: bool = True
    # When stages share processes (interleaved 1F1B: v stages per process), each process's program:
    # its stages' actions in the order it runs them. None: one process per stage, running `stages`.
    processes: tuple[tuple[Action, ...], ...] | None = None

    def programs(self) -> tuple[tuple[Action, ...], ...]:
        """What each process runs, in order: :attr:`processes`, or one program per stage."""
        return self.processes if self.processes is not None else self.stages

    def process_of(self) -> list[int]:
        """The process running each stage."""
        if self.processes is None:
            return list(range(self.num_stages))
        owner = [0] * self.num_stages
        for p, actions in enumerate(self.processes):
            for a in actions:
                owner[a.stage] = p
        return owner

    def checkpointed(self, stage: int) -> frozenset[int]:
        """Micro-batches whose forward on `stage` is re-materialized (it has a RECOMPUTE)."""
        return frozenset(a.microbatch for a in self.stages[stage]
                         if a.kind is ActionKind.RECOMPUTE and a.microbatch is not None)

    def validate(self) -> None:
        """Raise ScheduleError unless every action is well placed and the whole runs to completion."""
        k, m_count = self.num_stages, self.num_microbatches
        if len(self.stages) != k:
            raise ScheduleError(f"{len(self.stages)} action lists for {k} stages")
        for s, actions in enumerate(self.stages):
            try:
                _validate_stage(s, k, m_count, actions, self.training)
            except ScheduleError as e:
                if e.schedule is None:
                    raise ScheduleError(e.message, self, e.at) from None
                raise
        if self.processes is not None:
            self._validate_processes()
        from gpipe_repro.engine.interpreter import run_dataflow  # one executor of the dataflow semantics
        run_dataflow(self, duration=lambda a: 1.0)

    def _validate_processes(self) -> None:
        assert self.processes is not None
        where: dict[int, set[int]] = defaultdict(set)
        for p, actions in enumerate(self.processes):
            for a in actions:
                where[a.stage].add(p)
        for s in range(self.num_stages):
            if len(where[s]) != 1:
                raise ScheduleError(f"stage {s}'s actions are on processes {sorted(where[s])}: a stage "
                                    "runs on exactly one process", self, list(self.stages[s][:1]))
            mine = tuple(a for a in self.processes[next(iter(where[s]))] if a.stage == s)
            if mine != self.stages[s]:
                raise ScheduleError(f"the process programs do not hold stage {s}'s actions in its order",
                                    self, list(self.stages[s][:1]))

    def render(self, duration: Callable[[Action], float] | None = None) -> str:
        """ASCII picture: one row per stage, one column per unit of time, compute actions only."""
        from gpipe_repro.engine.interpreter import run_dataflow
        events = run_dataflow(self, duration=duration or _unit_compute)
        cols = max(int(round(e.end)) for e in events)
        owner, shared = self.process_of(), self.processes is not None
        grid = [["." for _ in range(cols)] for _ in range(len(self.programs()))]
        label = (lambda a: f"{a}@{a.stage}") if shared else str
        for e in events:
            if e.action.kind in COMPUTE:
                for c in range(int(round(e.start)), int(round(e.end))):
                    grid[owner[e.action.stage]][c] = label(e.action)
        width = max(len(label(a)) for st in self.stages for a in st if a.kind in COMPUTE)
        row_name = "process" if shared else "stage"
        rows = [f"{row_name} {s} |" + " ".join(c.ljust(width) for c in row) + " |"
                for s, row in enumerate(grid)]
        return "\n".join(rows)


    def to_text(self, mark: Iterable[Action] = ()) -> str:
        """The schedule in its text form (see the module docstring); actions in `mark` are
        bracketed ``>>F3<<`` and their lines end with ``<-- ERROR``."""
        marked = set(mark)
        lines = [f"schedule {self.name} stages={self.num_stages} micro_batches={self.num_microbatches} "
                 f"training={int(self.training)}"]
        if self.processes is not None:   # stages sharing processes: one line per process, X@stage
            lines[0] += f" processes={len(self.processes)}"
            for p, actions in enumerate(self.processes):
                tokens = [f">>{a}@{a.stage}<<" if a in marked else f"{a}@{a.stage}" for a in actions]
                flag = "   <-- ERROR" if any(a in marked for a in actions) else ""
                lines.append(f"process {p}: {' '.join(tokens)}{flag}".rstrip())
            return "\n".join(lines)
        for s, actions in enumerate(self.stages):
            tokens = [f">>{a}<<" if a in marked else str(a) for a in actions]
            flag = "   <-- ERROR" if any(a.stage == s for a in marked) else ""
            lines.append(f"stage {s}: {' '.join(tokens)}{flag}".rstrip())
        return "\n".join(lines)

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Parse :meth:`to_text`'s form (blank lines and ``#`` comments are ignored). Raises
        ScheduleError naming the line for anything it cannot read; it does not validate (call
        :meth:`validate` for that), so broken schedules can be written down and checked."""
        lines = [(i + 1, ln.split("#", 1)[0].strip()) for i, ln in enumerate(text.splitlines())]
        lines = [(i, ln) for i, ln in lines if ln]
        if not lines or not lines[0][1].startswith("schedule "):
            raise ScheduleError("schedule text must start with 'schedule NAME stages=K micro_batches=M "
                                "training=1'")
        head = lines[0][1].split()
        fields = dict(f.split("=", 1) for f in head[2:] if "=" in f)
        try:
            k, m = int(fields["stages"]), int(fields["micro_batches"])
            training = bool(int(fields.get("training", "1")))
        except (KeyError, ValueError):
            raise ScheduleError(f"line {lines[0][0]}: cannot read {lines[0][1]!r}: expected "
                                "'schedule NAME stages=K micro_batches=M training=1'") from None
        if "processes" in fields:
            return cls._from_process_text(head[1], k, m, training, lines[1:])
        stages: dict[int, tuple[Action, ...]] = {}
        for lineno, ln in lines[1:]:
            label, sep, body = ln.partition(":")
            if not sep or not re.fullmatch(r"stage \d+", label.strip()):
                raise ScheduleError(f"line {lineno}: expected 'stage N: actions...', got {ln!r}")
            s = int(label.split()[1])
            if s in stages:
                raise ScheduleError(f"line {lineno}: stage {s} is listed twice")
            stages[s] = tuple(_parse_action(tok, s, lineno) for tok in body.replace("<-- ERROR", "").split())
        if sorted(stages) != list(range(k)):
            raise ScheduleError(f"the header says stages={k} but the text lists stages {sorted(stages)}")
        return cls(head[1], k, m, tuple(stages[s] for s in range(k)), training)

    @classmethod
    def _from_process_text(cls, name: str, k: int, m: int, training: bool,
                           lines: list[tuple[int, str]]) -> Schedule:
        programs: dict[int, tuple[Action, ...]] = {}
        for lineno, ln in lines:
            label, sep, body = ln.partition(":")
            if not sep or not re.fullmatch(r"process \d+", label.strip()):
                raise ScheduleError(f"line {lineno}: expected 'process N: actions@stage...', got {ln!r}")
            p = int(label.split()[1])
            if p in programs:
                raise ScheduleError(f"line {lineno}: process {p} is listed twice")
            acts = []
            for tok in body.replace("<-- ERROR", "").split():
                bare = tok[2:-2] if tok.startswith(">>") and tok.endswith("<<") else tok
                action, at, stage = bare.rpartition("@")
                if not at or not stage.isdigit():
                    raise ScheduleError(f"line {lineno}: {tok!r} needs its stage: write e.g. F3@2")
                acts.append(_parse_action(action, int(stage), lineno))
            programs[p] = tuple(acts)
        procs = tuple(programs[p] for p in sorted(programs))
        stages = tuple(tuple(a for prog in procs for a in prog if a.stage == s) for s in range(k))
        return cls(name, k, m, stages, training, procs)

    def check_link_order(self) -> None:
        """Raise ScheduleError unless every stage sends to a neighbour in the order the neighbour
        receives. Backends that match point-to-point messages in order (NCCL ignores tags) need it;
        the dataflow semantics (:mod:`gpipe_repro.engine.interpreter`) do not."""
        sends: dict[tuple[int, int], list[Action]] = defaultdict(list)
        recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
        for actions in self.stages:
            for a in actions:
                if a.kind in SENDS:
                    sends[(a.stage, a.peer().stage)].append(a.peer())
                elif a.kind in RECVS:
                    recvs[(a.peer().stage, a.stage)].append(a)
        for (src, dst), order in sends.items():
            got = recvs[(src, dst)]
            if order != got:
                i = next((i for i, (x, y) in enumerate(zip(order, got)) if x != y), min(len(order), len(got)))
                at = [a for a in (order[i:i + 1] + got[i:i + 1])] + [a.peer() for a in order[i:i + 1]]
                raise ScheduleError(f"schedule {self.name!r}: stage {src} sends to stage {dst} in a "
                                    "different order than it receives; a backend that matches messages "
                                    "in order (NCCL) would mismatch them", self, at)


_FROM_SHORT = {short: kind for kind, short in _SHORT.items()}


def _parse_action(token: str, stage: int, lineno: int) -> Action:
    match = re.fullmatch(r">>(.*)<<|(.*)", token)
    body = (match.group(1) or match.group(2)) if match else token
    parsed = re.fullmatch(r"([A-Za-z_]+?)(\d*)", body)
    if parsed is None or parsed.group(1) not in _FROM_SHORT:
        raise ScheduleError(f"line {lineno}: unknown action {token!r}: use one of "
                            f"{sorted(_FROM_SHORT)} followed by a micro-batch number")
    kind, digits = _FROM_SHORT[parsed.group(1)], parsed.group(2)
    return Action(kind, stage, int(digits) if digits else None)


def _unit_compute(a: Action) -> float:
    return 1.0 if a.kind in COMPUTE else 0.0


def _validate_stage(s: int, k: int, m_count: int, actions: tuple[Action, ...], training: bool) -> None:
    where = f"stage {s}"
    for a in actions:
        if a.stage != s:
            raise ScheduleError(f"{where} holds {a} of stage {a.stage}", at=[a])
        if a.kind not in (ActionKind.OPTIMIZER_STEP, ActionKind.AGREE) and not (
                a.microbatch is not None and 0 <= a.microbatch < m_count):
            raise ScheduleError(f"{where}: {a} names micro-batch {a.microbatch} outside 0..{m_count - 1}",
                                at=[a])
    counts = Counter((a.kind, a.microbatch) for a in actions)
    dup = [f"{_SHORT[kind]}{mb}" for (kind, mb), c in counts.items() if c > 1]
    if dup:
        raise ScheduleError(f"{where}: actions repeated: {dup}",
                            at=[a for a in actions if counts[(a.kind, a.microbatch)] > 1])
    split = {mb for mb in range(m_count)
             if (ActionKind.BACKWARD_INPUT, mb) in counts or (ActionKind.BACKWARD_WEIGHT, mb) in counts}
    for mb in sorted(split):
        if (ActionKind.BACKWARD, mb) in counts:
            raise ScheduleError(f"{where}: micro-batch {mb} has both a BACKWARD (B) and a split backward "
                                "(I/W): use one or the other", at=[a for a in actions if a.microbatch == mb
                                                                   and a.kind in BACKWARDS])
        for kind in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT):
            if (kind, mb) not in counts:
                raise ScheduleError(f"{where}: {Action(kind, s, mb)} is missing: a split backward needs "
                                    "both its input-gradient (I) and weight-gradient (W) halves",
                                    at=[Action(kind, s, mb)])
    expected = {ActionKind.FORWARD: True, ActionKind.RECV_ACT: s > 0, ActionKind.SEND_ACT: s < k - 1,
                ActionKind.BACKWARD: training, ActionKind.RECV_GRAD: training and s < k - 1,
                ActionKind.SEND_GRAD: training and s > 0}
    for kind, wanted in expected.items():
        for mb in range(m_count):
            if kind is ActionKind.BACKWARD and mb in split:
                if not training:
                    raise ScheduleError(f"{where}: a forward-only schedule cannot have backward actions",
                                        at=[a for a in actions if a.microbatch == mb and a.kind in BACKWARDS])
                continue   # checked above: I and W stand for B
            if ((kind, mb) in counts) != wanted:
                state = "missing" if wanted else "not allowed"
                raise ScheduleError(f"{where}: {Action(kind, s, mb)} is {state}",
                                    at=[Action(kind, s, mb)])
    no_training = (ActionKind.RECOMPUTE, ActionKind.OPTIMIZER_STEP, ActionKind.AGREE)
    if not training and any(a.kind in no_training for a in actions):
        raise ScheduleError(f"{where}: a forward-only schedule cannot recompute or update (or agree)", at=[
            a for a in actions if a.kind in no_training])
    if training and counts[(ActionKind.OPTIMIZER_STEP, None)] != 1:
        raise ScheduleError(f"{where}: needs exactly one optimizer step")
    pos = {(a.kind, a.microbatch): i for i, a in enumerate(actions)}
    before = [(ActionKind.RECV_ACT, ActionKind.FORWARD), (ActionKind.FORWARD, ActionKind.SEND_ACT),
              (ActionKind.FORWARD, ActionKind.RECOMPUTE), (ActionKind.RECOMPUTE, ActionKind.BACKWARD),
              (ActionKind.FORWARD, ActionKind.BACKWARD), (ActionKind.RECV_GRAD, ActionKind.BACKWARD),
              (ActionKind.BACKWARD, ActionKind.SEND_GRAD),
              # the split backward: W after its I (Qi et al. 2024); I plays B's part for the rest
              (ActionKind.RECOMPUTE, ActionKind.BACKWARD_INPUT),
              (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT),
              (ActionKind.RECV_GRAD, ActionKind.BACKWARD_INPUT),
              (ActionKind.BACKWARD_INPUT, ActionKind.SEND_GRAD),
              (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)]
    for mb in range(m_count):
        for first, then in before:
            i, j = pos.get((first, mb)), pos.get((then, mb))
            if i is not None and j is not None and i > j:
                raise ScheduleError(f"{where}: {Action(then, s, mb)} comes before {Action(first, s, mb)}",
                                    at=[Action(then, s, mb), Action(first, s, mb)])
        for kind in BACKWARDS:
            if (kind, mb) in pos and pos[(kind, mb)] > min(pos.get((ActionKind.OPTIMIZER_STEP, None), len(
                    actions)), pos.get((ActionKind.AGREE, None), len(actions))):
                raise ScheduleError(f"{where}: {Action(kind, s, mb)} after the AGREE / optimizer step: every "
                                    "gradient (W included) must be final before the stages agree",
                                    at=[Action(kind, s, mb)])
    if training:   # after the checks above, so that their more specific errors come first
        agree = Action(ActionKind.AGREE, s)
        if agree not in actions:
            raise ScheduleError(f"{where}: {agree} is missing: every training stage ends with AGREE (A) "
                                "then its optimizer step (U)", at=[agree])
        if actions[-2:] != (agree, Action(ActionKind.OPTIMIZER_STEP, s)):
            raise ScheduleError(f"{where}: must end with AGREE (A) then the optimizer step (U): every "
                                "action of the step comes before the barrier, the update after it",
                                at=[agree])


def checkpointed_microbatches(mode: str, num_microbatches: int) -> frozenset[int]:
    """Which micro-batches re-materialize under a checkpoint mode."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {mode!r}")
    if mode == "never":
        return frozenset()
    if mode == "always":
        return frozenset(range(num_microbatches))
    return frozenset(range(num_microbatches - 1))


def _backward_block(s: int, k: int, mb: int, ckpt: frozenset[int], ahead: bool) -> list[Action]:
    A = ActionKind
    recv = [Action(A.RECV_GRAD, s, mb)] if s < k - 1 else []
    rec = [Action(A.RECOMPUTE, s, mb)] if mb in ckpt else []
    out = rec + recv if ahead else recv + rec
    out.append(Action(A.BACKWARD, s, mb))
    if s > 0:
        out.append(Action(A.SEND_GRAD, s, mb))
    return out


def _forward_block(s: int, k: int, mb: int) -> list[Action]:
    A = ActionKind
    out = [Action(A.RECV_ACT, s, mb)] if s > 0 else []
    out.append(Action(A.FORWARD, s, mb))
    if s < k - 1:
        out.append(Action(A.SEND_ACT, s, mb))
    return out


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"the number of stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"the number of micro-batches must be >= 1, got {num_microbatches}")


def gpipe_schedule(num_stages: int, num_microbatches: int, checkpoint: str = "except_last",
                   recompute_ahead: bool = False, training: bool = True) -> Schedule:
    """GPipe fill-drain: all forwards, then all backwards in reverse micro-batch order, then update."""
    _check_sizes(num_stages, num_microbatches)
    ckpt = checkpointed_microbatches(checkpoint, num_microbatches) if training else frozenset()
    stages = []
    for s in range(num_stages):
        acts = [a for mb in range(num_microbatches) for a in _forward_block(s, num_stages, mb)]
        if training:
            for mb in reversed(range(num_microbatches)):
                acts += _backward_block(s, num_stages, mb, ckpt, recompute_ahead)
            acts += [Action(ActionKind.AGREE, s), Action(ActionKind.OPTIMIZER_STEP, s)]
        stages.append(tuple(acts))
    return Schedule("gpipe" if training else "forward", num_stages, num_microbatches, tuple(stages),
                    training)


def one_f_one_b_schedule(num_stages: int, num_microbatches: int, checkpoint: str = "never",
                         recompute_ahead: bool = False) -> Schedule:
    """1F1B (PipeDream-flush): after a warm-up of K-1-s forwards, stage s alternates one forward and
    one backward, so it holds at most K-s micro-batches in flight instead of M. Same update semantics
    as GPipe; shown for comparison."""
    _check_sizes(num_stages, num_microbatches)
    ckpt = checkpointed_microbatches(checkpoint, num_microbatches)
    stages = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_microbatches)
        acts: list[Action] = []
        for mb in range(warmup):
            acts += _forward_block(s, num_stages, mb)
        for i in range(num_microbatches - warmup):
            acts += _forward_block(s, num_stages, warmup + i)
            acts += _backward_block(s, num_stages, i, ckpt, recompute_ahead)
        for mb in range(num_microbatches - warmup, num_microbatches):
            acts += _backward_block(s, num_stages, mb, ckpt, recompute_ahead)
        acts += [Action(ActionKind.AGREE, s), Action(ActionKind.OPTIMIZER_STEP, s)]
        stages.append(tuple(acts))
    return Schedule("1f1b", num_stages, num_microbatches, tuple(stages))


def _zb_h1_order(num_stages: int, num_microbatches: int) -> list[list[tuple[ActionKind, int]]]:
    """Each stage's compute order for ZB-H1, by list-scheduling in unit time (T_F = T_I = T_W, the
    paper's assumption; instant links): a free stage runs, in this priority, its next input gradient
    (I) once the next stage's has finished, else its next forward if fewer than K-s micro-batches
    are in flight on it (forwarded, weight gradient not yet done: 1F1B's activation memory), else
    its oldest pending weight gradient (W). W thus fills what 1F1B leaves idle while the stage
    waits for gradients."""
    k, m_count = num_stages, num_microbatches
    A = ActionKind
    f_end = [[-1.0] * m_count for _ in range(k)]
    i_end = [[-1.0] * m_count for _ in range(k)]
    next_f, next_i = [0] * k, [0] * k
    pending_w: list[list[int]] = [[] for _ in range(k)]
    w_done = [0] * k
    order: list[list[tuple[ActionKind, int]]] = [[] for _ in range(k)]
    t = 0
    while any(w_done[s] < m_count for s in range(k)):
        for s in range(k):
            m = next_i[s]
            if m < next_f[s] and 0 <= f_end[s][m] <= t and (s == k - 1 or 0 <= i_end[s + 1][m] <= t):
                order[s].append((A.BACKWARD_INPUT, m))
                i_end[s][m] = t + 1
                next_i[s] += 1
                pending_w[s].append(m)
                continue
            m = next_f[s]
            if (m < m_count and (s == 0 or 0 <= f_end[s - 1][m] <= t)
                    and next_f[s] - next_i[s] < k - s and next_f[s] - w_done[s] < k):
                order[s].append((A.FORWARD, m))
                f_end[s][m] = t + 1
                next_f[s] += 1
                continue
            if pending_w[s]:
                order[s].append((A.BACKWARD_WEIGHT, pending_w[s].pop(0)))
                w_done[s] += 1
        t += 1
    return order


def zero_bubble_h1_schedule(num_stages: int, num_microbatches: int, checkpoint: str = "never",
                            recompute_ahead: bool = False) -> Schedule:
    """ZB-H1 (Qi, Wan, Huang, Lin: "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3): every
    backward is split into its input gradient (I, what the previous stage waits for) and its weight
    gradient (W, what nobody waits for), and the W are placed where 1F1B idles. Same in-flight limit
    as 1F1B (at most K-s micro-batches whose W is not done on stage s), so about 1F1B's activation
    memory, and with T_F = T_I = T_W the bubble drops from 1F1B's 3(K-1) units to (K-1): the
    paper's (p-1)(T_F + T_B - T_W). Re-materialization: a checkpointed micro-batch's RECOMPUTE comes
    right before its I (or before the wait for its gradient with `recompute_ahead`); its graph then
    lives until its W. All checkpoint modes are allowed."""
    _check_sizes(num_stages, num_microbatches)
    ckpt = checkpointed_microbatches(checkpoint, num_microbatches)
    A = ActionKind
    stages = []
    for s, order in enumerate(_zb_h1_order(num_stages, num_microbatches)):
        acts: list[Action] = []
        for kind, mb in order:
            if kind is A.FORWARD:
                acts += _forward_block(s, num_stages, mb)
            elif kind is A.BACKWARD_INPUT:
                acts += [Action(A.BACKWARD_INPUT, s, mb) if a.kind is A.BACKWARD else a
                         for a in _backward_block(s, num_stages, mb, ckpt, recompute_ahead)]
            else:
                acts.append(Action(A.BACKWARD_WEIGHT, s, mb))
        acts += [Action(A.AGREE, s), Action(A.OPTIMIZER_STEP, s)]
        stages.append(tuple(acts))
    return Schedule("zb-h1", num_stages, num_microbatches, tuple(stages))


INTERLEAVED_VIRTUAL_STAGES = 2   # v of make_schedule("interleaved", ...): cells per process


def _check_interleaved_stages(num_stages: int, v: int) -> None:
    if v < 1 or num_stages % v:
        raise ValueError(f"interleaved 1F1B cuts the model into K*v cells for K processes: "
                         f"{num_stages} stages (partitions) is not a multiple of v={v}; use "
                         f"partitions={max(v, num_stages - num_stages % v)}")


def interleaved_schedule(num_stages: int, num_microbatches: int, checkpoint: str = "never",
                         recompute_ahead: bool = False, *,
                         virtual_stages: int = INTERLEAVED_VIRTUAL_STAGES) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC'21, section 2.2.2): the model is cut into ``num_stages`` = K*v
    cells (stages) and process r runs stages r, r+K, ..., r+(v-1)K (round robin), so each process
    holds v smaller cells and the bubble shrinks v-fold, (K-1)/v units of a full cell per
    micro-batch instead of K-1, for v times more messages. The order is Megatron-LM's
    (``forward_backward_pipelining_with_interleaving``): forwards run K micro-batches through one
    cell, then the same K through the next; process r warms up with (K-r-1)*2 + (v-1)*K forwards,
    then alternates one forward and one backward. Like Megatron-LM it needs M a multiple of K.

    The schedule's stages are the K*v cells; :attr:`Schedule.processes` gives each process's program.
    Every checkpoint mode is allowed (a RECOMPUTE right before its BACKWARD, as in 1F1B)."""
    _check_sizes(num_stages, num_microbatches)
    v = virtual_stages
    _check_interleaved_stages(num_stages, v)
    k = num_stages // v
    if num_microbatches % k:
        raise ValueError(f"interleaved 1F1B needs the micro-batches in groups of the {k} processes "
                         f"(as Megatron-LM does): M={num_microbatches} is not a multiple of {k}; use "
                         f"M={num_microbatches + k - num_microbatches % k}")
    ckpt = checkpointed_microbatches(checkpoint, num_microbatches)
    A = ActionKind
    total = num_microbatches * v

    def chunk_mb(i: int, backward: bool) -> tuple[int, int]:
        chunk = (i // k) % v
        return (v - 1 - chunk if backward else chunk), (i // (k * v)) * k + i % k

    procs = []
    for r in range(k):
        warmup = min((k - r - 1) * 2 + (v - 1) * k, total)
        order = [(False, i) for i in range(warmup)]
        for i in range(total - warmup):
            order += [(False, warmup + i), (True, i)]
        order += [(True, i) for i in range(total - warmup, total)]
        acts: list[Action] = []
        for backward, i in order:
            chunk, mb = chunk_mb(i, backward)
            s = chunk * k + r
            acts += (_backward_block(s, num_stages, mb, ckpt, recompute_ahead) if backward
                     else _forward_block(s, num_stages, mb))
        acts += [Action(A.AGREE, c * k + r) for c in range(v)]
        acts += [Action(A.OPTIMIZER_STEP, c * k + r) for c in range(v)]
        procs.append(tuple(acts))
    stages = tuple(tuple(a for p in procs for a in p if a.stage == s) for s in range(num_stages))
    return Schedule("interleaved", num_stages, num_microbatches, stages, True, tuple(procs))


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule, "zb-h1": zero_bubble_h1_schedule,
             "interleaved": interleaved_schedule}


def make_schedule(name: str, num_stages: int, num_microbatches: int, checkpoint: str,
                  recompute_ahead: bool = False) -> Schedule:
    """Build a training schedule by name (the one entry point runtimes and tools use)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name](num_stages, num_microbatches, checkpoint, recompute_ahead)


def num_processes(name: str, num_stages: int) -> int:
    """How many processes :func:`make_schedule`'s `name` schedule of `num_stages` stages runs on:
    num_stages / v for "interleaved" (v = :data:`INTERLEAVED_VIRTUAL_STAGES`), else one per stage.
    Raises ValueError (saying what to use) for a stage count the schedule cannot serve."""
    if name == "interleaved":
        _check_interleaved_stages(num_stages, INTERLEAVED_VIRTUAL_STAGES)
        return num_stages // INTERLEAVED_VIRTUAL_STAGES
    return num_stages


def forward_on_processes(schedule: Schedule, process_of: list[int]) -> Schedule:
    """A forward-only `schedule` run by processes holding several stages (``process_of[s]``, e.g. a
    training schedule's :meth:`Schedule.process_of`): each process runs its stages one after the
    other, in stage order. That cannot deadlock: a stage only waits on a lower stage, and every
    process runs its lower stages first. Training schedules place their own stages."""
    if schedule.training:
        raise ValueError("forward_on_processes places forward-only schedules; a training schedule "
                         "says its own process programs (Schedule.processes)")
    if len(process_of) != schedule.num_stages:
        raise ValueError(f"process_of names {len(process_of)} stages for a schedule of "
                         f"{schedule.num_stages}")
    procs = tuple(tuple(a for s in range(schedule.num_stages) if process_of[s] == p
                        for a in schedule.stages[s]) for p in range(max(process_of) + 1))
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.stages,
                    False, procs)
