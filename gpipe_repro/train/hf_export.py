"""A `run causal-lm` checkpoint as a transformers model folder, which ``from_pretrained`` loads.

A run's checkpoints hold the pipeline's state (``cells.<s>.<i>.…`` names, a tied weight under each
cell holding a copy). :func:`export_checkpoint` builds the run's model from its config, takes it
apart into the same layers and cut, loads the state through the pipeline (so each name lands where
training had it), and saves the model with ``save_pretrained``: ``config.json`` and the weights.
The run writes ``hf/`` in its directory when it finishes; :func:`export_run` does it for any run
directory, from its newest checkpoint::

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    model = AutoModelForCausalLM.from_pretrained("runs/causal-lm/hf")

The token ids are the task's: UTF-8 bytes and one end-of-document id
(:mod:`gpipe_repro.train.tasks.packed_bytes`); there is no tokenizer to save.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

__all__ = ["export_checkpoint", "export_run"]


def check_export_target(out: str | os.PathLike[str], replace: Collection[str] = ()) -> None:
    """Raise FileExistsError (writing nothing) unless `out` is absent, an empty directory, or a
    directory whose files are all among `replace` (names relative to `out`: an earlier export of
    the same run). ``save_pretrained`` writes over what a folder holds, and only logs, writing
    nothing, where `out` is a file: a folder of the user's is never written into."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a directory: nothing was exported; give a new or "
                              "empty directory")
    if not out.is_dir():
        return
    theirs = sorted(p.relative_to(out).as_posix() for p in out.rglob("*")
                    if not p.is_dir() and p.relative_to(out).as_posix() not in set(replace))
    if theirs:
        shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
        raise FileExistsError(f"{out} holds files an export of this run did not write ({shown}): "
                              "nothing was exported; give a new or empty directory")


def export_checkpoint(config: Any, checkpoint: str | os.PathLike[str], out: str | os.PathLike[str],
                      replace: Collection[str] = ()) -> Path:
    """The model of transformers `config` with the weights of the run `checkpoint`, saved to `out`
    (``save_pretrained``); returns `out`. `out` must be new or empty but for `replace`, the files of
    an earlier export it may write over (:func:`check_export_target`)."""
    from gpipe_repro.train.checkpoints import load_checkpoint
    check_export_target(out, replace)
    return _export(config, load_checkpoint(checkpoint), out)


def _export(config: Any, checkpoint: dict[str, Any], out: str | os.PathLike[str]) -> Path:
    """:func:`export_checkpoint` of a checkpoint already read."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from gpipe_repro import GPipe
    from gpipe_repro.models.hf import causal_lm_layers

    state = checkpoint["state"]["pipeline"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    balance = [int(n) for n in state["balance"]]
    pipe = GPipe(causal_lm_layers(model, check=False), partitions=len(balance), balance=balance,
                 optimizer=None)
    pipe.load_state_dict(state["model"])     # into the model's own modules (a tie's first holder)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()        # one small file: no bar among the run's lines
    try:
        model.save_pretrained(out)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return Path(out)


def export_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """The newest checkpoint of the `run causal-lm` run in `run_dir` as a transformers model folder
    (default: ``run_dir/hf``, where it may replace the run's own export, as its manifest lists it;
    elsewhere `out` must be new or an empty directory); returns its path."""
    from gpipe_repro.report.records import read_json
    from gpipe_repro.train.checkpoints import load_latest_checkpoint
    from gpipe_repro.train.run_dir import run_owner
    from gpipe_repro.train.tasks.causal_lm import CausalLMConfig

    run_dir = Path(run_dir)
    record = read_json(run_dir / "run.json").get("config", {}) if (run_dir / "run.json").is_file() else {}
    if record.get("task_name") != "causal-lm":
        raise ValueError(f"{run_dir} is not a `gpipe-repro run causal-lm` run directory (its run.json "
                         "names no causal-lm task)")
    target = Path(out) if out is not None else run_dir / "hf"
    _, listed = run_owner(run_dir)
    check_export_target(target, {f[len("hf/"):] for f in listed if f.startswith("hf/")}
                        if out is None else ())
    names = {f.name for f in dataclasses.fields(CausalLMConfig)}
    settings = CausalLMConfig(**{k: v for k, v in record["task"].items() if k in names})
    checkpoint, _ = load_latest_checkpoint(run_dir / "checkpoints", remove_leftovers=False)
    return _export(settings.model_config(), checkpoint, target)
