"""`gpipe-repro models`: list the model families, or show one model's layers and size.

    gpipe-repro models                                  # the families and their default sizes
    gpipe-repro models amoebanet-d --L 18 --F 256       # layers, parameters, memory at 12 B/param
    gpipe-repro models transformer-lm --L 1663          # 83.9B parameters, counted in seconds
    gpipe-repro models hf:llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --vocab 128256 \\
        --intermediate 14336                            # a Hugging Face config: Llama 3 8B's 8.03B

Any builder keyword is an option (``--num-classes 10``, ``--d-model 1024``). The model is built on
the meta device, so nothing is allocated whatever its size. Runs of identical consecutive layers are
shown as one row unless ``--expand``.
"""
from __future__ import annotations

import ast
from typing import Any, Optional

import typer


def parse_options(args: list[str]) -> dict[str, Any]:
    """``["--L", "18", "--num-classes=10"]`` -> ``{"L": 18, "num_classes": 10}``."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise typer.BadParameter(f"expected an option like --L 18, got {arg!r}")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise typer.BadParameter(f"option --{name} needs a value")
            value = args[i + 1]
            i += 1
        out[name.replace("-", "_")] = _literal(value)
        i += 1
    return out


def _literal(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}" if unit == "B" else f"{n / scale:.1f}{unit}"
    return str(int(n))


def _grouped(rows: list[tuple[str, str, int]]) -> list[tuple[str, str, int, int]]:
    """Collapse runs of consecutive layers with the same class and size: (names, class, params, n)."""
    out: list[tuple[str, str, int, int]] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i][1:] != rows[start][1:]:
            names = rows[start][0] if i - start == 1 else f"{rows[start][0]} .. {rows[i - 1][0]}"
            out.append((names, rows[start][1], rows[start][2], i - start))
            start = i
    return out


def _hf_size(spec: str, options: dict[str, Any]) -> tuple[str, Any]:
    """A Hugging Face model's title and layer sizes, built on the meta device."""
    import torch

    from gpipe_repro.models import count_layers
    from gpipe_repro.train.hf_spec import causal_lm_layers_of, describe, model_config
    config = model_config(spec, **options)
    with torch.device("meta"):
        layers = causal_lm_layers_of(config)
    title = f"hf:{describe(config)}" if spec.startswith("hf:") else f"{describe(config)} from {spec}"
    return title, count_layers(layers)


def register(app: typer.Typer) -> None:
    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def models(ctx: typer.Context,
               family: Optional[str] = typer.Argument(None, help="model family; omit to list them; or "
                                                      "hf:<family> with size options, or a Hugging "
                                                      "Face config.json"),
               expand: bool = typer.Option(False, "--expand", help="one row per layer")) -> None:
        """List the model families, or show a model's layers, parameters and parameter memory."""
        from rich.table import Table

        from gpipe_repro.models import BYTES_PER_PARAM, FAMILIES, get_family, model_size
        from gpipe_repro.report.terminal import table_console

        console = table_console()
        if family is None:
            table = Table("family", "description", "default size", title="model families")
            for f in FAMILIES.values():
                defaults = ", ".join(f"{k}={v}" for k, v in f.defaults.items()) or "(builder defaults)"
                table.add_row(f.name, f.description, defaults)
            console.print(table)
            return
        from gpipe_repro.commands._hf_models import is_hf_model
        try:
            options = parse_options(list(ctx.args))
            if is_hf_model(family):
                title, size = _hf_size(family, options)
            else:
                fam = get_family(family)
                size = model_size(family, **options)
                settings = {**fam.options(), **options}
                title = f"{family} (" + ", ".join(f"{k}={v}" for k, v in settings.items()) + ")"
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e

        table = Table("layer", "type", "params", "x", title=title)
        rows = [(n, c, p, 1) for n, c, p in size.layers] if expand else _grouped(size.layers)
        for names, cls, params, count in rows:
            table.add_row(names, cls, f"{params:,}", str(count))
        console.print(table)
        console.print(f"layers: {len(size.layers)}")
        console.print(f"parameters: {size.total:,} ({_human(size.total)})")
        if size.shared:
            console.print(f"  of which {size.shared:,} shared by two layers (counted once)")
        console.print(f"parameter memory at {BYTES_PER_PARAM} bytes/param (weight + grad + RMSProp): "
                      f"{size.bytes / 2**30:.2f} GiB")
