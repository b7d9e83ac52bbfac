"""Many-to-English translation corpora on disk: build them (gettext, OPUS-100, local files), load them.

The paper's multilingual experiment trains one model to translate 102 languages into English. Three
sources give us such data, and all three are written to the same layout so that the tokenizer, the
batching and the evaluation never care where a pair came from:

    <data_dir>/<name>/                 name: "gettext" | "opus100" | "local" (or --name)
        manifest.json                  config, languages (sizes, high/low resource), origins, file hashes
        train/<lang>.jsonl             one pair a line: {"language", "source", "target", "origins"}
        valid/<lang>.jsonl             source = the foreign sentence, target = its English
        test/<lang>.jsonl

- `gettext` (offline, the default): real human translations from the `.mo` catalogs of this machine's
  locale directories and installed Python packages (`gpipe_repro.data.gettext_corpus`).
- `opus100`: the hub dataset Helsinki-NLP/opus-100 through `datasets` (online only; its own splits).
- `local`: json/jsonl/parquet/csv files with columns language, source, target (an optional `split`
  column is honoured), read through `datasets`.

Guarantees:
- Deduplicated on (language, source, target); `origins` lists every origin (manifest index) a pair
  came from, and the manifest names each origin's file path and package/version.
- The held-out split is a pure function of the ENGLISH sentence (blake2b hash -> [0, 1)), not of any
  RNG or file order: adding a catalog never moves an existing pair between splits, and because the
  key is the English side, an English sentence held out for one language is held out for all of them
  (the decoder never trains on a test target through another source language).
- Deterministic bytes: records are sorted, JSON is written with fixed separators, and the manifest
  holds no timestamps, so building twice gives byte-identical files.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import socket
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpipe_repro.data.language_sampling import resource_groups

FORMAT_VERSION = 1
SPLITS: tuple[str, ...] = ("train", "valid", "test")
SPLIT_ALIASES = {"train": "train", "valid": "valid", "validation": "valid", "dev": "valid", "test": "test"}
TARGET_LANGUAGE = "en"

OPUS100_DATASET = "Helsinki-NLP/opus-100"
# The 99 languages OPUS-100 pairs with English (configs are the sorted pair: "de-en", "en-fr").
OPUS100_LANGUAGES: tuple[str, ...] = tuple(
    "af am an ar as az be bg bn br bs ca cs cy da de dz el eo es et eu fa fi fr fy ga gd gl gu ha "
    "he hi hr hu hy id ig is it ja ka kk km kn ko ku ky li lt lv mg mk ml mn mr ms mt my nb ne nl "
    "nn no oc or pa pl ps pt ro ru rw se sh si sk sl sq sr sv ta te tg th tk tr tt ug uk ur uz vi "
    "wa xh yi yo zh zu".split())
OFFLINE_ALTERNATIVE = ("build the offline corpus instead: `gpipe-repro corpus build --source gettext` "
                       "(real translations from this machine's gettext catalogs), or `--source local "
                       "--files FILE` for your own json/jsonl/parquet/csv with columns language, "
                       "source, target")


class HubUnavailableError(RuntimeError):
    """The hub dataset cannot be reached (offline mode or no network)."""


@dataclass(frozen=True)
class BuildConfig:
    """How a corpus is built; recorded in its manifest."""
    valid_fraction: float = 0.05
    test_fraction: float = 0.05
    min_pairs: int = 100          # languages with fewer pairs (all splits) are left out
    max_chars: int = 256          # longer messages are left out (gettext; documents, not sentences)
    languages: tuple[str, ...] | None = None   # None = every language found

    def __post_init__(self) -> None:
        if not (0 <= self.valid_fraction and 0 <= self.test_fraction
                and self.valid_fraction + self.test_fraction < 1):
            raise ValueError(f"valid_fraction + test_fraction must be in [0, 1), got "
                             f"{self.valid_fraction} + {self.test_fraction}")


@dataclass
class Manifest:
    """What `manifest.json` holds. `languages[lang]` = {"train", "valid", "test", "resource"}."""
    name: str
    source: str
    config: dict
    languages: dict[str, dict]
    origins: list[dict]
    files: dict[str, str] = field(default_factory=dict)   # relative path -> sha256
    format: int = FORMAT_VERSION
    direction: str = "many-to-English"

    def sizes(self, split: str = "train") -> dict[str, int]:
        return {lang: info[split] for lang, info in self.languages.items()}

    @classmethod
    def load(cls, corpus_dir: str | os.PathLike[str]) -> Manifest:
        path = Path(corpus_dir) / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(f"no corpus at {corpus_dir} (missing manifest.json): run "
                                    f"`gpipe-repro corpus build` first")
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path} has corpus format {data.get('format')}, this code reads "
                             f"{FORMAT_VERSION}: rebuild it with `gpipe-repro corpus build`")
        return cls(**data)


def default_data_dir() -> Path:
    """$GPIPE_REPRO_DATA_DIR, else `data/translation/` of the checkout, else of the current directory."""
    env = os.environ.get("GPIPE_REPRO_DATA_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    base = repo if (repo / "pyproject.toml").is_file() else Path.cwd()
    return base / "data" / "translation"


def held_out_position(target: str) -> float:
    """Where an English sentence falls in [0, 1): a hash, so the split needs no RNG and no order."""
    digest = hashlib.blake2b(target.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split_of(target: str, valid_fraction: float, test_fraction: float) -> str:
    position = held_out_position(target)
    if position < test_fraction:
        return "test"
    if position < test_fraction + valid_fraction:
        return "valid"
    return "train"


# ------------------------------------------------------------------------------------------ writing

class CorpusWriter:
    """Collects (language, source, target, split, origin) records, dedups them, writes the layout."""

    def __init__(self) -> None:
        self.origins: list[dict] = []
        # (language, source, target) -> [split, set of origin ids]
        self._pairs: dict[tuple[str, str, str], list] = {}
        self.dropped: dict[str, int] = {}     # reason -> rows left out (recorded in the manifest)

    def drop(self, reason: str, rows: int = 1) -> None:
        """Count rows left out, by reason, so the build can say what it dropped."""
        self.dropped[reason] = self.dropped.get(reason, 0) + rows

    def add_origin(self, **description: str) -> int:
        self.origins.append({"id": len(self.origins), **description})
        return len(self.origins) - 1

    def add(self, language: str, source: str, target: str, split: str, origin: int) -> None:
        key = (language, source, target)
        entry = self._pairs.get(key)
        if entry is None:
            self._pairs[key] = [split, {origin}]
            return
        self.drop("duplicate (same language, source and target)")
        entry[1].add(origin)
        # A pair given in two splits (only possible with given splits) stays in the held-out one.
        if SPLITS.index(split) > SPLITS.index(entry[0]):
            entry[0] = split

    def write(self, corpus_dir: Path, name: str, source: str, config: dict,
              min_pairs: int) -> Manifest:
        totals: dict[str, int] = {}
        for language, _, _ in self._pairs:
            totals[language] = totals.get(language, 0) + 1
        kept = sorted(lang for lang, n in totals.items() if n >= min_pairs)
        small = sum(n for lang, n in totals.items() if n < min_pairs)
        if small:
            self.drop(f"language with fewer than --min-pairs {min_pairs} pairs", small)
        config = {**config, "dropped": dict(self.dropped)}
        if not kept:
            raise ValueError(f"no language has >= {min_pairs} pairs ({len(self._pairs)} pairs in all): "
                             f"lower --min-pairs or add data")
        by_file: dict[tuple[str, str], list[tuple[str, str, list[int]]]] = {}
        keep = set(kept)
        for (language, src, tgt), (split, origins) in self._pairs.items():
            if language in keep:
                by_file.setdefault((split, language), []).append((tgt, src, sorted(origins)))

        owned = check_corpus_dir(corpus_dir)
        corpus_dir.mkdir(parents=True, exist_ok=True)
        new_files = {f"{split}/{language}.jsonl" for split, language in by_file}
        # what this build may delete or write, kept while no manifest says what the folder holds
        _atomic_write(corpus_dir / BUILDING, json.dumps(sorted(owned | new_files)).encode("utf-8"))
        (corpus_dir / "manifest.json").unlink(missing_ok=True)   # no manifest while half-written
        for split in SPLITS:
            (corpus_dir / split).mkdir(exist_ok=True)
        for stale in sorted(owned - new_files):          # the previous build's files, and only those
            (corpus_dir / stale).unlink(missing_ok=True)
        languages: dict[str, dict[str, int | str]] = {lang: {split: 0 for split in SPLITS} for lang in kept}
        origin_pairs = [0] * len(self.origins)
        files: dict[str, str] = {}
        for (split, language), rows in sorted(by_file.items()):
            rows.sort()
            lines = []
            prefix = '{"language":' + _json_string(language) + ',"source":'
            for tgt, src, origins in rows:
                for origin in origins:
                    origin_pairs[origin] += 1
                # = json.dumps(record, ensure_ascii=False, separators=(",", ":")), 5x faster
                lines.append(f'{prefix}{_json_string(src)},"target":{_json_string(tgt)},'
                             f'"origins":[{",".join(map(str, origins))}]}}')
            data = ("\n".join(lines) + "\n").encode("utf-8")
            relative = f"{split}/{language}.jsonl"
            _atomic_write(corpus_dir / relative, data)
            files[relative] = hashlib.sha256(data).hexdigest()
            languages[language][split] = len(rows)
        groups = resource_groups({lang: int(info["train"]) for lang, info in languages.items()})
        for lang, info in languages.items():
            info["resource"] = groups[lang]
        origins = [{**o, "pairs": n} for o, n in zip(self.origins, origin_pairs)]
        manifest = Manifest(name=name, source=source, config=config, languages=languages,
                            origins=origins, files=files)
        text = json.dumps(asdict(manifest), ensure_ascii=False, indent=1, sort_keys=True) + "\n"
        _atomic_write(corpus_dir / "manifest.json", text.encode("utf-8"))
        (corpus_dir / BUILDING).unlink(missing_ok=True)
        return manifest


BUILDING = ".building.json"
"""A corpus folder's list of the files a build in progress may delete or write (gone once its
manifest is written): a build that was stopped still owns them."""


def check_corpus_dir(corpus_dir: str | os.PathLike[str],
                     inputs: Sequence[str | os.PathLike[str]] = ()) -> set[str]:
    """The split files (``split/language.jsonl``) a new build of `corpus_dir` may replace: those its
    previous build wrote (its manifest's, or a stopped build's list). Raises, changing nothing, if
    the folder holds other ``.jsonl`` files in its split folders (the user's: a build must not
    delete them), or if an input file lies inside the folder."""
    folder = Path(corpus_dir)
    for f in inputs:
        if folder.resolve() in Path(f).resolve().parents:
            raise ValueError(f"--files {f} is inside the corpus folder {folder} that this build "
                             "rewrites: move it out of there, or choose another --name / --data-dir")
    owned: set[str] = set()
    for record in (folder / "manifest.json", folder / BUILDING):
        try:
            value = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        owned |= set(value.get("files", {}) if isinstance(value, dict) else value)
    present = {p.relative_to(folder).as_posix() for split in SPLITS
               for p in (folder / split).glob("*.jsonl")} if folder.is_dir() else set()
    foreign = sorted(present - owned)
    if foreign:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise FileExistsError(f"{folder} holds files no corpus build of this project wrote ({shown}); "
                              "nothing was changed. Move them out, or build into another folder "
                              "(--name / --data-dir)")
    return owned & present


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


_json_string = json.encoder.encode_basestring  # the C encoder json.dumps(..., ensure_ascii=False) uses


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ sources

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


def _hub_offline() -> bool:
    flags = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(f, "").strip().lower() in {"1", "true", "yes", "on"} for f in flags)


def _hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def check_hub_available(dataset: str = OPUS100_DATASET) -> None:
    """Raise HubUnavailableError at once (no retries, no long timeouts) when the hub is out of reach."""
    if _hub_offline():
        raise HubUnavailableError(
            f"cannot load the hub dataset {dataset}: offline mode is on (HF_DATASETS_OFFLINE / "
            f"HF_HUB_OFFLINE); unset it on a machine with network access, or "
            f"{OFFLINE_ALTERNATIVE}")
    if not _hub_reachable():
        raise HubUnavailableError(
            f"cannot load the hub dataset {dataset}: huggingface.co is not reachable from this "
            f"machine; {OFFLINE_ALTERNATIVE}")


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
    check_hub_available()
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
    table = datasets.load_dataset(kind, data_files=[str(path)], split="train",
                                  cache_dir=None if cache_dir is None else str(cache_dir))
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


# ------------------------------------------------------------------------------------------ reading

def corpus_dir_for(name: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    return Path(data_dir or default_data_dir()) / name


def read_split(corpus_dir: str | os.PathLike[str], split: str,
               languages: Iterable[str] | None = None) -> dict[str, list[tuple[str, str]]]:
    """{language: [(source, target), ...]} of one split, in file order (sorted by target)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    manifest = Manifest.load(corpus_dir)
    chosen = sorted(manifest.languages) if languages is None else list(languages)
    absent = [lang for lang in chosen if lang not in manifest.languages]
    if absent:
        raise ValueError(f"corpus {corpus_dir} has no language(s) {absent}; it has "
                         f"{sorted(manifest.languages)}")
    result: dict[str, list[tuple[str, str]]] = {}
    for language in chosen:
        path = Path(corpus_dir) / split / f"{language}.jsonl"
        pairs: list[tuple[str, str]] = []
        if path.is_file():
            with path.open(encoding="utf-8") as f:
                for line in f:
                    record = json.loads(line)
                    pairs.append((record["source"], record["target"]))
        result[language] = pairs
    return result


def as_hf_dataset(corpus_dir: str | os.PathLike[str], split: str,
                  languages: Iterable[str] | None = None,
                  cache_dir: str | os.PathLike[str] | None = None):  # -> datasets.Dataset
    """One split as a `datasets.Dataset` (columns language, source, target, origins)."""
    import datasets

    manifest = Manifest.load(corpus_dir)
    chosen = sorted(manifest.languages) if languages is None else sorted(languages)
    files = [str(Path(corpus_dir) / split / f"{lang}.jsonl") for lang in chosen
             if (Path(corpus_dir) / split / f"{lang}.jsonl").is_file()]
    return datasets.load_dataset("json", data_files=files, split="train",
                                 cache_dir=None if cache_dir is None else str(cache_dir))


def iter_records(corpus_dir: str | os.PathLike[str], split: str,
                 languages: Iterable[str] | None = None) -> Iterator[Mapping]:
    """Every record of a split, language by language (for tools that want the origins too)."""
    manifest = Manifest.load(corpus_dir)
    for language in sorted(languages or manifest.languages):
        path = Path(corpus_dir) / split / f"{language}.jsonl"
        if path.is_file():
            with path.open(encoding="utf-8") as f:
                for line in f:
                    yield json.loads(line)
