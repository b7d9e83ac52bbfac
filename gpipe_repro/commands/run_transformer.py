"""`gpipe-repro run transformer`: train the multilingual T(L, H, A) translation model.

    gpipe-repro run transformer --preset cpu                       # 16 languages, ~15 min on 2 cores
    gpipe-repro run transformer --layers 12 --ffn 2048 --heads 8 --k 4 --m 8
    gpipe-repro run transformer --preset cpu --languages fr,de,cy,ga --steps 200
    gpipe-repro run transformer --preset paper                     # T(24,8192,16), GPUs

Why its own module: `gpipe_repro/commands/run.py` owns the `run` group and the options every task
shares; this module adds the `transformer` subcommand to that group (the CLI registers command
modules in name order, so `run` exists by the time `run_transformer` registers) and reuses the shared
options (`pipeline_options`), `apply_pipeline_options` and `run_task`, so the pipeline options mean
exactly what they mean for `run amoebanet`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import typer

from gpipe_repro.commands.options import pipeline_options
from gpipe_repro.commands.run import apply_pipeline_options, check_pipeline_fits, run_task


def _languages(value: str | None) -> tuple[str, ...] | None:
    """--languages: None where not given (the preset's), () for 'all', else the codes given."""
    if value is None:
        return None
    if value.strip() == "all":
        return ()
    codes = tuple(sorted({item.strip() for item in value.split(",") if item.strip()}))
    if not codes:
        raise typer.BadParameter(f"--languages {value!r} names no language: give comma-separated "
                                 "codes (fr,de,cy), or 'all', or leave it out for the preset's")
    return codes


def corpus_vocabulary(corpus: str, data_dir: str | None) -> int | None:
    """The size of the whole-corpus vocabulary `corpus build` trained (`<corpus>/spm<V>/`), if exactly
    one exists; None otherwise (the run then trains, and caches, the preset's size)."""
    import re

    from gpipe_repro.data.corpus_manifest import corpus_dir_for
    directory = corpus_dir_for(corpus, data_dir)
    sizes = [int(m.group(1)) for p in directory.glob("spm*") if (m := re.fullmatch(r"spm(\d+)", p.name))
             and p.is_dir()] if directory.is_dir() else []
    return sizes[0] if len(sizes) == 1 else None


@pipeline_options(batch_size_help="sentences per mini-batch (one synchronous update)")
def transformer(
    *,
    preset: str = typer.Option("cpu", help="cpu | paper | smoke; `--preset list` shows their values"),
    layers: Optional[int] = typer.Option(None, "--layers", "--L", help="L: encoder (= decoder) layers"),
    ffn: Optional[int] = typer.Option(None, "--ffn", "--H", help="H: feed-forward hidden size"),
    heads: Optional[int] = typer.Option(None, "--heads", "--A", help="A: attention heads"),
    d_model: Optional[int] = typer.Option(None, help="model dimension (the paper: 1024)"),
    head_dim: Optional[int] = typer.Option(None, help="channels per attention head (the paper: 64)"),
    languages: Optional[str] = typer.Option(None, help="comma-separated source languages, or 'all'"),
    corpus: Optional[str] = typer.Option(None, help="corpus name under the data dir (gettext: "
                                         "offline, built on first use; others: `gpipe-repro corpus build`)"),
    data_dir: Optional[str] = typer.Option(None, help="where corpora live [default: "
                                           "$GPIPE_REPRO_DATA_DIR or data/translation/]"),
    vocab_size: Optional[int] = typer.Option(None, help="shared sentencepiece vocabulary size"),
    max_len: Optional[int] = typer.Option(None, help="drop training pairs longer than this (pieces)"),
    temperature: Optional[float] = typer.Option(None, help="language sampling temperature T"),
    dropout: Optional[float] = typer.Option(None, help="dropout rate"),
    label_smoothing: Optional[float] = typer.Option(None, help="label smoothing"),
    warmup_steps: Optional[int] = typer.Option(None, help="linear warm-up steps before the "
                                               "inverse-square-root decay"),
    scale_ff_init: Optional[bool] = typer.Option(None, "--scale-ff-init/--no-scale-ff-init",
                                                 help="the paper's fix: feed-forward init / L"),
    logit_clip: Optional[float] = typer.Option(None, help="the paper's fix: clamp logits to [-c, c]"),
    tie_embeddings: Optional[bool] = typer.Option(None, "--tie-embeddings/--untie-embeddings",
                                                  help="share embedding and output matrix (across cells: "
                                                  "each holding cell keeps an equal copy)"),
    beam: Optional[int] = typer.Option(None, help="beam size for BLEU (1: greedy)"),
    eval_sentences: Optional[int] = typer.Option(None, help="test sentences per language scored"),
    pipeline: dict[str, Any],
) -> None:
    """Multilingual many-to-English translation with T(L, H, A); presets: cpu, paper, smoke."""
    if preset == "list":
        from gpipe_repro.train.tasks.translation import PRESETS
        from gpipe_repro.train.tasks.translation import preset as get_preset
        for name, what in PRESETS.items():
            run, task = get_preset(name)
            length = f"steps {run.steps}" if run.steps is not None else f"epochs {run.epochs:g}"
            print(f"{name}: {what}\n  pipeline: K={run.partitions}, M={run.micro_batches}, batch "
                  f"{run.batch_size} sentences, {length}, checkpoint {run.checkpoint}, device {run.device}\n"
                  f"  model and data: T({task.L},{task.H},{task.A}), d_model {task.d_model}, corpus "
                  f"{task.corpus}, languages {', '.join(task.languages) if task.languages else 'all'}, "
                  f"vocabulary {task.vocab_size}, max_len {task.max_len}\n"
                  f"  recipe: lr {task.lr:g}, warm-up {task.warmup_steps} steps, dropout {task.dropout:g}, "
                  f"label smoothing {task.label_smoothing:g}, beam {task.beam}\n")
        print("Any option given on the command line overrides the preset's value.")
        return

    def build() -> tuple[Any, Any]:
        from gpipe_repro.train.tasks.translation import TranslationTask
        from gpipe_repro.train.tasks.translation import preset as get_preset

        run_config, task_config = get_preset(preset)
        chosen = _languages(languages)
        task_config = task_config.replace(
            L=layers, H=ffn, A=heads, d_model=d_model, head_dim=head_dim, corpus=corpus,
            data_dir=data_dir, vocab_size=vocab_size, max_len=max_len, temperature=temperature,
            dropout=dropout, label_smoothing=label_smoothing, warmup_steps=warmup_steps,
            scale_ff_init=scale_ff_init, logit_clip=logit_clip, tie_embeddings=tie_embeddings,
            beam=beam, eval_sentences=eval_sentences)
        if chosen is not None:      # "all" gives (): every language of the corpus
            task_config = dataclasses.replace(task_config, languages=chosen or None)
        elif task_config.corpus != "gettext" and task_config.languages is not None:
            print(f"note: the {preset} preset's languages are the gettext corpus's; on corpus "
                  f"{task_config.corpus} the run uses every language it has (--languages chooses)")
            task_config = dataclasses.replace(task_config, languages=None)
        if vocab_size is None:      # reuse the vocabulary `corpus build` made rather than train another
            built = corpus_vocabulary(task_config.corpus, task_config.data_dir)
            if built is not None and built != task_config.vocab_size:
                print(f"note: using the corpus's own {built}-piece vocabulary (built by `gpipe-repro corpus "
                      f"build`) instead of the preset's {task_config.vocab_size}; --vocab-size chooses")
                task_config = dataclasses.replace(task_config, vocab_size=built)
        run_config = apply_pipeline_options(run_config, pipeline, task=TranslationTask.name)
        check_pipeline_fits(run_config, task_config.layer_count(), more_layers="--layers")
        return functools.partial(TranslationTask, task_config), run_config

    run_task(build)


def register(app: typer.Typer) -> None:
    group = next((info.typer_instance for info in app.registered_groups if info.name == "run"), None)
    if group is None:
        raise RuntimeError("the `run` command group is not registered yet: gpipe_repro/commands/run.py "
                           "must register before run_transformer.py (the CLI registers in name order)")
    group.command("transformer")(transformer)
