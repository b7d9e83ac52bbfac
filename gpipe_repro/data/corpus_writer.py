"""Writing a translation corpus: collect pairs, deduplicate them, write the layout of `corpus_manifest.py`.

A build replaces only what an earlier build of this project wrote: :func:`check_corpus_dir` refuses a
folder that holds other ``.jsonl`` files, and while a build runs, the files it may delete or write are
listed in :data:`BUILDING`, so a build that was stopped still owns them.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from gpipe_repro.data.corpus_manifest import SPLITS, Manifest
from gpipe_repro.data.language_sampling import resource_groups

BUILDING = ".building.json"
"""A corpus folder's list of the files a build in progress may delete or write (gone once its
manifest is written): a build that was stopped still owns them."""


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


_json_string = json.encoder.encode_basestring  # the C encoder json.dumps(..., ensure_ascii=False) uses


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)

