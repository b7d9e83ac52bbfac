"""The multilingual translation task (the paper's section 5), T(L, H, A) for the shared run loop.

What the loop gets from here:

- **Data.** The many-to-English corpus of `gpipe_repro.data.corpus_manifest` (the offline gettext
  corpus by default, built on first use; any corpus built with `gpipe-repro corpus build --source
  ...` otherwise) and a shared sentencepiece vocabulary (`data/tokenizer.py`); when the run uses a
  subset of the languages, a vocabulary is trained on that subset (cached beside the corpus), so no
  id is spent on scripts the model never reads (`translation_corpus.py`).
- **Batches.** Languages drawn by temperature (T=5), pairs bucketed by length
  (`language_sampling.train_batches`), `batch_size` SENTENCES per mini-batch
  (`translation_batches.py`, which says why sentences). Two runs with one seed see identical batches
  (so identical tokens); the mean tokens per batch is reported.
- **Loss.** Label-smoothed cross entropy summed over a micro-batch's target tokens and divided by
  the token count of the WHOLE mini-batch, which travels with the targets as a 0-dim tensor (the
  engine gives 0-dim tensors whole to every micro-batch). With ``GPipe(loss_reduction="sum")`` the
  accumulated gradient is then exactly the gradient of the mini-batch's token-level mean, whatever
  M is and however the padding falls (a per-micro-batch mean would weight tokens unequally).
- **Optimizer.** Adam (beta2 0.98, eps 1e-9) with the Transformer's inverse-square-root schedule
  after a linear warm-up (`train/optim.py`).
- **Model.** `models/translation.translation_transformer` with untied source/target/output
  embeddings by default: the embedding is in the first cell and the projection in the last, and
  tied weights must live in one cell (tie them only with K=1). The paper's two trainability fixes
  are options: `scale_ff_init` (feed-forward init divided by L) and `logit_clip`.
- **Evaluation.** Token NLL (no smoothing) of a pipelined teacher-forced forward, and BLEU of greedy
  (or beam) translations, decoded with a key/value cache under either runtime
  (`translation_decoders.py`, `translation_search.py`): per language, pooled per resource group
  (high / low: the median training-set size of the languages used splits them,
  `language_sampling.resource_groups`), and pooled over everything (`translation_eval.py`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpipe_repro.data.corpus_manifest import Manifest
from gpipe_repro.data.corpus_readers import read_split
from gpipe_repro.data.language_sampling import DEFAULT_TEMPERATURE, resource_groups
from gpipe_repro.data.tokenizer import encode_split
from gpipe_repro.engine.gpipe import GPipe
from gpipe_repro.engine.stage import LossFn
from gpipe_repro.models.translation import translation_transformer
from gpipe_repro.train.config import RunConfig
from gpipe_repro.train.loop import Task, pipelined_outputs
from gpipe_repro.train.optim import OptimizerConfig, smoothed_cross_entropy
from gpipe_repro.train.tasks.translation_batches import TranslationBatches
from gpipe_repro.train.tasks.translation_corpus import prepare_corpus, prepare_tokenizer
from gpipe_repro.train.tasks.translation_decoders import decoder_for
from gpipe_repro.train.tasks.translation_eval import (
    EvalLanguage,
    bleu_by_language_and_group,
    evenly_spaced,
    subset,
    teacher_forced_batches,
    token_nll,
    translate,
)


@dataclasses.dataclass
class TranslationConfig:
    """What the translation task trains, on which data, with which recipe."""

    # -- data
    corpus: str = "gettext"             # corpus name under the data dir (gettext is built on demand)
    data_dir: str | None = None         # None: $GPIPE_REPRO_DATA_DIR or data/translation/
    languages: tuple[str, ...] | None = None   # source languages; None: every language of the corpus
    vocab_size: int = 8000
    max_len: int = 64                   # training pairs longer than this (pieces) are left out
    temperature: float = DEFAULT_TEMPERATURE
    # -- model T(L, H, A); the defaults are the paper's T(6, 8192, 16), the presets scale it down
    L: int = 6
    H: int = 8192
    A: int = 16
    d_model: int = 1024
    head_dim: int = 64
    dropout: float = 0.1
    tie_embeddings: bool = False        # the embedding and the output matrix one parameter
    scale_ff_init: bool = True          # the paper's fix: feed-forward init scaled by 1/L
    logit_clip: float | None = None     # the paper's fix: clamp logits to [-c, c]
    # -- recipe
    label_smoothing: float = 0.1
    lr: float = 1e-3                    # peak learning rate (after warm-up)
    warmup_steps: int = 4000
    adam_beta2: float = 0.98
    # -- evaluation
    eval_split: str = "test"
    eval_sentences: int | None = 200    # per language (evenly spaced over the split); None: all
    eval_max_tokens: int = 4096         # padded tokens per evaluation batch
    beam: int = 1                       # 1: greedy
    decode_max_len: int = 96

    def __post_init__(self) -> None:
        if self.languages is not None:
            self.languages = tuple(sorted(set(self.languages)))
        checks = [
            (min(self.L, self.H, self.A, self.d_model, self.head_dim) >= 1,
             f"T(L,H,A) needs positive sizes (--layers --ffn --heads --d-model --head-dim), got "
             f"L={self.L} H={self.H} A={self.A} d_model={self.d_model} head_dim={self.head_dim}"),
            (0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}"),
            (0.0 <= self.label_smoothing < 1.0,
             f"--label-smoothing must be in [0, 1), got {self.label_smoothing}"),
            (self.logit_clip is None or self.logit_clip > 0,
             f"--logit-clip must be > 0, got {self.logit_clip}"),
            (self.beam >= 1, f"--beam must be >= 1, got {self.beam}"),
            (self.warmup_steps >= 0, f"--warmup-steps must be >= 0 (0: no warm-up), got "
             f"{self.warmup_steps}"),
            (self.lr > 0, f"--lr must be a number > 0, got {self.lr}"),
            (self.eval_split in ("valid", "test"),
             f"eval_split must be valid or test, got {self.eval_split!r}"),
            (self.eval_sentences is None or self.eval_sentences >= 1,
             f"--eval-sentences must be >= 1, got {self.eval_sentences}"),
            (self.max_len >= 4, f"--max-len must be >= 4, got {self.max_len}"),
            (self.languages is None or len(self.languages) >= 1, "give at least one language"),
            (self.temperature > 0, f"--temperature must be > 0, got {self.temperature:g}"),
            (self.data_dir is None or not Path(self.data_dir).exists() or Path(self.data_dir).is_dir(),
             f"--data-dir {self.data_dir} is a file: give a directory (it is made if missing)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        from gpipe_repro.data.tokenizer import too_small_vocabulary
        small = too_small_vocabulary(self.vocab_size, self.languages)
        if small:
            raise ValueError(small)

    def layer_count(self) -> int:
        """How many layers T(L, H, A) has, without the data (built on the meta device: no weights)."""
        with torch.device("meta"):
            return len(translation_transformer(self.L, self.H, self.A, d_model=self.d_model,
                                               head_dim=self.head_dim, vocab_size=self.vocab_size,
                                               tie_embeddings=self.tie_embeddings))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["languages"] = None if self.languages is None else list(self.languages)
        return out

    def replace(self, **changes: Any) -> TranslationConfig:
        """A copy with `changes` (None values are ignored: "not given on the command line")."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


# ----------------------------------------------------------------------------- the loss

class TokenNormalizedLoss:
    """Label-smoothed cross entropy of a micro-batch as ``(sum, count)``: the loss summed over its
    target tokens, and how many non-padding target tokens it has.

    GPipe divides the sum of the micro-batches' sums by the sum of their counts, so the loss and its
    gradient are exactly the token-level mean over the whole mini-batch, whatever M (``loss_reduction``
    does not apply to ``(sum, count)`` losses). The 0-dim mini-batch token count that rides with the
    targets is not needed. A class, not a closure, so it pickles for the distributed runtime."""

    def __init__(self, pad_id: int = 0, label_smoothing: float = 0.1) -> None:
        self.pad_id, self.label_smoothing = pad_id, label_smoothing

    def __call__(self, logits: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        labels = target[0]
        total = smoothed_cross_entropy(logits.float(), labels, self.label_smoothing,
                                       ignore_index=self.pad_id, reduction="sum")
        return total, (labels != self.pad_id).sum()


# ----------------------------------------------------------------------------- the task

class TranslationTask(Task):
    """T(L, H, A) many-to-English translation (see the module docstring)."""

    name = "transformer"
    loss_reduction = "sum"
    lower_is_better = ("nll",)

    def __init__(self, config: TranslationConfig) -> None:
        self.settings = config
        self.corpus_dir = prepare_corpus(config.corpus, config.data_dir)
        manifest = Manifest.load(self.corpus_dir)
        unknown = sorted(set(config.languages or ()) - set(manifest.languages))
        if unknown:
            raise ValueError(f"corpus {manifest.name} has no language(s) {unknown} (the languages "
                             f"asked for, by --languages or by the preset's own list); it has "
                             f"{', '.join(sorted(manifest.languages))}: pass --languages with some of "
                             f"those (e.g. --languages {sorted(manifest.languages)[0]}), or "
                             "--languages all")
        self.languages: list[str] = list(config.languages or sorted(manifest.languages))
        self.tokenizer = prepare_tokenizer(self.corpus_dir, config.vocab_size, self.languages)
        self.train_data = encode_split(self.corpus_dir, self.tokenizer, "train", self.languages,
                                       max_len=config.max_len)
        empty = [lang for lang, d in self.train_data.items() if len(d) == 0]
        if empty:
            raise ValueError(f"no training pair of {empty} fits max_len={config.max_len}: raise "
                             "--max-len or drop those languages")
        self.train_sizes = {lang: len(d) for lang, d in self.train_data.items()}
        corpus_sizes = manifest.sizes("train")
        self.too_long = {lang: corpus_sizes[lang] - n for lang, n in self.train_sizes.items()
                         if corpus_sizes.get(lang, n) > n}
        self.corpus_dropped: dict[str, int] = dict(manifest.config.get("dropped") or {})
        self.corpus_name = manifest.name
        self.groups = resource_groups(self.train_sizes)
        self.eval_items = self._eval_items()
        self.batches: TranslationBatches | None = None
        self.last_hypotheses: dict[str, list[str]] = {}

    def _eval_items(self) -> list[EvalLanguage]:
        """Each language's evaluation sample: at most `eval_sentences` pairs, evenly spaced."""
        s = self.settings
        encoded = encode_split(self.corpus_dir, self.tokenizer, s.eval_split, self.languages)
        raw = read_split(self.corpus_dir, s.eval_split, self.languages)
        items = []
        for index, lang in enumerate(self.languages):
            chosen = evenly_spaced(len(encoded[lang]), s.eval_sentences)
            if len(chosen) == 0:
                continue
            items.append(EvalLanguage(lang, index, subset(encoded[lang], chosen),
                                      [raw[lang][int(i)][1] for i in chosen],
                                      self.train_sizes[lang], self.groups[lang]))
        return items

    # -- what the loop asks for ---------------------------------------------------------------
    def describe_data(self) -> str:
        """The corpus, its training pairs, and every pair left out (by the build, by --max-len)."""
        kept = sum(self.train_sizes.values())
        long = sum(self.too_long.values())
        line = (f"corpus {self.corpus_name} ({self.corpus_dir}): {kept:,} training pairs in "
                f"{len(self.languages)} languages ({', '.join(self.languages[:8])}"
                f"{', ...' if len(self.languages) > 8 else ''})")
        if long:
            worst = max(self.too_long, key=lambda lang: self.too_long[lang])
            line += (f"; {long:,} pairs ({long / (kept + long):.1%}) longer than --max-len "
                     f"{self.settings.max_len} pieces left out (most in {worst}: {self.too_long[worst]:,}); "
                     "raise --max-len to keep them")
        if self.corpus_dropped:
            line += "; left out when the corpus was built: " + ", ".join(
                f"{n:,} {reason}" for reason, n in self.corpus_dropped.items())
        return line

    def config(self) -> dict[str, Any]:
        return {**self.settings.to_dict(), "vocab_size_actual": self.tokenizer.vocab_size,
                "tokenizer": self.tokenizer.model_file.parent.name, "train_sizes": self.train_sizes,
                "groups": self.groups,
                "eval_sizes": {item.language: len(item.references) for item in self.eval_items}}

    def build_layers(self) -> nn.Sequential:
        s = self.settings
        return translation_transformer(
            s.L, s.H, s.A, d_model=s.d_model, head_dim=s.head_dim,
            vocab_size=self.tokenizer.vocab_size, pad_id=self.tokenizer.pad_id, dropout=s.dropout,
            tie_embeddings=s.tie_embeddings, scale_ff_init=s.scale_ff_init, logit_clip=s.logit_clip)

    def memory_planner(self, batch_size: int) -> Any:
        from gpipe_repro.memory.planner import MemoryPlanner
        from gpipe_repro.memory.profile import adam_foreach
        with torch.device("meta"):        # shapes only: the planner copies the layers as fakes
            layers = self.build_layers()
        inputs, (targets, _) = self.sample_batch(batch_size)   # the token count rides unused
        loss = self.loss_fn()

        def token_loss(logits: torch.Tensor, target: torch.Tensor) -> Any:   # the planner's one tensor
            return loss(logits, (target, torch.ones((), device=target.device)))
        return MemoryPlanner(list(layers), inputs, targets, token_loss, optimizer=adam_foreach)

    def memory_advice(self) -> str:
        return ("lower --d-model, --ffn, --layers, --max-len or --batch-size, raise --m, or give "
                "--checkpoint always")

    def loss_fn(self) -> LossFn:
        return TokenNormalizedLoss(self.tokenizer.pad_id, self.settings.label_smoothing)

    def train_batches(self, batch_size: int, seed: int) -> TranslationBatches:
        self.batches = TranslationBatches(self.train_data, batch_size, seed, self.settings.temperature,
                                          self.tokenizer.pad_id, self.tokenizer.bos_id)
        return self.batches

    def optimizer_config(self, *, total_steps: int, steps_per_epoch: int,
                         batch_size: int) -> OptimizerConfig:
        s = self.settings
        return OptimizerConfig(name="adam", lr=s.lr, betas=(0.9, s.adam_beta2), adam_eps=1e-9,
                               schedule="inverse_sqrt", warmup_steps=s.warmup_steps,
                               total_steps=total_steps)

    def sample_batch(self, batch_size: int) -> tuple[Any, Any]:
        batches = TranslationBatches(self.train_data, batch_size, 0, self.settings.temperature,
                                     self.tokenizer.pad_id, self.tokenizer.bos_id)
        return next(batches)

    @torch.no_grad()
    def evaluate(self, pipe: GPipe) -> dict[str, float]:
        s, tok = self.settings, self.tokenizer
        batches = list(teacher_forced_batches(self.eval_items, s.eval_max_tokens, tok.pad_id, tok.bos_id))
        nll = token_nll(pipelined_outputs(pipe, ((b.src_ids, b.tgt_in) for b in batches)), batches,
                        tok.pad_id)
        was_training = pipe.training
        pipe.eval()
        try:
            decoder = decoder_for(pipe)
            hypotheses = {item.language: translate(decoder, item, tok.decode, device=pipe.devices[0],
                                                   beam=s.beam, max_tokens=s.eval_max_tokens,
                                                   max_len=s.decode_max_len, pad_id=tok.pad_id,
                                                   bos_id=tok.bos_id, eos_id=tok.eos_id)
                          for item in self.eval_items}
        finally:
            pipe.train(was_training)
        self.last_hypotheses = hypotheses
        return {"nll": nll, **bleu_by_language_and_group(hypotheses, self.eval_items)}

    def tokens_per_batch(self) -> float:
        """Mean target tokens per mini-batch drawn so far."""
        if self.batches is None or self.batches.drawn == 0:
            return float("nan")
        return self.batches.tokens / self.batches.drawn


# ----------------------------------------------------------------------------- presets

PRESETS: dict[str, str] = {
    "cpu": "T(4,1024,2) at d_model 128 on 16 languages of the offline gettext corpus, K=4, M=4, "
           "1200 steps of 64 sentences: 5 to 15 minutes on 2 shared cores",
    "paper": "T(24,8192,16) at d_model 1024 (the paper's deep model) on every language, K=4, M=32, GPUs",
    "smoke": "T(1,64,2) at d_model 32 on 3 languages, a few steps: checks that everything runs",
}

# Languages of the CPU preset: Romance and Germanic languages, from ~50k training pairs (fr) down
# to ~100 (lb), so the low-resource ones have high-resource relatives to learn from (the transfer
# the paper's deep-vs-wide contrast is about).
CPU_LANGUAGES: tuple[str, ...] = ("fr", "es", "de", "pt", "it", "nl", "ca", "gl", "oc", "ast",
                                  "fur", "wa", "an", "li", "fy", "lb")


def preset(name: str) -> tuple[RunConfig, TranslationConfig]:
    """The run and task settings of a named preset (options given on the command line override them)."""
    if name == "cpu":
        # One thread: on a 2-core machine shared with other jobs, two threads per process ran
        # several times slower than one. No re-materialization: on one CPU it only costs time.
        return (RunConfig(name="transformer-cpu", partitions=4, micro_batches=4, batch_size=64,
                          steps=1200, checkpoint="never", save_every=200, timeline_every=100,
                          threads=1),
                TranslationConfig(languages=CPU_LANGUAGES, vocab_size=4000, L=4, H=1024, A=2,
                                  d_model=128, head_dim=64, lr=4e-3, warmup_steps=100,
                                  eval_sentences=100))
    if name == "paper":
        return (RunConfig(name="transformer-paper", partitions=4, micro_batches=32, batch_size=4096,
                          steps=100_000, eval_every=5000, save_every=5000, timeline_every=500,
                          device="cuda"),
                TranslationConfig(vocab_size=32000, L=24, H=8192, A=16, d_model=1024, head_dim=64,
                                  max_len=128, lr=1e-3, warmup_steps=4000, eval_sentences=None,
                                  beam=4, logit_clip=None))
    if name == "smoke":
        return (RunConfig(name="transformer-smoke", partitions=2, micro_batches=2, batch_size=8,
                          steps=6, eval_every=3, save_every=3, timeline_every=3, threads=1),
                TranslationConfig(languages=("cy", "ga", "is"), vocab_size=1000, L=1, H=64, A=2,
                                  d_model=32, head_dim=16, lr=1e-3, warmup_steps=2, eval_sentences=8))
    raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
