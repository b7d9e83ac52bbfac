"""The translation corpus's names that callers outside `data/` import by this path (the `corpus` and
`run transformer` commands, the causal-LM task), and only those. The corpus is in `corpus_manifest.py`
(layout, manifest, splits), `corpus_writer.py`, `corpus_builders.py`, `corpus_hub.py` and
`corpus_readers.py`: import from those; this module goes once no caller uses it.
"""
from __future__ import annotations

from gpipe_repro.data.corpus_builders import build_gettext_corpus, build_local_corpus, build_opus100_corpus
from gpipe_repro.data.corpus_hub import HubUnavailableError
from gpipe_repro.data.corpus_manifest import BuildConfig, Manifest, corpus_dir_for
from gpipe_repro.data.corpus_readers import read_split

__all__ = ["BuildConfig", "HubUnavailableError", "Manifest", "build_gettext_corpus", "build_local_corpus",
           "build_opus100_corpus", "corpus_dir_for", "read_split"]
