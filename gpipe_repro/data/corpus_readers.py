"""Reading a translation corpus (the layout of `corpus_manifest.py`): one split as pairs, as a
`datasets.Dataset`, or as its records with their origins."""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from gpipe_repro.data.corpus_manifest import SPLITS, Manifest


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
