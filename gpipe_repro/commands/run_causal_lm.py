"""`gpipe-repro run causal-lm`: train a Hugging Face decoder-only model on byte-level text.

    gpipe-repro run causal-lm --preset cpu                          # tiny LLaMA, gettext English
    gpipe-repro run causal-lm --family qwen3 --k 2 --m 4 --steps 100
    gpipe-repro run causal-lm --family gpt-neox --layers 4 --hidden 128 --heads 4 --text notes.txt
    gpipe-repro run causal-lm --config-file path/to/config.json --layers 2 --precision bf16

The model is any family of `gpipe_repro.train.hf_spec.FAMILIES` at tiny sizes (each size is an
option), or a `config.json` (its sizes, or those given); random initialization, nothing downloaded.
The pipeline options (--k, --m, --schedule, --precision, --resume, ...) are the shared ones of every
`run` command (`pipeline_options`), and the run writes what `run amoebanet` writes: metrics.jsonl,
checkpoints, summary, W&B offline.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import typer

from gpipe_repro.commands.options import pipeline_options
from gpipe_repro.commands.run import apply_pipeline_options, check_pipeline_fits, run_task


@pipeline_options(batch_size_help="packed rows (sequences of --seq-len bytes) per mini-batch")
def causal_lm(
    *,
    preset: str = typer.Option("cpu", help="cpu | smoke; `--preset list` shows their values"),
    family: Optional[str] = typer.Option(None, help="llama | mistral | qwen2 | qwen3 | gemma | gpt2 | "
                                         "gpt-neox, at tiny sizes (default: llama)"),
    config_file: Optional[str] = typer.Option(None, help="a Hugging Face config.json to train instead "
                                              "of a family (random init; --layers etc. change it)"),
    layers: Optional[int] = typer.Option(None, help="decoder layers"),
    hidden: Optional[int] = typer.Option(None, help="hidden size"),
    heads: Optional[int] = typer.Option(None, help="attention heads"),
    kv_heads: Optional[int] = typer.Option(None, help="key/value heads (a divisor of --heads)"),
    intermediate: Optional[int] = typer.Option(None, help="feed-forward hidden size"),
    tie_embeddings: Optional[bool] = typer.Option(None, "--tie-embeddings/--untie-embeddings",
                                                  help="share the embedding and output matrix "
                                                  "(default: the family's choice)"),
    seq_len: Optional[int] = typer.Option(None, help="bytes per packed row"),
    text: Optional[str] = typer.Option(None, help="a UTF-8 text file to train on (one document per "
                                       "line, every 20th held out; default: the English sentences of "
                                       "the offline gettext corpus)"),
    data_dir: Optional[str] = typer.Option(None, help="where corpora live (default: "
                                           "$GPIPE_REPRO_DATA_DIR or data/translation/)"),
    warmup_steps: Optional[int] = typer.Option(None, help="linear warm-up steps before the cosine decay "
                                          "(default: a tenth of the steps, at most 30)"),
    pipeline: dict[str, Any],
) -> None:
    """A Hugging Face causal LM (LLaMA, Mistral, Qwen2/3, Gemma, GPT-2, GPT-NeoX) on byte-level
    text; presets: cpu, smoke."""
    from gpipe_repro.train.tasks.causal_lm import PRESETS
    from gpipe_repro.train.tasks.causal_lm import preset as get_preset
    if preset == "list":
        for name, what in PRESETS.items():
            run, task = get_preset(name)
            length = f"steps {run.steps}" if run.steps is not None else f"epochs {run.epochs:g}"
            print(f"{name}: {what}\n  pipeline: K={run.partitions}, M={run.micro_batches}, batch "
                  f"{run.batch_size} rows, {length}, checkpoint {run.checkpoint}\n"
                  f"  model and data: {task.family}, sizes {task.sizes() or 'tiny'}, rows of "
                  f"{task.seq_len} bytes, lr {task.lr:g}\n")
        print("Any option given on the command line overrides the preset's value.")
        return

    def build() -> tuple[Any, Any]:
        from gpipe_repro.train.tasks.causal_lm import CausalLMTask

        run_config, task_config = get_preset(preset)
        if config_file is None:     # the preset's sizes, where the family has them; then the options given
            task_config = task_config.sizes_of(family)
        task_config = task_config.replace(
            family=family, config_file=config_file, layers=layers, hidden=hidden, heads=heads,
            kv_heads=kv_heads, intermediate=intermediate, tie_embeddings=tie_embeddings,
            seq_len=seq_len, text=text, data_dir=data_dir, warmup_steps=warmup_steps)
        count = task_config.layer_count()        # a bad size or file: refused before the data work
        config = apply_pipeline_options(run_config, pipeline, task=CausalLMTask.name)  # before the data
        check_pipeline_fits(config, count, more_layers="--layers")
        return functools.partial(CausalLMTask, task_config), config

    run_task(build)


def register(app: typer.Typer) -> None:
    group = next((info.typer_instance for info in app.registered_groups if info.name == "run"), None)
    if group is None:
        raise RuntimeError("the `run` command group is not registered yet: gpipe_repro/commands/run.py "
                           "must register before run_causal_lm.py (the CLI registers in name order)")
    group.command("causal-lm")(causal_lm)
