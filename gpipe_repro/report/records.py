"""Results are data first: atomic JSON with the environment, records that say how a number was
obtained, and markdown rendered from that data.

Why atomic. An experiment that dies halfway (Ctrl-C, out of memory, a bug in the last row) must not
leave a file that looks like a finished result. Every write goes to a temporary file in the same
directory, is flushed and fsync'ed, and only then renamed over the destination with `os.replace`
(atomic on POSIX). A reader sees the old file or the new one, never half of one.

Why records. The paper's tables mix numbers we can measure on this machine with numbers only a
simulator can give (TPU/GPU counts we do not have). A number in a results file is therefore a record:

    {"value": 3.4, "method": "measured" | "simulated", "paper": 3.5, "unit": "x"}

built with `measured(...)` / `simulated(...)` (or the `Result` dataclass). The paper's value stands
beside ours wherever the paper has one, so every table can show both.

Why the environment is embedded. A number without its torch version, device, core count and git
commit cannot be compared with anything; `write_json` adds `environment()` to every payload.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal

from gpipe_repro.engine.choices import require_one_of
from gpipe_repro.report.provenance import environment

Method = Literal["measured", "simulated"]
METHODS: tuple[str, ...] = ("measured", "simulated")


# ----------------------------------------------------------------------------- records

@dataclasses.dataclass(frozen=True)
class Result:
    """One number and how it was obtained, with the paper's value beside it when the paper has one."""

    value: float | int | None
    method: Method
    paper: float | int | None = None
    unit: str | None = None

    def __post_init__(self) -> None:
        require_one_of("method", self.method, METHODS)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"value": self.value, "method": self.method}
        if self.paper is not None:
            out["paper"] = self.paper
        if self.unit is not None:
            out["unit"] = self.unit
        return out

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Result:
        return cls(value=record["value"], method=record["method"], paper=record.get("paper"),
                   unit=record.get("unit"))

    @property
    def ratio_to_paper(self) -> float | None:
        """ours / paper, or None when there is nothing to compare."""
        if self.value is None or not self.paper:
            return None
        return float(self.value) / float(self.paper)


def measured(value: float | int | None, *, paper: float | int | None = None,
             unit: str | None = None) -> dict[str, Any]:
    """A record for a number measured on this machine."""
    return Result(_plain_number(value), "measured", _plain_number(paper), unit).to_dict()


def simulated(value: float | int | None, *, paper: float | int | None = None,
              unit: str | None = None) -> dict[str, Any]:
    """A record for a number computed by the simulator (hardware we do not have)."""
    return Result(_plain_number(value), "simulated", _plain_number(paper), unit).to_dict()


def is_record(obj: Any) -> bool:
    """True for a dict shaped like a `Result` record."""
    return isinstance(obj, Mapping) and "value" in obj and "method" in obj


def format_record(record: Mapping[str, Any] | Result, digits: int = 3, *,
                  show_paper: bool = True) -> str:
    """"3.42 (paper 3.5)" for tables; "-" for a missing value; "*" marks a simulated number."""
    result = record if isinstance(record, Result) else Result.from_dict(record)
    text = "-" if result.value is None else _format_number(result.value, digits)
    if result.method == "simulated" and result.value is not None:
        text += "*"
    if show_paper and result.paper is not None:
        text += f" (paper {_format_number(result.paper, digits)})"
    return text


# ----------------------------------------------------------------------------- atomic files

@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: Literal["w", "wb"] = "w") -> Iterator[IO[Any]]:
    """Open a temporary file next to `path`; on success fsync it and rename it over `path`.

    If the body raises (or the process dies), `path` keeps its previous content (or stays absent)
    and the temporary file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; results are for everyone
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_json(path: str | os.PathLike[str], payload: Mapping[str, Any], *,
               indent: int | None = 2) -> Path:
    """Write `payload` (plus `"environment"`) as JSON, atomically. Returns the path.

    A payload that already carries an "environment" (for example one merged from an earlier run's
    file) keeps it: the environment belongs to the measurement, not to the write.
    """
    if not isinstance(payload, Mapping):
        raise TypeError(f"write_json needs a mapping payload, got {type(payload).__name__}")
    document = dict(payload)
    document.setdefault("environment", environment())
    with atomic_write(path, "w") as f:
        # json.dump streams: a value that cannot be serialized fails midway through the temp file,
        # which atomic_write then discards.
        json.dump(document, f, indent=indent, default=_to_json)
        f.write("\n")
    return Path(path)


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_markdown(path: str | os.PathLike[str], text: str) -> Path:
    """Write markdown (or any text) atomically, ending with exactly one newline."""
    with atomic_write(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")
    return Path(path)


RESULTS_ENV = "GPIPE_REPRO_RESULTS"   # also read by train.run_dir.record_dir (an earlier layer)


def results_root() -> Path:
    """Where results go: $GPIPE_REPRO_RESULTS, else ./results (not created)."""
    return Path(os.environ.get(RESULTS_ENV) or "results")


def results_dir(experiment: str, root: str | os.PathLike[str] | None = None) -> Path:
    """`results/<experiment>/` (root from GPIPE_REPRO_RESULTS, else ./results), created."""
    base = Path(root) if root is not None else results_root()
    out = base / experiment
    out.mkdir(parents=True, exist_ok=True)
    return out


# ----------------------------------------------------------------------------- markdown

def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, digits: int = 3,
                   align: Sequence[Literal["left", "right", "center"]] | None = None) -> str:
    """A GitHub markdown table. Floats get `digits` significant digits, records render with
    `format_record`, None renders as "-". Numeric columns are right-aligned unless `align` says."""
    headers = [str(h) for h in headers]
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"row {i} has {len(row)} cells, the table has {len(headers)} headers")
    cells = [[_format_cell(c, digits) for c in row] for row in rows]
    aligns: list[Literal["left", "right", "center"]]
    if align is None:
        aligns = ["right" if rows and all(_is_numeric_cell(row[j]) for row in rows) else "left"
                  for j in range(len(headers))]
    elif len(align) != len(headers):
        raise ValueError(f"align has {len(align)} entries, the table has {len(headers)} headers")
    else:
        aligns = list(align)
    widths = [max([len(headers[j]), 3] + [len(r[j]) for r in cells]) for j in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        padded = [v.rjust(w) if a == "right" else v.ljust(w)
                  for v, w, a in zip(values, widths, aligns, strict=True)]
        return "| " + " | ".join(padded) + " |"

    rule = {"left": lambda w: "-" * w, "right": lambda w: "-" * (w - 1) + ":",
            "center": lambda w: ":" + "-" * (w - 2) + ":"}
    separator = "| " + " | ".join(rule[a](w) for a, w in zip(aligns, widths, strict=True)) + " |"
    return "\n".join([line(headers), separator, *(line(r) for r in cells)])


def _format_cell(cell: Any, digits: int) -> str:
    if cell is None:
        return "-"
    if isinstance(cell, Result) or is_record(cell):
        text = format_record(cell, digits)
    elif isinstance(cell, (int, float)) and not isinstance(cell, bool):
        text = _format_number(cell, digits)
    else:
        text = str(_plain_number(cell))
    return text.replace("|", "\\|").replace("\n", " ")


def _is_numeric_cell(cell: Any) -> bool:
    if cell is None or isinstance(cell, Result) or is_record(cell):
        return True
    return isinstance(_plain_number(cell), (int, float)) and not isinstance(cell, bool)


def _format_number(x: float | int, digits: int) -> str:
    x = _plain_number(x)
    if isinstance(x, int):
        return str(x)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x != 0 and (abs(x) >= 10**digits):
        return f"{x:.0f}"  # 12345.6 -> "12346", not "1.23e+04"
    return f"{x:.{digits}g}"


# ----------------------------------------------------------------------------- JSON conversion

def _plain_number(x: Any) -> Any:
    """numpy / torch scalars -> Python numbers; anything else unchanged."""
    if getattr(x, "ndim", None) == 0 and callable(getattr(x, "item", None)):
        return x.item()
    return x


def _to_json(obj: Any) -> Any:
    """`json.dump` fallback: records, dataclasses, paths, enums, numpy/torch values."""
    if isinstance(obj, Result):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, enum.Enum):
        return obj.name
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy arrays/scalars, torch tensors
        return obj.tolist()
    raise TypeError(f"cannot write {type(obj).__name__} to JSON: convert it to numbers/str/lists first")


def _read_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; done once, at import
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
