"""The measurement kernel: every compared or absolute timing figure of the project comes from here.

A host whose cores switch between a fast and a slow state every few milliseconds, shared with other
work, never becomes quiet; waiting for it does not end. So nothing waits. The configurations to
compare run in alternating rounds (every configuration once per round, the order rotated from
round to round, or shuffled with a seed), so that whatever the host does hits all of them alike;
each comparison is a *paired ratio per round* (the two configurations' times of the same round);
its figure of record is the median over rounds with a 95% confidence interval from the rounds'
order statistics (distribution-free: it holds whatever the host's speed does to the samples, where a
percentile bootstrap of a median covered 86-94% on a host that switches between two speeds; from 3 to
5 rounds no interval reaches 95%, and the range stands with its coverage said and no verdict but
"inconclusive"). Rounds go on until every comparison's interval (without comparisons, every
configuration's time's) is within its relative tolerance at 95%, or the rounds or the time budget
run out. The
verdict against a target is ``met`` / ``not met`` / ``inconclusive`` (the interval straddles the
target). A busy host widens the intervals, and the result then says "inconclusive": it never
turns into "not comparable".

With each figure goes the host's speed: the share of short probes that ran in the fast state
(:func:`gpipe_repro.report.host.fast_share`), averaged over the rounds.

    result = measure({"plain": plain_step, "ours": our_step},
                     [Comparison("overhead", "ours", "plain", target=1.03, direction="<=")],
                     StopRule(tolerance=0.02, budget_s=60))
    print(result.figures["overhead"].markdown())
    # 1.01x [1.00, 1.02] (n=12 rounds, host fast 21%) — met (<= 1.03)
"""
from __future__ import annotations

import contextlib
import math
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
DIRECTIONS = (">=", "<=")
VERDICTS = ("met", "not met", "inconclusive")


def order_statistic_rank(n: int, confidence: float = CONFIDENCE) -> tuple[int, float]:
    """(j, coverage): the largest j such that the j-th smallest and j-th largest of `n` samples
    cover the median with probability `coverage` >= `confidence` (1 - 2 P(B < j), B ~ Bin(n, 1/2));
    j = 1 (the range) where even it falls short (n <= 5 at 95%), with its lower coverage."""
    if n < 1:
        raise ValueError(f"need at least one sample, got {n}")
    log_half = n * math.log(0.5)

    def pmf(k: int) -> float:        # P(B = k), in logs: 2^-n underflows past n = 1074
        return math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + log_half)

    below = pmf(0)                   # P(B < j) for j = 1
    j = 1
    while j + 1 <= (n + 1) // 2 and 1 - 2 * (below + pmf(j)) >= confidence:
        below += pmf(j)
        j += 1
    return j, 1 - 2 * below


def median_interval(samples: Sequence[float], *, confidence: float = CONFIDENCE,
                    per: str = "rounds") -> tuple[float | None, float | None, str]:
    """(low, high, method) of :func:`_median_interval`."""
    return _median_interval(samples, confidence, per)[:3]


def _median_interval(samples: Sequence[float], confidence: float = CONFIDENCE,
                     per: str = "rounds") -> tuple[float | None, float | None, str, float | None]:
    """(low, high, method) of a confidence interval of the median of `samples`: the j-th smallest
    and j-th largest sample (:func:`order_statistic_rank`), which cover the median with a known
    probability whatever the samples' distribution, as long as they are independent; the range
    below 6 samples (covering 75% at 3, 88% at 4, 94% at 5: the method says so); unbounded below 3.
    None is an unbounded side. `per`: what one sample is, in the plural ("rounds"; "steps"). The
    fourth value is the interval's coverage (None where it is unbounded)."""
    n = len(samples)
    if n == 0:
        raise ValueError("no samples: measure at least one round")
    if any(math.isnan(x) for x in samples):
        raise ValueError(f"a sample is NaN ({sum(math.isnan(x) for x in samples)} of {n}): a median "
                         "of them has no order; find what produced it")
    if n < 3:
        return (None, None, f"unbounded ({n} {per if n > 1 else per.rstrip('s')}: too few for an "
                "interval)", None)
    j, coverage = order_statistic_rank(n, confidence)
    ordered = sorted(float(x) for x in samples)
    low, high = ordered[j - 1], ordered[n - j]
    if coverage < confidence:
        return (low, high, f"range of {n} {per} (covers the median {coverage:.0%}: below "
                f"{confidence:.0%})", coverage)
    return low, high, (f"order statistics {j} and {n + 1 - j} of {n} {per} (covers the median "
                       f"{coverage:.1%})"), coverage


def bootstrap_median_interval(samples: Sequence[float], *, confidence: float = CONFIDENCE,
                              resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """A seeded percentile bootstrap of the median of >= 3 `samples`: a spread to compare with a
    tolerance (the calibration's rounds), not an interval to judge a target by (it covers less
    than `confidence` on this host's bimodal speeds: :func:`median_interval` does)."""
    data = np.asarray(samples, dtype=float)
    picks = np.random.default_rng(seed).integers(0, len(data), size=(resamples, len(data)))
    medians = np.sort(np.median(data[picks], axis=1))
    tail = (1.0 - confidence) / 2
    return (float(medians[int(math.floor(tail * (resamples - 1)))]),
            float(medians[int(math.ceil((1.0 - tail) * (resamples - 1)))]))


@dataclass
class Figure:
    """One figure of record: the median of `samples` (per-round paired ratios, or per-round times)
    with its confidence interval, the rounds, the host's fast share and, with a target, a verdict."""

    name: str
    value: float
    low: float | None
    high: float | None
    rounds: int
    interval: str                       # how the interval was made (see median_interval)
    unit: str = "x"                     # "x": a ratio; "s": a time (rendered in ms)
    host_fast: float | None = None
    target: float | None = None
    direction: str = ">="
    tolerance: float = 0.02
    samples: list[float] = field(default_factory=list)
    per: str = "rounds"                 # what one sample is, in the plural (`rounds` counts them)
    coverage: float | None = None       # the interval's probability of covering the median

    @classmethod
    def of(cls, name: str, samples: Sequence[float], *, unit: str = "x", target: float | None = None,
           direction: str = ">=", tolerance: float = 0.02, host_fast: float | None = None,
           per: str = "rounds") -> Figure:
        """The figure of `samples` (median and :func:`median_interval`); `per`: what one sample is."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction {direction!r}: use one of {DIRECTIONS}")
        low, high, how, coverage = _median_interval(samples, per=per)
        return cls(name, statistics.median(samples), low, high, len(samples), how, unit, host_fast,
                   target, direction, tolerance, [float(s) for s in samples], per, coverage)

    @property
    def short_of_confidence(self) -> bool:
        """Whether the interval covers the median with less than :data:`CONFIDENCE` (a range of 3 to
        5 samples): it is shown with its coverage and judges nothing."""
        return self.coverage is not None and self.coverage < CONFIDENCE

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the median (inf where unbounded)."""
        if self.low is None or self.high is None or self.value == 0:
            return math.inf
        return (self.high - self.low) / 2 / abs(self.value)

    @property
    def precise(self) -> bool:
        """Whether the interval is as narrow as the tolerance asks, at :data:`CONFIDENCE`."""
        return not self.short_of_confidence and self.half_width <= self.tolerance

    def judge(self, target: float, direction: str = ">=") -> str:
        """"met", "not met" or "inconclusive" (the interval straddles `target`) for `direction`."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction {direction!r}: use one of {DIRECTIONS}")
        if self.short_of_confidence:
            return "inconclusive"
        low = -math.inf if self.low is None else self.low
        high = math.inf if self.high is None else self.high
        if direction == ">=":
            return "met" if low >= target else "not met" if high < target else "inconclusive"
        return "met" if high <= target else "not met" if low > target else "inconclusive"

    @property
    def verdict(self) -> str | None:
        """The verdict against the figure's own target (None without one)."""
        return None if self.target is None else self.judge(self.target, self.direction)

    def _digits(self) -> int:
        """Decimals enough that a bound the verdict turns on does not print as the target (a bound
        of 1.0964 read "1.10" beside "not met (>= 1.10)")."""
        if self.target is None:
            return 2
        scale = 1e3 if self.unit == "s" else 1.0
        for digits in (2, 3, 4, 5, 6):
            shown = {round(b * scale, digits) for b in (self.low, self.high)
                     if b is not None and b != self.target}
            if round(self.target * scale, digits) not in shown:
                return digits
        return 6

    def _number(self, x: float | None, digits: int = 2) -> str:
        if x is None:
            return "?"
        return f"{x * 1e3:.{digits}f}" if self.unit == "s" else f"{x:.{digits}f}"

    @property
    def coverage_note(self) -> str:
        """What follows an interval short of :data:`CONFIDENCE`: its coverage (" 88%"); else ""."""
        return f" {self.coverage:.0%}" if self.short_of_confidence and self.coverage is not None else ""

    def percent_cell(self, missing: str = "?") -> str:
        """A relative figure as a table cell: ``+3.1% [+1.0%, +4.2%]`` (an unbounded side: `missing`),
        with the coverage of an interval short of :data:`CONFIDENCE`."""
        def pct(x: float | None) -> str:
            return missing if x is None else f"{x:+.1%}"
        return f"{pct(self.value)} [{pct(self.low)}, {pct(self.high)}]{self.coverage_note}"

    def _interval(self) -> str:
        d = self._digits()
        return f"[{self._number(self.low, d)}, {self._number(self.high, d)}]{self.coverage_note}"

    def markdown(self) -> str:
        """One line: ``1.07x [1.03, 1.11] (n=12 rounds, host fast 21%) — met (>= 1.00)``; an
        interval short of :data:`CONFIDENCE` (3 to 5 rounds) says its coverage: ``[0.92, 1.05] 75%``."""
        unit = " ms" if self.unit == "s" else self.unit
        host = "" if self.host_fast is None else f", host fast {self.host_fast:.0%}"
        per = self.per if self.rounds != 1 else self.per.rstrip("s")
        text = f"{self._number(self.value)}{unit} {self._interval()} (n={self.rounds} {per}{host})"
        if self.target is not None:
            text += f" — {self.verdict} ({self.direction} {self._number(self.target, self._digits())})"
        return text

    def cell(self) -> str:
        """A table cell: ``1.07x [1.03, 1.11]``, and the verdict where there is a target."""
        unit = " ms" if self.unit == "s" else self.unit
        text = f"{self._number(self.value)}{unit} {self._interval()}"
        return text + (f" {self.verdict}" if self.target is not None else "")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict, "half_width": (
            None if math.isinf(self.half_width) else self.half_width)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Figure:
        """The figure `to_json` wrote; one written before coverages were recorded gets its range's
        (a bootstrap's stays unknown)."""
        names = set(cls.__dataclass_fields__)
        known = {k: v for k, v in data.items() if k in names}
        if known.get("coverage") is None and str(known.get("interval", "")).startswith("range of"):
            known["coverage"] = 1 - 2.0 ** (1 - int(known["rounds"]))
        return cls(**known)


@dataclass(frozen=True)
class Comparison:
    """A paired ratio per round: time of `numerator` / time of `denominator` (a speedup of B over A
    is ``Comparison(name, "A", "B")``), its target and the relative half-width it must reach."""

    name: str
    numerator: str
    denominator: str
    target: float | None = None
    direction: str = ">="
    tolerance: float = 0.02

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"comparison {self.name!r}: direction {self.direction!r}, use one of "
                             f"{DIRECTIONS}")
        if self.tolerance <= 0:
            raise ValueError(f"comparison {self.name!r}: tolerance must be > 0, got {self.tolerance}")


@dataclass(frozen=True)
class StopRule:
    """When rounds stop: every interval within its tolerance (after `min_rounds`), `max_rounds`,
    or `budget_s` seconds since the first round began. `tolerance` applies to the per-configuration
    times (the comparisons carry their own)."""

    min_rounds: int = 5
    max_rounds: int = 60
    budget_s: float = 60.0
    tolerance: float = 0.02

    def __post_init__(self) -> None:
        if not 1 <= self.min_rounds <= self.max_rounds:
            raise ValueError(f"need 1 <= min_rounds <= max_rounds, got {self.min_rounds}, "
                             f"{self.max_rounds}")
        if self.budget_s <= 0:
            raise ValueError(f"budget_s must be > 0, got {self.budget_s}")


#: Rounds :func:`another_round` keeps even when its time budget is spent (its intervals need them).
MIN_ROUNDS = 2


def another_round(done: int, asked: int, elapsed_s: float, budget_s: float | None) -> bool:
    """Whether rounds of minutes each (the validations': a calibration and every configuration per
    round), `done` of `asked` run in `elapsed_s` seconds, start another one: always up to
    :data:`MIN_ROUNDS`, otherwise only where one more round of the mean length so far ends within
    `budget_s` (None: no budget). Unlike :class:`StopRule`'s budget, which ends rounds once it is
    spent, this one is never overrun by a whole round: on a host whose speed drifts by a third over
    minutes, a fixed number of such rounds ran out of its wall-clock limit in a slow hour."""
    if done >= asked:
        return False
    if done < MIN_ROUNDS or budget_s is None:
        return True
    return elapsed_s + elapsed_s / done <= budget_s


def item_fits(elapsed_s: float, expected_s: float, budget_s: float | None) -> bool:
    """Whether an item of a round (a configuration's run, with its model's calibration where it is
    the round's first) expected to take `expected_s` seconds, started `elapsed_s` into `budget_s`
    (None: no budget), ends within it. The validations check it before every item of every round
    after the first, the rounds :func:`another_round` always starts included, and end that round
    there: in a slow hour a second round of minutes ran past the wall-clock limit its caller runs
    under (``make results``), and the part's results were lost with it. The configurations it
    leaves out keep the rounds they had (each row says how many)."""
    return budget_s is None or elapsed_s + expected_s <= budget_s


def round_order(names: Sequence[str], index: int, seed: int | None = None) -> list[str]:
    """The order of round `index`: `names` rotated by the round's index (each runs first equally
    often), or with a `seed` shuffled (the same seed and index: the same order in every process)."""
    if seed is not None:
        return random.Random(seed * 1_000_003 + index).sample(list(names), len(names))
    k = index % max(1, len(names))
    return [*names[k:], *names[:k]]


@dataclass
class Measurement:
    """What :class:`Rounds` gives: the comparisons' figures, each configuration's time, and how
    the rounds ended."""

    figures: dict[str, Figure]
    times: dict[str, Figure]
    rounds: int
    stopped: str                          # "within tolerance" | "max rounds" | "time budget"
    seconds: float
    host_fast: float | None

    def markdown(self) -> str:
        """One line per figure, the comparisons first."""
        return "\n".join(f"- {f.name}: {f.markdown()}"
                         for f in [*self.figures.values(), *self.times.values()])

    def to_json(self) -> dict[str, Any]:
        return {"figures": {k: f.to_json() for k, f in self.figures.items()},
                "times": {k: f.to_json() for k, f in self.times.items()}, "rounds": self.rounds,
                "stopped": self.stopped, "seconds": self.seconds, "host_fast": self.host_fast}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Measurement:
        return cls({k: Figure.from_json(f) for k, f in data["figures"].items()},
                   {k: Figure.from_json(f) for k, f in data["times"].items()}, data["rounds"],
                   data["stopped"], data["seconds"], data["host_fast"])


class Rounds:
    """The round loop's bookkeeping, for callers that run the rounds themselves (e.g. inside stage
    processes): ``order()``, run them, ``record(times)``, until ``done()``; then ``result()``."""

    def __init__(self, names: Sequence[str], comparisons: Sequence[Comparison] = (),
                 rule: StopRule = StopRule(), *, seed: int = 0, shuffle: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        unknown = sorted({n for c in comparisons for n in (c.numerator, c.denominator)} - set(names))
        if unknown:
            raise ValueError(f"comparisons name configurations {unknown} that are not measured: "
                             f"measure them or compare among {list(names)}")
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"configurations must be distinct and at least one, got {list(names)}")
        self.names, self.comparisons, self.rule, self.seed = list(names), list(comparisons), rule, seed
        self.shuffle, self.clock = shuffle, clock
        self.times: dict[str, list[float]] = {n: [] for n in names}
        self.host: list[float] = []
        self.start = clock()
        self.stopped = ""

    @property
    def count(self) -> int:
        return len(self.times[self.names[0]])

    def order(self) -> list[str]:
        return round_order(self.names, self.count, self.seed if self.shuffle else None)

    def record(self, times: Mapping[str, float], host_fast: float | None = None) -> None:
        missing = set(self.names) - set(times)
        if missing:
            raise ValueError(f"round {self.count} lacks the times of {sorted(missing)}")
        for n in self.names:
            self.times[n].append(float(times[n]))
        if host_fast is not None:
            self.host.append(float(host_fast))

    def ratios(self, c: Comparison) -> list[float]:
        return [a / b for a, b in zip(self.times[c.numerator], self.times[c.denominator])]

    def figures(self) -> tuple[dict[str, Figure], dict[str, Figure]]:
        fast = statistics.fmean(self.host) if self.host else None
        comps = {c.name: Figure.of(c.name, self.ratios(c), target=c.target, direction=c.direction,
                                   tolerance=c.tolerance, host_fast=fast)
                 for c in self.comparisons}
        times = {n: Figure.of(n, t, unit="s", tolerance=self.rule.tolerance, host_fast=fast)
                 for n, t in self.times.items()}
        return comps, times

    def _judged(self) -> list[Figure]:
        """What the stop rule looks at: the comparisons, or without any, the times."""
        if self.comparisons:
            return [Figure.of(c.name, self.ratios(c), tolerance=c.tolerance)
                    for c in self.comparisons]
        return [Figure.of(n, t, unit="s", tolerance=self.rule.tolerance)
                for n, t in self.times.items()]

    def done(self) -> bool:
        """Whether to stop now (and why, in :attr:`stopped`)."""
        if self.count >= self.rule.max_rounds:
            self.stopped = "max rounds"
        elif self.clock() - self.start >= self.rule.budget_s and self.count >= 1:
            self.stopped = "time budget"
        elif self.count >= self.rule.min_rounds:
            if all(f.precise for f in self._judged()):
                self.stopped = "within tolerance"
        return bool(self.stopped)

    def result(self) -> Measurement:
        comps, times = self.figures()
        return Measurement(comps, times, self.count, self.stopped or "stopped by the caller",
                           self.clock() - self.start,
                           statistics.fmean(self.host) if self.host else None)

    def status(self) -> str:
        """A one-line progress report."""
        comps, _ = self.figures() if self.count else ({}, {})
        shown = "; ".join(f"{f.name} {f.markdown()}" for f in list(comps.values())[:3])
        return f"round {self.count}, {self.clock() - self.start:.0f} s" + (f": {shown}" if shown else "")


class Progress:
    """Progress lines: on a terminal, one line rewritten after each round; otherwise a plain line
    at least every `interval` seconds (from a daemon thread, so a long round does not silence it)."""

    def __init__(self, label: str, stream: TextIO | None = None, interval: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.stream, self.interval, self.clock = label, stream or sys.stdout, interval, clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.line = "starting"
        self.last = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, line: str) -> None:
        self.line = line
        if self.tty:
            self.stream.write(f"\r{self.label}: {line}\x1b[K")
            self.stream.flush()
        else:
            self.tick()

    def tick(self) -> None:
        """Print the latest line if `interval` seconds passed since the last one (not on a tty)."""
        now = self.clock()
        if not self.tty and now - self.last >= self.interval:
            self.last = now
            print(f"{self.label}: {self.line}", file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        if not self.tty:
            def beat() -> None:
                while not self._stop.wait(min(1.0, self.interval)):
                    self.tick()
            self._thread = threading.Thread(target=beat, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.tty:
            self.stream.write("\n")


def measure(configs: Mapping[str, Callable[[], float]], comparisons: Sequence[Comparison] = (),
            rule: StopRule = StopRule(), *, seed: int = 0, shuffle: bool = False,
            host_probe: Callable[[], float] | None = None, label: str = "measuring",
            progress: Progress | None = None,
            clock: Callable[[], float] = time.monotonic) -> Measurement:
    """Run `configs` (name -> one run, returning its seconds) in alternating rounds until `rule`
    stops them; the comparisons' figures and each configuration's time. `host_probe` (default
    :func:`gpipe_repro.report.host.fast_share`) is read once per round."""
    if host_probe is None:
        from gpipe_repro.report.host import fast_share
        host_probe = fast_share
    rounds = Rounds(list(configs), comparisons, rule, seed=seed, shuffle=shuffle, clock=clock)
    shown = progress or Progress(label, clock=clock)
    with shown if progress is None else contextlib.nullcontext():
        while not rounds.done():
            times = {name: configs[name]() for name in rounds.order()}
            rounds.record(times, host_probe())
            shown.update(rounds.status())
    return rounds.result()


def measure_time(name: str, run: Callable[[], float], rule: StopRule = StopRule(), **kw: Any) -> Figure:
    """One configuration alone: the median and interval of its time (an absolute figure)."""
    return measure({name: run}, (), rule, **kw).times[name]
