"""`gpipe-repro corpus build|info`: the many-to-English corpus and its shared vocabulary.

`build` writes `<data-dir>/<name>/` (see `gpipe_repro.data.corpus_manifest` for the layout) and, unless
`--vocab-size 0`, trains the sentencepiece vocabulary into `<data-dir>/<name>/spm<vocab>/`; both
print a table of languages, sizes, resource group and sampling probability.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:
    from gpipe_repro.data.corpus_manifest import Manifest


def _split_list(value: str | None) -> tuple[str, ...] | None:
    if value is None or not value.strip():
        return None
    return tuple(sorted({item.strip() for item in value.split(",") if item.strip()}))


def print_summary(manifest: Manifest, temperature: float, title: str) -> None:
    from rich.table import Table

    from gpipe_repro.data.language_sampling import temperature_probabilities
    from gpipe_repro.report.terminal import table_console

    sizes = manifest.sizes("train")
    probs = temperature_probabilities(sizes, temperature)
    origins: dict[str, int] = {}
    for origin in manifest.origins:
        if origin.get("pairs", 0) and "language" in origin:
            origins[origin["language"]] = origins.get(origin["language"], 0) + 1
    table = Table(title=title)
    for column in ("language", "train", "valid", "test", "resource", f"p (T={temperature:g})",
                   "origins"):
        table.add_column(column, justify="left" if column in ("language", "resource") else "right")
    for lang in sorted(sizes, key=lambda code: (-sizes[code], code)):
        info = manifest.languages[lang]
        table.add_row(lang, f"{info['train']:,}", f"{info['valid']:,}", f"{info['test']:,}",
                      info["resource"], f"{probs[lang]:.4f}", str(origins.get(lang, "")))
    console = table_console()
    console.print(table)
    high = [lang for lang, info in manifest.languages.items() if info["resource"] == "high"]
    totals = {split: sum(info[split] for info in manifest.languages.values())
              for split in ("train", "valid", "test")}
    used = sum(1 for origin in manifest.origins if origin.get("pairs"))
    console.print(f"{len(sizes)} languages -> English: {len(high)} high-resource (>= "
                  f"{min(sizes[lang] for lang in high):,} training pairs), {len(sizes) - len(high)} "
                  f"low-resource; pairs: train {totals['train']:,}, valid {totals['valid']:,}, "
                  f"test {totals['test']:,}; from {used} origins")


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _check_build(name: str, data_dir: Path | None, corpus_dir: Path, *, temperature: float,
                 vocab_size: int, min_pairs: int, max_chars: int, locale_dir: list[Path] | None,
                 overwrite: bool, languages: tuple[str, ...] | None = None) -> None:
    """`corpus build`'s options, before any catalog is read: ValueError naming the one to change.
    A corpus built earlier under the same name is replaced only with --overwrite."""
    from gpipe_repro.train.run_dir import is_plain_folder_name
    if not is_plain_folder_name(name):
        raise ValueError(f"--name {name!r} is not a plain folder name (no '/', no leading '.'): the "
                         "corpus goes to <data-dir>/<name>; use --data-dir to write elsewhere")
    checks = [(temperature > 0, f"--temperature must be > 0, got {temperature:g}"),
              (vocab_size >= 0, f"--vocab-size must be >= 0 (0: no tokenizer), got {vocab_size}"),
              (min_pairs >= 1, f"--min-pairs must be >= 1, got {min_pairs}"),
              (max_chars >= 1, f"--max-chars must be >= 1, got {max_chars}")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    from gpipe_repro.data.tokenizer import too_small_vocabulary
    small = too_small_vocabulary(vocab_size, languages) if vocab_size > 0 else None
    if small:
        raise ValueError(f"{small}; 0 builds no tokenizer")
    if data_dir is not None and data_dir.exists() and not data_dir.is_dir():
        raise ValueError(f"--data-dir {data_dir} is a file: give a directory (it is made if missing)")
    for folder in locale_dir or []:
        if not folder.is_dir():
            raise ValueError(f"--locale-dir {folder}: no such directory")
    if (corpus_dir / "manifest.json").is_file() and not overwrite:
        raise ValueError(f"{corpus_dir} holds a corpus built earlier; nothing was changed: pass "
                         "--overwrite to replace it, or give another --name")


def register(app: typer.Typer) -> None:
    corpus = typer.Typer(help="Multilingual many-to-English translation corpus and vocabulary.",
                         no_args_is_help=True)
    app.add_typer(corpus, name="corpus")

    @corpus.command("build")
    def build(
        source: str = typer.Option("gettext", help="gettext (offline, this machine's catalogs) | "
                                   "opus100 (Helsinki-NLP/opus-100, needs network) | local (--files)"),
        data_dir: Path | None = typer.Option(None, help="where corpora live "
                                                "[default: $GPIPE_REPRO_DATA_DIR or data/translation/]"),
        name: str | None = typer.Option(None, help="corpus directory name [default: the source]"),
        languages: str | None = typer.Option(None, help="comma-separated source languages "
                                                "[default: all]"),
        gettext_sources: str = typer.Option("system,python", help="gettext catalogs from: system "
                                            "locale dirs, python packages (e.g. Django)"),
        locale_dir: list[Path] | None = typer.Option(None, help="locale dir(s) to scan instead "
                                                        "of the system's (repeatable)"),
        files: list[Path] | None = typer.Option(None, help="--source local: json/jsonl/parquet/"
                                                   "csv with columns language, source, target"),
        valid_fraction: float = typer.Option(0.05, help="held-out fraction for validation"),
        test_fraction: float = typer.Option(0.05, help="held-out fraction for test"),
        min_pairs: int = typer.Option(100, help="leave out languages with fewer pairs"),
        max_chars: int = typer.Option(256, help="gettext: leave out longer messages"),
        revision: str | None = typer.Option(None, help="opus100: hub revision to pin"),
        vocab_size: int = typer.Option(8000, help="sentencepiece vocabulary size (0: no tokenizer)"),
        temperature: float = typer.Option(5.0, help="language sampling temperature T"),
        overwrite: bool = typer.Option(False, "--overwrite", help="replace a corpus built earlier "
                                       "under the same name"),
    ) -> None:
        """Build a corpus (deduplicated, hash split, manifest) and its shared vocabulary."""
        from gpipe_repro.data import corpus_builders, corpus_hub, corpus_manifest

        try:
            config = corpus_manifest.BuildConfig(valid_fraction=valid_fraction, test_fraction=test_fraction,
                                                 min_pairs=min_pairs, max_chars=max_chars,
                                                 languages=_split_list(languages))
            corpus_dir = corpus_manifest.corpus_dir_for(name or source, data_dir)
            _check_build(name or source, data_dir, corpus_dir, temperature=temperature,
                         vocab_size=vocab_size, min_pairs=min_pairs, max_chars=max_chars,
                         locale_dir=locale_dir, overwrite=overwrite, languages=config.languages)
        except ValueError as error:
            _fail(str(error))
        try:
            if source == "gettext":
                manifest = corpus_builders.build_gettext_corpus(
                    corpus_dir, config, sources=_split_list(gettext_sources) or (),
                    locale_dirs=[str(d) for d in locale_dir] if locale_dir else None)
            elif source == "opus100":
                manifest = corpus_builders.build_opus100_corpus(corpus_dir, config, revision=revision,
                                                   cache_dir=corpus_dir.parent / ".hf-cache")
            elif source == "local":
                manifest = corpus_builders.build_local_corpus(corpus_dir, files or [], config,
                                                 name=name or "local",
                                                 cache_dir=corpus_dir.parent / ".hf-cache")
            else:
                raise ValueError(f"unknown --source {source!r}: use gettext, opus100 or local")
        except (corpus_hub.HubUnavailableError, ValueError, FileNotFoundError, FileExistsError) as error:
            typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2) from error
        print_summary(manifest, temperature, f"corpus {manifest.name} -> {corpus_dir}")
        dropped = manifest.config.get("dropped") or {}
        typer.echo("rows left out: " + ("; ".join(f"{n:,} {reason}" for reason, n in dropped.items())
                                        if dropped else "none"))
        if vocab_size > 0:
            from gpipe_repro.data.tokenizer import train_tokenizer

            try:
                tokenizer = train_tokenizer(corpus_dir, vocab_size, temperature=temperature)
            except ValueError as error:
                typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
                raise typer.Exit(code=2) from error
            typer.echo(f"tokenizer: {tokenizer.model_file} ({tokenizer.vocab_size} pieces, "
                       f"{len(tokenizer.languages)} language tags)")

    @corpus.command("info")
    def info(
        name: str = typer.Argument("gettext", help="corpus directory name"),
        data_dir: Path | None = typer.Option(None, help="where corpora live"),
        temperature: float = typer.Option(5.0, help="language sampling temperature T"),
    ) -> None:
        """Show a built corpus: languages, split sizes, resource groups, sampling probabilities."""
        import json

        from gpipe_repro.data import corpus_manifest

        if not temperature > 0:
            _fail(f"--temperature must be > 0, got {temperature:g}")
        corpus_dir = corpus_manifest.corpus_dir_for(name, data_dir)
        try:
            manifest = corpus_manifest.Manifest.load(corpus_dir)
        except FileNotFoundError as error:
            typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2) from error
        print_summary(manifest, temperature, f"corpus {manifest.name} ({corpus_dir})")
        from gpipe_repro.data.tokenizer import manifest_digest

        current = manifest_digest(corpus_dir)
        for meta_path in sorted(corpus_dir.glob("spm*/tokenizer.json")):
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            stale = "" if meta.get("corpus_manifest_sha256") == current else (
                " STALE: trained on an earlier build of this corpus, rebuild it")
            typer.echo(f"tokenizer {meta_path.parent.name}: {meta['model_type']}, "
                       f"{meta['vocab_size_requested']} pieces requested, "
                       f"{len(meta['languages'])} language tags, sha256 "
                       f"{meta['model_sha256'][:12]}{stale}")
