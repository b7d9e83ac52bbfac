"""Every code block of README.md and docs/*.md runs as written.

Each ```python block is written to a file and run as a script in a fresh interpreter (so a block that
starts processes under ``if __name__ == "__main__":`` runs as a user's script would), with this
checkout's gpipe_repro first on the path. Shell lines of the other blocks, and inline code that starts
with `make ` or `gpipe-repro `, get cheap checks only, nothing run but `--help`: every `make X` names a
target of the Makefile and every `VAR=` given to make a variable it reads; every `gpipe-repro CMD [SUB]`
names a command whose `--help` exits with 0, and each of its `--flag`s is an option its `--help` lists
(or, for `fit`, `plan`, `plan-replicas` and `models`, a size option of the model named).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# this checkout's gpipe_repro, whatever the venv's editable install points at
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(page: Path) -> list[tuple[str, str]]:
    return BLOCK.findall(page.read_text())


PYTHON_BLOCKS = [(page, i, body) for page in PAGES
                 for i, body in enumerate(body for lang, body in _blocks(page) if lang == "python")]
SHELL_LINES = [(page, line.split("#")[0].strip()) for page in PAGES for lang, body in _blocks(page)
               if lang in ("", "bash", "sh", "shell")
               for line in re.sub(r"\\\n\s*", " ", body).splitlines()]   # a line continued by \ is one
SHELL_LINES = [(page, line) for page, line in SHELL_LINES if line]
# inline code outside the blocks that reads as a command (`make results ONLY=...`, `gpipe-repro plan ...`)
INLINE_COMMANDS = [(page, " ".join(span.split())) for page in PAGES
                   for span in re.findall(r"`([^`]+)`", BLOCK.sub("", page.read_text()))
                   if span.startswith(("make ", "gpipe-repro "))]
COMMAND_LINES = SHELL_LINES + INLINE_COMMANDS


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_readme_is_short_and_has_blocks() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 150, "the README is a front page: 150 lines at most"
    assert sum(page == readme for page, _, _ in PYTHON_BLOCKS) >= 3
    assert any(page == readme and line.startswith("make ") for page, line in SHELL_LINES)


@pytest.mark.parametrize("page, index, block", PYTHON_BLOCKS,
                         ids=[f"{_name(p)}-python-{i}" for p, i, _ in PYTHON_BLOCKS])
def test_python_block_runs(page: Path, index: int, block: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**ENV, "GPIPE_REPRO_CACHE": str(tmp_path / "cache")})
    first = next(line for line in block.splitlines() if line and not line.startswith(("import", "from")))
    assert done.returncode == 0, (f"{_name(page)}, python block {index} ({first!r}) failed:\n"
                                  f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def test_make_targets_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):(?!=)", makefile, re.MULTILINE))
    named = {(_name(page), word) for page, line in COMMAND_LINES
             for word in re.findall(r"(?:^|\s)make ([\w-]+)(?=\s|$)", line)}
    missing = sorted((page, t) for page, t in named if t not in targets)
    assert not missing, f"pages name make targets the Makefile lacks: {missing}"
    # a variable given to make (`make results ONLY=...`; not the environment before `make`)
    variables = (set(re.findall(r"^(\w+)\s*[:?+]?=", makefile, re.MULTILINE))
                 | set(re.findall(r"\$\((\w+)\)", makefile)))
    given = {(_name(page), var) for page, line in COMMAND_LINES if re.search(r"(?:^|\s)make\s", line)
             for var in re.findall(r"(?:^|\s)(\w+)=", re.split(r"(?:^|\s)make\s", line, maxsplit=1)[1])}
    unknown = sorted((page, v) for page, v in given if v not in variables)
    assert not unknown, f"pages give make variables the Makefile never reads: {unknown}"


def test_links_resolve() -> None:
    """Every relative link of the pages points at a file or folder of the checkout."""
    broken = [(_name(page), target) for page in PAGES
              for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert not broken, f"broken links: {broken}"


def test_experiment_scripts_exist() -> None:
    named = {(_name(page), m) for page, line in SHELL_LINES
             for m in re.findall(r"python -m experiments\.(\w+)", line)}
    missing = sorted((page, m) for page, m in named if not (ROOT / "experiments" / f"{m}.py").exists())
    assert named and not missing, f"pages name experiments that do not exist: {missing}"


GPIPE_COMMANDS = sorted({tuple(w for w in line.split()[1:3] if not w.startswith("-"))
                         for _, line in COMMAND_LINES if line.startswith("gpipe-repro ")})
GPIPE_LINES = sorted({(_name(page), line) for page, line in COMMAND_LINES if line.startswith("gpipe-repro ")})
# commands that pass the options they do not take themselves to the model (its size options)
MODEL_OPTION_COMMANDS = {"fit", "plan", "plan-replicas", "models"}


@pytest.mark.parametrize("command", GPIPE_COMMANDS, ids=[" ".join(c) for c in GPIPE_COMMANDS])
def test_gpipe_repro_command_exists(command: tuple[str, ...]) -> None:
    """`gpipe-repro CMD [SUB] --help` exits with 0 (SUB is checked only where CMD is a group)."""
    from typer.testing import CliRunner

    from gpipe_repro.cli import app

    done = CliRunner().invoke(app, [*command[:1], "--help"])
    assert done.exit_code == 0, f"gpipe-repro {command[0]} --help: {done.output[-2000:]}"
    if len(command) > 1 and "Commands" in done.output:
        done = CliRunner().invoke(app, [*command, "--help"])
        assert done.exit_code == 0, f"gpipe-repro {' '.join(command)} --help: {done.output[-2000:]}"


def _unknown_flags(words: list[str]) -> list[str]:
    """The `--flag`s of `gpipe-repro WORDS...` that the command (found by its words) does not list."""
    import typer

    from gpipe_repro.cli import app

    command = typer.main.get_command(app)        # typer's own click: groups are known by .commands
    path = []
    while words and words[0] in getattr(command, "commands", {}):
        path.append(words[0])
        command = command.commands[words.pop(0)]
    if words and not path and not words[0].startswith("-"):
        return [f"{words[0]}: no such command"]
    own = {opt: p for p in command.params if p.param_type_name == "option" and not p.hidden
           for opt in (*p.opts, *p.secondary_opts)} | {"--help": None}
    unknown, extra, positional = [], [], []
    i = 0
    while i < len(words):
        word = words[i]
        name = word.split("=")[0]
        if word == "..." or not word.startswith("-"):
            positional.append(word)
        elif name in own:
            p = own[name]
            if p is not None and not p.is_flag and "=" not in word:
                i += 1                             # its value
        elif path[:1] and path[0] in MODEL_OPTION_COMMANDS and name.startswith("--"):
            extra += [word] if "=" in word else words[i:i + 2]
            i += "=" not in word
        else:
            unknown.append(name)
        i += 1
    if extra:                                      # the model's own sizes, checked by resolving it
        from gpipe_repro.commands._hf_models import hf_workload, is_hf_model
        from gpipe_repro.commands.models import parse_options
        from gpipe_repro.memory.workloads import workload
        from gpipe_repro.models import get_family

        family = positional[0]
        sizes = parse_options(extra)
        try:
            if is_hf_model(family):
                hf_workload(family, None, sizes)
            elif path[0] == "models":
                known = get_family(family).options()
                unknown += [f"--{k.replace('_', '-')}" for k in sorted(set(sizes) - set(known))]
            else:
                workload(family, None, **sizes)
        except ValueError as e:
            unknown.append(f"{' '.join(extra)} ({e})")
    return unknown


def test_gpipe_repro_flags_exist() -> None:
    """Every `--flag` of a `gpipe-repro` line is an option its command's `--help` lists: a renamed or
    removed option fails here, not in a reader's shell."""
    bad = [(page, line, flags) for page, line in GPIPE_LINES
           if (flags := _unknown_flags(line.split()[1:]))]
    assert not bad, "pages give gpipe-repro options the commands do not take:\n" + "\n".join(map(str, bad))


def _readme_results_rows() -> list[str]:
    """README's Table 2 and Table 3 rows, from results/throughput/throughput_table.json."""
    import json

    data = json.loads((ROOT / "results/throughput/throughput_table.json").read_text())
    names = {"amoebanet": ("AmoebaNet-D", "AmoebaNet-D"), "transformer": ("Transformer-48", "Transformer-24")}
    picks = {"amoebanet": (2, 8), "transformer": (2, 4, 8)}
    rows = []
    for model, ks in picks.items():
        for r in data["table2"][model]:
            if r["M"] == 32 and r["K"] in ks:
                fig = (r.get("measured") or {}).get("normalized_figure")
                measured = f"{fig['value']:.2f} [{fig['low']:.2f}, {fig['high']:.2f}]" if fig else ""
                if fig and fig.get("coverage") is not None and fig["coverage"] < 0.95:
                    measured += f" {fig['coverage']:.0%}"      # a range of rounds, and its coverage
                rows.append(f"| {names[model][0]} | {r['K']} | 32 | {r['simulated']['normalized']:.2f} | "
                            f"{measured} | {r['flop_model']['normalized']:.2f} | {r['paper']:.2f} |"
                            .replace("|  |", "| |"))
    for model in picks:
        r = next(r for r in data["table3"][model] if r["K"] == 8 and r["M"] == 32)
        rows.append(f"| {names[model][1]} | 8 | {r['simulated']['normalized']:.2f} | "
                    f"{r['flop_model']['normalized']:.2f} | {r['paper']:.2f} |")
    return rows


def test_the_readmes_results_are_the_pages_of_record() -> None:
    """README's Table 2 and 3 rows are the page of record's, checked against its JSON, so that a
    regenerated table cannot leave the front page behind."""
    lines = (ROOT / "README.md").read_text().splitlines()
    for row in _readme_results_rows():
        assert row in lines, f"README.md lacks {row!r}: copy it from results/throughput/throughput_table.json"
