"""Causal language modelling with a Hugging Face decoder-only model, for the shared run loop.

What the loop gets from here:

- **Model.** A transformers ``*ForCausalLM`` of any family of :data:`gpipe_repro.train.hf_spec.FAMILIES`
  (random init, nothing downloaded) at tiny sizes (:func:`gpipe_repro.train.hf_spec.tiny_config`,
  each size can be changed), or from a ``config.json``; taken apart into the pipeline's layers by
  :func:`gpipe_repro.models.hf.causal_lm_layers` (embeddings, one layer per decoder block, head),
  which checks that the layers compute the model's own logits before training starts. Tied
  embeddings stay tied (the first and last layer share the matrix).
- **Data.** Byte-level ids of an offline text packed into rows of ``seq_len``
  (:mod:`gpipe_repro.train.tasks.packed_bytes`): by default the English sentences of the offline
  gettext corpus (its train split for training, its valid split held out; built on first use, as
  `run transformer` does), or any UTF-8 file (``text``: one document per line, every 20th held out).
- **Loss.** :class:`gpipe_repro.models.hf.CausalLMLoss`, transformers' own (labels shifted by one,
  -100 ignored) as ``(sum, count)``: the step's loss is the mean over every counted token of the
  mini-batch, whatever M and however the padding falls.
- **Optimizer.** AdamW (betas 0.9, 0.95), linear warm-up then cosine decay.
- **Evaluation.** Loss per byte on the held-out rows (pipelined forward) and bits per byte.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.engine.stage import LossFn
from gpipe_repro.train.config import RunConfig
from gpipe_repro.train.hf_spec import (
    ConfigError,
    causal_lm_layers_of,
    describe,
    family_has,
    model_config,
    model_type,
    tiny_config,
)
from gpipe_repro.train.loop import Task, pipelined_outputs
from gpipe_repro.train.optim import OptimizerConfig
from gpipe_repro.train.tasks.packed_bytes import VOCAB, PackedBatches, pack

HELD_OUT_EVERY = 20      # of a text file's lines, every 20th is held out


@dataclasses.dataclass
class CausalLMConfig:
    """What the causal-LM task trains, on which text, with which recipe."""

    # -- model: a family at tiny sizes (each size may be given), or a config.json
    family: str = "llama"
    config_file: str | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    intermediate: int | None = None
    tie_embeddings: bool | None = None      # None: the family's (or the file's) own choice
    # -- data
    seq_len: int = 128
    text: str | None = None                 # a UTF-8 file; None: the gettext corpus's English side
    corpus: str = "gettext"
    data_dir: str | None = None
    # -- recipe
    lr: float = 3e-3
    warmup_steps: int | None = None         # None: a tenth of the steps, at most 30
    weight_decay: float = 0.1
    eval_rows: int = 64                     # held-out rows scored per evaluation

    def __post_init__(self) -> None:
        model_type(self.family)             # an unknown family is refused here, before any work
        checks = [(self.seq_len >= 2, f"--seq-len must be >= 2, got {self.seq_len}"),
                  (self.lr > 0, f"lr must be > 0, got {self.lr}"),
                  (self.warmup_steps is None or self.warmup_steps >= 0,
                   f"--warmup-steps must be >= 0, got {self.warmup_steps}"),
                  (self.eval_rows >= 1, f"eval_rows must be >= 1, got {self.eval_rows}")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.text is not None and not Path(self.text).is_file():
            raise FileNotFoundError(f"--text {self.text}: no such file; give a UTF-8 text file (one "
                                    "document per line), or leave --text out for the offline corpus")

    def sizes(self) -> dict[str, int]:
        """The sizes given (the rest keep the tiny or the file's values)."""
        return {k: v for k, v in (("layers", self.layers), ("hidden", self.hidden), ("heads", self.heads),
                                  ("kv_heads", self.kv_heads), ("intermediate", self.intermediate))
                if v is not None}

    def model_config(self) -> Any:
        """The transformers config of the model this task trains (checked: a ConfigError says what
        to change)."""
        tie = {} if self.tie_embeddings is None else {"tie": self.tie_embeddings}
        if self.config_file is not None:
            config = model_config(self.config_file, **self.sizes(), **tie)
            if config.vocab_size < VOCAB:
                raise ConfigError(f"{self.config_file}: vocabulary {config.vocab_size} is smaller than the "
                                  f"{VOCAB} byte-level ids this task feeds: give a config with a "
                                  f"vocab_size of at least {VOCAB}")
        else:   # positions for the rows, in a family with learned positions (BLOOM's ALiBi has none)
            config = tiny_config(self.family, vocab=VOCAB, **self.positions_of(self.family), **self.sizes(),
                                 **tie)
        positions = getattr(config, "max_position_embeddings", None)
        if positions is not None and positions < self.seq_len:
            raise ConfigError(f"--seq-len {self.seq_len} is longer than the model's {positions} positions: "
                              "lower --seq-len")
        return config

    def layer_count(self) -> int:
        """How many layers the model has, without the data (built on the meta device: no weights)."""
        with torch.device("meta"):
            return len(causal_lm_layers_of(self.model_config()))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def positions_of(self, family: str) -> dict[str, int]:
        """``{"positions": ...}`` for rows of seq_len, where `family` has a position count."""
        return {"positions": max(256, self.seq_len)} if family_has(family, "positions") else {}

    def sizes_of(self, family: str | None) -> CausalLMConfig:
        """A copy keeping only the sizes `family` has (a preset's sizes are for every family: Falcon
        has no intermediate width to set, and keeps its own); None keeps this config's family."""
        lacks: dict[str, Any] = {k: None for k in self.sizes() if not family_has(family or self.family, k)}
        return dataclasses.replace(self, **lacks)

    def replace(self, **changes: Any) -> CausalLMConfig:
        """A copy with `changes` (None values are ignored: "not given on the command line")."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def text_documents(path: str) -> tuple[list[str], list[str]]:
    """(training documents, held-out documents) of a UTF-8 file: its non-empty lines, every
    :data:`HELD_OUT_EVERY`-th held out."""
    try:
        lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    lines = [line for line in lines if line]
    held = [line for i, line in enumerate(lines) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [line for i, line in enumerate(lines) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    if not train or not held:
        raise ValueError(f"--text {path} has {len(lines)} non-empty lines; it needs at least "
                         f"{HELD_OUT_EVERY} (every {HELD_OUT_EVERY}th is held out for evaluation)")
    return train, held


def corpus_documents(corpus: str, data_dir: str | None) -> tuple[list[str], list[str]]:
    """(training, held-out) English sentences of a translation corpus (its train and valid splits'
    targets, each sentence once, in sorted order)."""
    from gpipe_repro.data.corpus_readers import read_split
    from gpipe_repro.train.tasks.translation_corpus import prepare_corpus
    directory = prepare_corpus(corpus, data_dir)

    def english(split: str) -> list[str]:
        return sorted({target for pairs in read_split(directory, split).values() for _, target in pairs})
    return english("train"), english("valid")


class CausalLMTask(Task):
    """A Hugging Face causal LM on byte-level text (see the module docstring)."""

    name = "causal-lm"
    resolved_in = {**{size: "model" for size in ("layers", "hidden", "heads", "kv_heads", "intermediate")},
                   "tie_embeddings": "tied_embeddings"}
    lower_is_better = ("loss", "bits_per_byte")

    def __init__(self, config: CausalLMConfig) -> None:
        self.settings = config
        self.model_config = config.model_config()           # a bad size fails before the data work
        with torch.device("meta"):                           # a family the layers refuse, too
            causal_lm_layers_of(self.model_config)
        if config.text is not None:
            self.source = f"text {config.text}"
            train, held = text_documents(config.text)
        else:
            self.source = f"the English sentences of corpus {config.corpus}"
            train, held = corpus_documents(config.corpus, config.data_dir)
        self.train_rows = pack(train, config.seq_len)
        eval_rows = pack(held, config.seq_len)
        self.eval_rows = tuple(t[:config.eval_rows] for t in eval_rows)
        self.documents = (len(train), len(held))

    def describe_data(self) -> str:
        rows = self.train_rows[0].shape[0]
        tokens, length = int(self.train_rows[1].sum()), self.settings.seq_len
        return (f"byte-level ids of {self.source}: {self.documents[0]:,} documents in {rows:,} rows of "
                f"{length} ({tokens:,} bytes, {tokens / max(1, rows * length):.0%} of the rows); "
                f"{self.eval_rows[0].shape[0]} held-out rows scored (of "
                f"{self.documents[1]:,} held-out documents)")

    def config(self) -> dict[str, Any]:
        return {**self.settings.to_dict(), "model": describe(self.model_config),
                "tied_embeddings": bool(getattr(self.model_config, "tie_word_embeddings", False)),
                "data": self.data_fingerprint()}

    def data_fingerprint(self) -> str:
        """What the training rows hold, so a resume notices a text edited under the same path:
        their count and the SHA-1 of their bytes."""
        digest = hashlib.sha1()
        for t in self.train_rows:
            digest.update(t.contiguous().numpy().tobytes())
        return f"{self.train_rows[0].shape[0]} rows, sha1 {digest.hexdigest()[:16]}"

    def build_layers(self) -> nn.Sequential:
        return causal_lm_layers_of(self.model_config)

    def loss_fn(self) -> LossFn:
        from gpipe_repro.models.hf import CausalLMLoss
        return CausalLMLoss()

    def export_model(self, checkpoint: Path, out: Path, replace: Collection[str] = ()) -> Path:
        from gpipe_repro.train.hf_export import export_checkpoint
        return export_checkpoint(self.model_config, checkpoint, out, replace)

    def train_batches(self, batch_size: int, seed: int) -> PackedBatches:
        return PackedBatches(self.train_rows, batch_size, seed)

    def optimizer_config(self, *, total_steps: int, steps_per_epoch: int,
                         batch_size: int) -> OptimizerConfig:
        s = self.settings
        if s.warmup_steps is not None and s.warmup_steps >= total_steps:
            raise ValueError(f"--warmup-steps {s.warmup_steps} leaves no step for the cosine decay of a "
                             f"{total_steps}-step run: give fewer warm-up steps or more --steps")
        # given: as given; else a tenth of the run, at most 30
        warmup = s.warmup_steps if s.warmup_steps is not None else min(30, total_steps // 10)
        return OptimizerConfig(name="adamw", lr=s.lr, betas=(0.9, 0.95), adam_eps=1e-8,
                               weight_decay=s.weight_decay, schedule="cosine", warmup_steps=warmup,
                               total_steps=total_steps)

    def sample_batch(self, batch_size: int) -> tuple[Any, Any]:
        return next(PackedBatches(self.train_rows, batch_size, 0))

    def memory_planner(self, batch_size: int) -> Any:
        from gpipe_repro.memory.planner import MemoryPlanner
        from gpipe_repro.memory.profile import adamw_foreach
        from gpipe_repro.models.hf import CausalLMLoss
        with torch.device("meta"):        # shapes only: the planner copies the layers as fakes
            layers = causal_lm_layers_of(self.model_config)
        inputs, targets = self.sample_batch(batch_size)
        return MemoryPlanner(list(layers), inputs, targets, CausalLMLoss(), optimizer=adamw_foreach)

    def memory_advice(self) -> str:
        return (f"lower --seq-len ({self.settings.seq_len}) or --batch-size, raise --m, or give "
                "--checkpoint always; `gpipe-repro fit hf:<family> --seq-len ...` shows what fits")

    @torch.no_grad()
    def evaluate(self, pipe: GPipe) -> dict[str, float]:
        from gpipe_repro.models.hf import CausalLMLoss
        ids, mask, labels = self.eval_rows
        size = 16
        batches = [(ids[i:i + size], mask[i:i + size]) for i in range(0, ids.shape[0], size)]
        loss, total, count = CausalLMLoss(), 0.0, 0
        for start, logits in zip(range(0, ids.shape[0], size), pipelined_outputs(pipe, iter(batches))):
            summed, counted = loss(logits, labels[start:start + size].to(logits.device))
            total, count = total + float(summed), count + int(counted)
        nll = total / max(1, count)
        return {"loss": nll, "bits_per_byte": nll / math.log(2)}


# ----------------------------------------------------------------------------- presets

PRESETS: dict[str, str] = {
    "cpu": "a 2-layer LLaMA (hidden 64) on the gettext corpus's English sentences, byte-level, rows of "
           "128, K=2, M=4, 300 steps of 16 rows",
    "smoke": "a 2-layer LLaMA (hidden 32), rows of 32, K=2, M=2, 4 steps of 4 rows: checks that "
             "everything runs",
}


def preset(name: str) -> tuple[RunConfig, CausalLMConfig]:
    """The run and task settings of a named preset (options given on the command line override them)."""
    if name == "cpu":
        return (RunConfig(name="causal-lm-cpu", partitions=2, micro_batches=4, batch_size=16, steps=300,
                          checkpoint="never", eval_every=100, save_every=100, timeline_every=50, threads=1),
                CausalLMConfig())
    if name == "smoke":
        return (RunConfig(name="causal-lm-smoke", partitions=2, micro_batches=2, batch_size=4, steps=4,
                          checkpoint="never", eval_every=2, save_every=2, timeline_every=2, threads=1),
                CausalLMConfig(hidden=32, heads=2, intermediate=64, seq_len=32, eval_rows=8,
                               lr=1e-2, warmup_steps=0))
    raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
