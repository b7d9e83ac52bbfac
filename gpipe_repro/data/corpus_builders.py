"""Building a translation corpus from one of three sources, all written to the layout of
`corpus_manifest.py` by `corpus_writer.CorpusWriter`:

- `gettext` (offline, the default): real human translations from the `.mo` catalogs of this machine's
  locale directories and installed Python packages (`gpipe_repro.data.gettext_corpus`);
- `opus100`: the hub dataset Helsinki-NLP/opus-100 through `datasets` (online only, `corpus_hub.py`;
  its own splits);
- `local`: json/jsonl/parquet/csv files with columns language, source, target (an optional `split`
  column is honoured), read through `datasets`.

Every builder checks the corpus folder (`corpus_writer.check_corpus_dir`) before it reads or
downloads anything.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

from gpipe_repro.data.corpus_hub import check_hub_available
from gpipe_repro.data.corpus_manifest import SPLIT_ALIASES, TARGET_LANGUAGE, BuildConfig, Manifest, split_of
from gpipe_repro.data.corpus_writer import CorpusWriter, check_corpus_dir

OPUS100_DATASET = "Helsinki-NLP/opus-100"
# The 99 languages OPUS-100 pairs with English (configs are the sorted pair: "de-en", "en-fr").
OPUS100_LANGUAGES: tuple[str, ...] = tuple(
    "af am an ar as az be bg bn br bs ca cs cy da de dz el eo es et eu fa fi fr fy ga gd gl gu ha "
    "he hi hr hu hy id ig is it ja ka kk km kn ko ku ky li lt lv mg mk ml mn mr ms mt my nb ne nl "
    "nn no oc or pa pl ps pt ro ru rw se sh si sk sl sq sr sv ta te tg th tk tr tt ug uk ur uz vi "
    "wa xh yi yo zh zu".split())


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC: a build creates millions of small acyclic tuples, and the collector
    would rescan them all again and again (a third of the build time); nothing here makes cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_gc_paused()
def build_gettext_corpus(corpus_dir: str | os.PathLike[str], config: BuildConfig = BuildConfig(),
                         sources: Sequence[str] = ("system", "python"),
                         locale_dirs: Sequence[str | os.PathLike[str]] | None = None) -> Manifest:
    """The offline corpus: every gettext catalog of `sources`, many-to-English, split and deduped."""
    from gpipe_repro.data import gettext_corpus

    check_corpus_dir(corpus_dir)                 # before reading anything
    catalogs = gettext_corpus.find_catalogs(sources, locale_dirs or gettext_corpus.SYSTEM_LOCALE_DIRS,
                                            config.languages)
    if not catalogs:
        raise ValueError(f"no gettext catalogs found (sources {list(sources)}, languages "
                         f"{config.languages}); install a package that ships translations "
                         f"(e.g. `pip install django`) or pass --locale-dir")
    writer = CorpusWriter()
    split_by_target: dict[str, str] = {}     # the same English recurs across languages
    skipped: list[str] = []
    for catalog in catalogs:
        try:
            pairs = list(gettext_corpus.catalog_pairs(catalog.path, config.max_chars))
        except (OSError, ValueError) as error:
            skipped.append(f"{catalog.path}: {error}")
            continue
        origin = writer.add_origin(path=catalog.path, locale=catalog.locale,
                                   language=catalog.language, domain=catalog.domain,
                                   kind=catalog.origin, package=catalog.package,
                                   version=catalog.version)
        for english, translation in pairs:
            split = split_by_target.get(english)
            if split is None:
                split = split_by_target[english] = split_of(english, config.valid_fraction,
                                                            config.test_fraction)
            writer.add(catalog.language, translation, english, split, origin)
    record = {**asdict(config), "gettext_sources": list(sources),
              "locale_dirs": [str(d) for d in (locale_dirs or gettext_corpus.SYSTEM_LOCALE_DIRS)],
              "unreadable_catalogs": skipped}
    return writer.write(Path(corpus_dir), "gettext", "gettext", record, config.min_pairs)


def opus100_config(language: str) -> str:
    """OPUS-100's config name for language<->English: the two codes sorted ("de-en", "en-fr")."""
    return "-".join(sorted((language, TARGET_LANGUAGE)))


@_gc_paused()
def build_opus100_corpus(corpus_dir: str | os.PathLike[str], config: BuildConfig = BuildConfig(),
                         revision: str | None = None,
                         cache_dir: str | os.PathLike[str] | None = None) -> Manifest:
    """OPUS-100 X->English for `config.languages` (default: all 99), with OPUS-100's own splits."""
    languages = config.languages or OPUS100_LANGUAGES
    unknown = sorted(set(languages) - set(OPUS100_LANGUAGES))
    if unknown:
        raise ValueError(f"OPUS-100 has no {unknown}-English data; choose from {OPUS100_LANGUAGES}")
    check_corpus_dir(corpus_dir)                 # before downloading anything
    check_hub_available(OPUS100_DATASET)
    import datasets

    writer = CorpusWriter()
    for language in sorted(languages):
        name = opus100_config(language)
        parts = datasets.load_dataset(OPUS100_DATASET, name, revision=revision,
                                      cache_dir=None if cache_dir is None else str(cache_dir))
        for hub_split in sorted(parts):
            split = SPLIT_ALIASES[hub_split]
            origin = writer.add_origin(path=f"hf://datasets/{OPUS100_DATASET}/{name}/{hub_split}",
                                       package=OPUS100_DATASET, version=revision or "main",
                                       language=language)
            for row in parts[hub_split]:
                pair = row["translation"]
                source, target = " ".join(pair[language].split()), " ".join(pair["en"].split())
                if source and target and source != target:
                    writer.add(language, source, target, split, origin)
    record = {**asdict(config), "languages": sorted(languages), "revision": revision}
    return writer.write(Path(corpus_dir), "opus100", "opus100", record, config.min_pairs)


LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
LOCAL_COLUMNS = ("language", "source", "target")


def read_local_file(path: str | os.PathLike[str],
                    cache_dir: str | os.PathLike[str] | None = None):  # -> datasets.Dataset
    """Load one json/jsonl/parquet/csv file with columns language, source, target via `datasets`."""
    import datasets

    path = Path(path)
    kind = LOCAL_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: unsupported format; use one of {sorted(LOCAL_FORMATS)}")
    if not path.is_file():
        raise FileNotFoundError(f"local corpus file not found: {path}")
    try:
        table = datasets.load_dataset(kind, data_files=[str(path)], split="train",
                                      cache_dir=None if cache_dir is None else str(cache_dir))
    except Exception as e:  # noqa: BLE001 - datasets wraps the readers' errors (pyarrow's, pandas')
        causes: list[BaseException] = []
        cause: BaseException | None = e
        while cause is not None and len(causes) < 5:
            causes.append(cause)
            cause = cause.__cause__ or cause.__context__
        reason = (str(causes[-1]).strip().splitlines() or [type(causes[-1]).__name__])[0]
        raise ValueError(f"{path} could not be read as {path.suffix.lstrip('.')} ({reason}): check the "
                         "file; each row needs the columns language, source and target") from None
    absent = [c for c in LOCAL_COLUMNS if c not in table.column_names]
    if absent:
        raise ValueError(f"{path} lacks column(s) {absent}; it has {table.column_names}, "
                         f"need {list(LOCAL_COLUMNS)} (+ optional 'split')")
    return table


@_gc_paused()
def build_local_corpus(corpus_dir: str | os.PathLike[str], files: Sequence[str | os.PathLike[str]],
                       config: BuildConfig = BuildConfig(), name: str = "local",
                       cache_dir: str | os.PathLike[str] | None = None) -> Manifest:
    """A corpus from the user's files; a `split` column is honoured, else the hash split applies."""
    if not files:
        raise ValueError("no local files given: pass --files FILE (json, jsonl, parquet or csv)")
    check_corpus_dir(corpus_dir, files)          # before reading anything
    wanted = set(config.languages) if config.languages else None
    writer = CorpusWriter()
    for file in sorted(Path(f) for f in files):
        table = read_local_file(file, cache_dir)
        origin = writer.add_origin(path=str(file.resolve()), package="local file",
                                   version="sha256:" + _sha256_file(file))
        has_split = "split" in table.column_names
        for index, record in enumerate(table):
            language = str(record["language"] or "").strip()
            source = " ".join(str(record["source"] or "").split())
            target = " ".join(str(record["target"] or "").split())
            if not language or not source or not target:
                writer.drop("empty language, source or target")
                continue
            if source == target:
                writer.drop("source identical to target (untranslated)")
                continue
            if wanted is not None and language not in wanted:
                continue
            if has_split and record["split"]:
                split = SPLIT_ALIASES.get(str(record["split"]).strip().lower())
                if split is None:
                    raise ValueError(f"{file} row {index}: unknown split {record['split']!r}; "
                                     f"use one of {sorted(SPLIT_ALIASES)}")
            else:
                split = split_of(target, config.valid_fraction, config.test_fraction)
            writer.add(language, source, target, split, origin)
    # max_chars applies to gettext catalogs only: a local corpus keeps rows of any length
    record = {**{k: v for k, v in asdict(config).items() if k != "max_chars"},
              "files": sorted(str(Path(f).resolve()) for f in files)}
    return writer.write(Path(corpus_dir), name, "local", record, config.min_pairs)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
