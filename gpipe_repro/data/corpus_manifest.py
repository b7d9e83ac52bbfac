"""What a many-to-English translation corpus on disk is: its folder layout, its manifest, its splits.

The paper's multilingual experiment trains one model to translate 102 languages into English. Three
sources give us such data (`corpus_builders.py`), and all three are written to the same layout so that
the tokenizer, the batching and the evaluation never care where a pair came from:

    <data_dir>/<name>/                 name: "gettext" | "opus100" | "local" (or --name)
        manifest.json                  config, languages (sizes, high/low resource), origins, file hashes
        train/<lang>.jsonl             one pair a line: {"language", "source", "target", "origins"}
        valid/<lang>.jsonl             source = the foreign sentence, target = its English
        test/<lang>.jsonl

Guarantees (kept by `corpus_writer.CorpusWriter` and the builders):
- Deduplicated on (language, source, target); `origins` lists every origin (manifest index) a pair
  came from, and the manifest names each origin's file path and package/version.
- The held-out split is a pure function of the ENGLISH sentence (:func:`split_of`: blake2b hash ->
  [0, 1)), not of any RNG or file order: adding a catalog never moves an existing pair between
  splits, and because the key is the English side, an English sentence held out for one language is
  held out for all of them (the decoder never trains on a test target through another source language).
- Deterministic bytes: records are sorted, JSON is written with fixed separators, and the manifest
  holds no timestamps, so building twice gives byte-identical files.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
SPLITS: tuple[str, ...] = ("train", "valid", "test")
SPLIT_ALIASES = {"train": "train", "valid": "valid", "validation": "valid", "dev": "valid", "test": "test"}
TARGET_LANGUAGE = "en"


@dataclass(frozen=True)
class BuildConfig:
    """How a corpus is built; recorded in its manifest."""
    valid_fraction: float = 0.05
    test_fraction: float = 0.05
    min_pairs: int = 100          # languages with fewer pairs (all splits) are left out
    max_chars: int = 256          # longer messages are left out (gettext; documents, not sentences)
    languages: tuple[str, ...] | None = None   # None = every language found

    def __post_init__(self) -> None:
        for option, value in (("--valid-fraction", self.valid_fraction),
                              ("--test-fraction", self.test_fraction)):
            if not 0 <= value < 1:
                raise ValueError(f"{option} (held out) must be in [0, 1), got {value}")
        if not self.valid_fraction + self.test_fraction < 1:
            raise ValueError(f"--valid-fraction + --test-fraction must be below 1 (something left to "
                             f"train on), got {self.valid_fraction} + {self.test_fraction}")


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


def corpus_dir_for(name: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    return Path(data_dir or default_data_dir()) / name


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
