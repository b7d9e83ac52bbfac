"""What a translation run reads: its corpus (the offline gettext corpus is built on first use) and
the shared sentencepiece vocabulary of the languages it uses (trained on first use and cached beside
the corpus: a subset of the languages gets a vocabulary of its own, so no id is spent on scripts the
model never reads)."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from gpipe_repro.data.corpus_builders import build_gettext_corpus
from gpipe_repro.data.corpus_manifest import Manifest, corpus_dir_for
from gpipe_repro.data.tokenizer import TranslationTokenizer, manifest_digest, train_tokenizer


def prepare_corpus(name: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The corpus directory; the offline gettext corpus is built here on first use."""
    corpus_dir = corpus_dir_for(name, data_dir)
    if (corpus_dir / "manifest.json").is_file():
        return corpus_dir
    if name != "gettext":
        raise FileNotFoundError(f"no corpus {name!r} at {corpus_dir}: build it first with "
                                f"`gpipe-repro corpus build --source opus100|local --name {name}` "
                                "(or use --corpus gettext, built offline on first use)")
    print(f"building the offline gettext corpus in {corpus_dir} (once, about a minute)")
    build_gettext_corpus(corpus_dir)
    return corpus_dir


def tokenizer_dir(corpus_dir: Path, vocab_size: int, languages: Sequence[str] | None) -> Path:
    """`spm<V>/` for the whole corpus (what `corpus build` trains), `spm<V>-<n>langs-<hash>/` for a
    subset of its languages."""
    if languages is None:
        return corpus_dir / f"spm{vocab_size}"
    digest = hashlib.sha256(",".join(languages).encode()).hexdigest()[:8]
    return corpus_dir / f"spm{vocab_size}-{len(languages)}langs-{digest}"


def prepare_tokenizer(corpus_dir: Path, vocab_size: int,
                      languages: Sequence[str] | None) -> TranslationTokenizer:
    """The shared vocabulary for these languages, trained (and cached) if absent or stale."""
    all_languages = sorted(Manifest.load(corpus_dir).languages)
    chosen = None if languages is None or list(languages) == all_languages else list(languages)
    out = tokenizer_dir(corpus_dir, vocab_size, chosen)
    meta_path = out / "tokenizer.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if (meta.get("corpus_manifest_sha256") == manifest_digest(corpus_dir)
                and meta.get("languages") == (chosen or all_languages)):
            return TranslationTokenizer.load(out)
    print(f"training a {vocab_size}-piece vocabulary for {len(chosen or all_languages)} languages "
          f"in {out}")
    return train_tokenizer(corpus_dir, vocab_size, languages=chosen, out_dir=out)
