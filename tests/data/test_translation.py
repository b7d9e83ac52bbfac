"""The multilingual translation data: gettext corpus, splits, local files, hub errors, tokenizer, batches."""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import struct
import time
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from gpipe_repro.commands import corpus as corpus_command
from gpipe_repro.data import corpus_hub
from gpipe_repro.data import gettext_corpus as gc
from gpipe_repro.data.corpus_builders import (
    OPUS100_DATASET,
    build_gettext_corpus,
    build_local_corpus,
    build_opus100_corpus,
    opus100_config,
)
from gpipe_repro.data.corpus_hub import HubUnavailableError
from gpipe_repro.data.corpus_manifest import (
    SPLITS,
    BuildConfig,
    Manifest,
    corpus_dir_for,
    default_data_dir,
    split_of,
)
from gpipe_repro.data.corpus_readers import as_hf_dataset, iter_records, read_split
from gpipe_repro.data.corpus_writer import BUILDING
from gpipe_repro.data.language_sampling import (
    TokenizedLanguage,
    collate,
    cut_batches,
    eval_batches,
    resource_groups,
    temperature_probabilities,
    train_batches,
)
from gpipe_repro.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    TranslationTokenizer,
    encode_split,
    train_tokenizer,
)

SMALL_LANGUAGES = ("cy", "ga", "is")   # present in the system catalogs and in Django


def all_files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def records(corpus_dir: Path, split: str) -> list[dict]:
    return list(iter_records(corpus_dir, split))


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small") / "gettext"
    build_gettext_corpus(out, BuildConfig(languages=SMALL_LANGUAGES))
    return out


@pytest.fixture(scope="module")
def small_tokenizer(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> TranslationTokenizer:
    return train_tokenizer(small_corpus, 1000, max_sentences=20_000,
                           out_dir=tmp_path_factory.mktemp("spm"))


# ---------------------------------------------------------------------------------- .mo catalogs

def write_mo(path: Path, messages: dict[bytes, bytes]) -> None:
    """A minimal GNU .mo writer (the layout msgfmt produces, without the hash table)."""
    keys = sorted(messages)
    ids = strs = b""
    offsets = []
    for key in keys:
        offsets.append((len(ids), len(key), len(strs), len(messages[key])))
        ids += key + b"\0"
        strs += messages[key] + b"\0"
    count = len(keys)
    originals_at = 28
    translations_at = originals_at + 8 * count
    ids_at = translations_at + 8 * count
    strs_at = ids_at + len(ids)
    table_o = b"".join(struct.pack("<2I", length, ids_at + o) for o, length, _, _ in offsets)
    table_t = b"".join(struct.pack("<2I", length, strs_at + o) for _, _, o, length in offsets)
    header = struct.pack("<7I", 0x950412DE, 0, count, originals_at, translations_at, 0, strs_at)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + table_o + table_t + ids + strs)


def test_mo_reader_handles_charset_context_plurals_and_filters(tmp_path: Path) -> None:
    path = tmp_path / "xx" / "LC_MESSAGES" / "demo.mo"
    write_mo(path, {
        b"": b"Content-Type: text/plain; charset=ISO-8859-1\nLast-Translator: Jos\xe9\n"
             b"Plural-Forms: nplurals=3; plural=(n==0 ? 0 : n==1 ? 1 : 2);\n",
        b"Coffee": b"Caf\xe9",                                     # Latin-1 text
        b"menu\x04Open": b"Ouvrir",                                # msgctxt dropped
        b"%d file\x00%d files": b"aucun\x00%d fichier\x00%d fichiers",   # form 0 is for n=0 here
        b"Same": b"Same",                                          # untranslated copy: skipped
        b"%s: %s": b"%s : %s",                                     # placeholders only: skipped
        b"Empty": b"",                                             # untranslated: skipped
        b"Wrapped\nhelp  text": b"Aide\n  enroul\xe9e",            # whitespace collapsed
        b"\aAlarm": b"\aAlarme",                                   # control character dropped
        b"x" * 300: b"y" * 300,                                    # longer than max_chars
    })
    pairs = gc.catalog_pairs(path, max_chars=256)
    assert sorted(pairs) == sorted([
        ("Coffee", "Café"), ("Open", "Ouvrir"),
        ("%d file", "%d fichier"), ("%d files", "%d fichiers"),
        ("Wrapped help text", "Aide enroulée"), ("Alarm", "Alarme")])
    with pytest.raises(ValueError, match="magic"):
        bad = tmp_path / "bad.mo"
        bad.write_bytes(b"\0" * 40)
        gc.read_mo(bad)


@pytest.mark.parametrize("locale, language", [
    ("fr", "fr"), ("pt_BR", "pt"), ("de_CH", "de"), ("zh_CN", "zh"), ("zh_TW", "zh_Hant"),
    ("zh_TW.Big5", "zh_Hant"), ("sr@latin", "sr_Latn"), ("sr", "sr"), ("ca@valencia", "ca"),
    ("nb_NO", "nb"), ("no", "nb"), ("en_GB", None), ("en@quot", None), ("C", None)])
def test_normalize_language(locale: str, language: str | None) -> None:
    assert gc.normalize_language(locale) == language


# ---------------------------------------------------------------------------------- corpus builds

def test_offline_corpus_builds_byte_identical_twice(small_corpus: Path, tmp_path: Path) -> None:
    again = tmp_path / "gettext"
    build_gettext_corpus(again, BuildConfig(languages=SMALL_LANGUAGES))
    first, second = all_files(small_corpus), all_files(again)
    first = {k: v for k, v in first.items() if k.endswith((".jsonl", "manifest.json"))}
    assert set(first) == set(second)
    assert first == second
    manifest = Manifest.load(small_corpus)
    assert set(manifest.languages) == set(SMALL_LANGUAGES)
    for relative, digest in manifest.files.items():
        assert hashlib.sha256((small_corpus / relative).read_bytes()).hexdigest() == digest


def test_offline_corpus_is_deduplicated_many_to_english_with_provenance(small_corpus: Path) -> None:
    manifest = Manifest.load(small_corpus)
    seen: set[tuple[str, str, str]] = set()
    for split in SPLITS:
        for record in records(small_corpus, split):
            key = (record["language"], record["source"], record["target"])
            assert key not in seen
            seen.add(key)
            assert record["source"] != record["target"]
            for origin_id in record["origins"]:
                origin = manifest.origins[origin_id]
                assert origin["language"] == record["language"]
                assert Path(origin["path"]).is_file() and origin["path"].endswith(".mo")
                assert origin["package"] and (origin["version"] or origin["kind"] == "system")
    # Direction: the target is the English msgid, the source the translation.
    origin = next(o for o in manifest.origins if o["pairs"] > 0)
    english = {e for e, _ in gc.catalog_pairs(origin["path"])}
    targets = {r["target"] for s in SPLITS for r in records(small_corpus, s)
               if origin["id"] in r["origins"]}
    assert targets and targets <= english
    assert sum(info["train"] for info in manifest.languages.values()) == sum(
        1 for _ in records(small_corpus, "train"))


def test_split_is_a_fixed_function_of_the_english_sentence(small_corpus: Path,
                                                           tmp_path: Path) -> None:
    config = BuildConfig(languages=SMALL_LANGUAGES)
    split_of_target: dict[str, str] = {}
    for split in SPLITS:
        for record in records(small_corpus, split):
            assert split_of(record["target"], config.valid_fraction, config.test_fraction) == split
            assert split_of_target.setdefault(record["target"], split) == split  # one split per English
    counts = Counter(split_of_target.values())
    total = sum(counts.values())
    for split, fraction in (("test", config.test_fraction), ("valid", config.valid_fraction)):
        sigma = math.sqrt(fraction * (1 - fraction) / total)
        assert abs(counts[split] / total - fraction) < 4 * sigma
    # Building a different set of languages moves no pair of a shared language between splits.
    alone = tmp_path / "alone"
    build_gettext_corpus(alone, BuildConfig(languages=("cy",)))
    def welsh(corpus_dir: Path, split: str) -> set[tuple[str, str]]:
        return {(r["source"], r["target"]) for r in records(corpus_dir, split) if r["language"] == "cy"}

    for split in SPLITS:
        assert welsh(alone, split) == welsh(small_corpus, split)


@pytest.mark.host_data   # the whole offline build from every catalog installed here: minutes on 2 cores
def test_full_offline_corpus_spans_high_and_low_resource_languages(tmp_path: Path) -> None:
    start = time.perf_counter()
    manifest = build_gettext_corpus(tmp_path / "gettext")
    elapsed = time.perf_counter() - start
    sizes = manifest.sizes("train")
    assert len(sizes) >= 20, f"only {len(sizes)} languages: {sorted(sizes)}"
    assert max(sizes.values()) >= 50 * min(sizes.values())      # a natural long tail
    groups = Counter(info["resource"] for info in manifest.languages.values())
    assert groups["high"] >= 10 and groups["low"] >= 10
    assert all(manifest.languages[lang]["resource"] == "high"
               for lang in sorted(sizes, key=sizes.get)[-5:])
    assert all(info["test"] > 0 for lang, info in manifest.languages.items() if sizes[lang] > 1000)
    print(f"full offline build: {len(sizes)} languages, {sum(sizes.values())} train pairs, "
          f"{elapsed:.1f} s")


def test_local_json_and_csv_files(tmp_path: Path) -> None:
    rows = [{"language": "xx", "source": f"xx sentence {i}", "target": f"english {i}"}
            for i in range(150)]
    rows += [rows[0], {"language": "xx", "source": "same", "target": "same"}]  # duplicate, copy
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    csv = tmp_path / "more.csv"
    csv.write_text("language,source,target,split\n" + "".join(
        f"yy,yy phrase {i},english {i},{'test' if i < 20 else 'train'}\n" for i in range(120)),
        encoding="utf-8")
    corpus_dir = tmp_path / "local"
    manifest = build_local_corpus(corpus_dir, [jsonl, csv], BuildConfig(),
                                     cache_dir=tmp_path / "hf")
    assert set(manifest.languages) == {"xx", "yy"}
    assert sum(manifest.languages["xx"][s] for s in SPLITS) == 150   # deduplicated, copy dropped
    # every row left out is counted, by reason, and local files get no gettext max_chars
    assert manifest.config["dropped"] == {"duplicate (same language, source and target)": 1,
                                          "source identical to target (untranslated)": 1}
    assert "max_chars" not in manifest.config
    assert manifest.languages["yy"]["test"] == 20 and manifest.languages["yy"]["train"] == 100
    for record in records(corpus_dir, "train"):
        if record["language"] == "xx":
            assert split_of(record["target"], 0.05, 0.05) == "train"
    versions = {Path(o["path"]).name: o["version"] for o in manifest.origins}
    assert versions["more.csv"] == "sha256:" + hashlib.sha256(csv.read_bytes()).hexdigest()
    dataset = as_hf_dataset(corpus_dir, "test", ["yy"], cache_dir=tmp_path / "hf")
    assert dataset.num_rows == 20 and set(dataset["language"]) == {"yy"}
    bad = tmp_path / "bad.csv"
    bad.write_text("lang,src,tgt\nxx,a,b\n", encoding="utf-8")
    with pytest.raises(ValueError, match="lacks column"):
        build_local_corpus(tmp_path / "bad", [bad], cache_dir=tmp_path / "hf")


def test_hub_corpus_fails_fast_and_names_the_offline_alternative(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    def no_network(*args: object, **kwargs: object) -> bool:
        raise AssertionError("the offline check must not touch the network")

    monkeypatch.setattr(corpus_hub, "_hub_reachable", no_network)
    # no_network above fails the test at any attempt to reach the hub: no wait is possible
    with pytest.raises(HubUnavailableError, match="corpus build --source gettext"):
        build_opus100_corpus(tmp_path / "opus", BuildConfig(languages=("de", "fr")))
    assert not (tmp_path / "opus").exists()
    assert opus100_config("de") == "de-en" and opus100_config("fr") == "en-fr"
    with pytest.raises(ValueError, match="OPUS-100 has no"):
        build_opus100_corpus(tmp_path / "opus", BuildConfig(languages=("tlh",)))


def test_opus100_rows_become_the_corpus_layout(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """The hub path's conversion, with `datasets.load_dataset` replaced by local rows (no network)."""
    import datasets

    for flag in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setattr(corpus_hub, "_hub_reachable", lambda *args, **kwargs: True)
    calls = []

    def hub_stand_in(path: str, name: str, revision: str | None = None,
                     cache_dir: str | None = None) -> datasets.DatasetDict:
        calls.append((path, name, revision))
        lang = next(code for code in name.split("-") if code != "en")
        def rows(split: str, n: int) -> datasets.Dataset:
            return datasets.Dataset.from_dict({"translation": [
                {lang: f"{lang} {split}  {i}", "en": f"{split} {i}"} for i in range(n)]})

        return datasets.DatasetDict({"train": rows("train", 120), "validation": rows("valid", 5),
                                     "test": rows("test", 7)})

    monkeypatch.setattr(datasets, "load_dataset", hub_stand_in)
    corpus_dir = tmp_path / "opus100"
    manifest = build_opus100_corpus(corpus_dir, BuildConfig(languages=("fr", "de")),
                                       revision="v1")
    assert calls == [(OPUS100_DATASET, "de-en", "v1"), (OPUS100_DATASET, "en-fr", "v1")]
    for lang in ("de", "fr"):
        assert {s: manifest.languages[lang][s] for s in SPLITS} == {"train": 120, "valid": 5,
                                                                       "test": 7}
    first = records(corpus_dir, "valid")[0]
    assert first["source"] == "de valid 0" and first["target"] == "valid 0"   # whitespace collapsed
    assert manifest.origins[first["origins"][0]]["path"].endswith("opus-100/de-en/validation")


def test_corpus_command_build_info_and_offline_error(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    app = typer.Typer()
    corpus_command.register(app)
    runner = CliRunner()
    result = runner.invoke(app, ["corpus", "build", "--data-dir", str(tmp_path), "--languages",
                                 "cy,ga", "--vocab-size", "0"])
    assert result.exit_code == 0, result.output
    assert "cy" in result.output and "high" in result.output and "low" in result.output
    assert (tmp_path / "gettext" / "manifest.json").is_file()
    info = runner.invoke(app, ["corpus", "info", "gettext", "--data-dir", str(tmp_path)])
    assert info.exit_code == 0 and "2 languages" in info.output
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = runner.invoke(app, ["corpus", "build", "--source", "opus100", "--data-dir",
                                  str(tmp_path), "--vocab-size", "0"])
    assert offline.exit_code == 2 and "gettext" in offline.output
    # built earlier under the same name: replaced only with --overwrite
    again = runner.invoke(app, ["corpus", "build", "--data-dir", str(tmp_path), "--languages", "cy",
                                "--vocab-size", "0"])
    assert again.exit_code == 2 and "pass --overwrite" in again.output
    assert "ga" in Manifest.load(tmp_path / "gettext").languages


@pytest.mark.parametrize("option, says", [
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--valid-fraction", "-0.1"], "--valid-fraction (held out) must be in [0, 1)"),
    (["--valid-fraction", "0.6", "--test-fraction", "0.6"],
     "--valid-fraction + --test-fraction must be below 1"),
    (["--vocab-size", "-1"], "--vocab-size must be >= 0"),
    (["--vocab-size", "200"], "--vocab-size 200 is too small"),     # was refused after building
    (["--min-pairs", "-1"], "--min-pairs must be >= 1"),
    (["--max-chars", "0"], "--max-chars must be >= 1"),
    (["--name", "../x"], "not a plain folder name"),
    (["--locale-dir", "/nonexistent-locale-dir"], "no such directory"),
    (["--data-dir", "FILE"], "is a file"),
])
def test_corpus_build_refused_bad_options_only_after_building_or_with_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: list[str], says: str) -> None:
    """`corpus build --temperature 0` built the whole gettext corpus (44 s) and then printed a
    traceback; --valid-fraction -0.1 a traceback; --data-dir <a file> 46 s of work, then a traceback;
    --name ../x wrote outside --data-dir; --vocab-size -1, --min-pairs -1, a missing --locale-dir were
    taken. Each is one line, exit 2, before any catalog is read."""
    from gpipe_repro.data import corpus_builders

    def no_work(*_: Any, **__: Any) -> None:
        pytest.fail("the corpus was built before the options were checked")
    monkeypatch.setattr(corpus_builders, "build_gettext_corpus", no_work)
    (tmp_path / "FILE").write_text("mine")
    option = [str(tmp_path / "FILE") if o == "FILE" else o for o in option]
    app = typer.Typer()
    corpus_command.register(app)
    args = ["corpus", "build", *([] if "--data-dir" in option else ["--data-dir", str(tmp_path)]), *option]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and says in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------- tokenizer

def test_tokenizer_is_deterministic_with_fixed_ids_and_round_trips(
        small_corpus: Path, small_tokenizer: TranslationTokenizer, tmp_path: Path) -> None:
    again = train_tokenizer(small_corpus, 1000, max_sentences=20_000, out_dir=tmp_path)
    assert again.model_file.read_bytes() == small_tokenizer.model_file.read_bytes()
    tok = small_tokenizer
    assert tok.vocab_size == 1000
    assert [tok.sp.id_to_piece(i) for i in (PAD_ID, UNK_ID, BOS_ID, EOS_ID)] == [
        "<pad>", "<unk>", "<s>", "</s>"]
    assert [tok.language_id(lang) for lang in sorted(SMALL_LANGUAGES)] == [4, 5, 6]
    pairs = read_split(small_corpus, "test", ["ga"])["ga"]
    stable = [(s, t) for s, t in pairs
              if unicodedata.normalize("NFKC", s) == s and unicodedata.normalize("NFKC", t) == t]
    assert len(stable) > 100
    sources = tok.encode_source([s for s, _ in stable], "ga")
    targets = tok.encode_target([t for _, t in stable])
    for (source, target), src_ids, tgt_ids in zip(stable, sources, targets):
        assert src_ids[0] == tok.language_id("ga") and src_ids[-1] == EOS_ID
        assert tgt_ids[-1] == EOS_ID and BOS_ID not in tgt_ids and UNK_ID not in src_ids
        assert tok.decode(src_ids) == source and tok.decode(tgt_ids) == target
    assert tok.encode_source(["Dia duit"], "ga", add_tag=False)[0][0] != tok.language_id("ga")
    with pytest.raises(KeyError, match="no tag"):
        tok.language_id("fr")
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(small_corpus, 200, out_dir=tmp_path / "tiny")


def test_default_data_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv("GPIPE_REPRO_DATA_DIR", str(tmp_path))
    assert corpus_dir_for("gettext") == tmp_path / "gettext"
    monkeypatch.delenv("GPIPE_REPRO_DATA_DIR")
    assert default_data_dir().parts[-2:] == ("data", "translation")


def test_encode_split_feeds_the_batcher(small_corpus: Path,
                                        small_tokenizer: TranslationTokenizer) -> None:
    data = encode_split(small_corpus, small_tokenizer, "valid", max_len=32)
    assert set(data) == set(SMALL_LANGUAGES)
    for table in data.values():
        assert len(table) > 0 and table.src_lengths.max() <= 32 and table.tgt_lengths.max() <= 32
    batch = next(train_batches(data, max_tokens=512, seed=0))
    languages = sorted(data)
    for row in range(len(batch)):
        lang = languages[int(batch.src_lang[row])]
        assert int(batch.src_ids[row, 0]) == small_tokenizer.language_id(lang)


# ---------------------------------------------------------------------------------- sampling

def synthetic(sizes: dict[str, int], seed: int = 0) -> dict[str, TokenizedLanguage]:
    rng = np.random.default_rng(seed)
    data = {}
    for lang, n in sizes.items():
        src = [list(rng.integers(10, 100, size=rng.integers(2, 60))) + [EOS_ID] for _ in range(n)]
        tgt = [list(rng.integers(10, 100, size=rng.integers(1, 60))) + [EOS_ID] for _ in range(n)]
        data[lang] = TokenizedLanguage.from_lists(src, tgt)
    return data


def test_temperature_probabilities_follow_the_formula() -> None:
    sizes = {"hi": 1_000_000, "mid": 10_000, "lo": 100}
    total = sum(sizes.values())
    for temperature in (1.0, 2.0, 5.0, 100.0):
        p = temperature_probabilities(sizes, temperature)
        weights = {k: (n / total) ** (1 / temperature) for k, n in sizes.items()}
        assert math.isclose(sum(p.values()), 1.0)
        for lang in sizes:
            assert math.isclose(p[lang], weights[lang] / sum(weights.values()))
    assert math.isclose(temperature_probabilities(sizes, 1.0)["lo"], 100 / total)
    p5 = temperature_probabilities(sizes, 5.0)
    assert p5["hi"] > p5["mid"] > p5["lo"] > 100 / total       # flattened, order kept
    assert resource_groups(sizes) == {"hi": "high", "mid": "high", "lo": "low"}
    with pytest.raises(ValueError):
        temperature_probabilities(sizes, 0.0)


def test_sampled_language_frequencies_match_temperature_formula() -> None:
    sizes = {"a": 4000, "b": 400, "c": 40}
    data = synthetic(sizes)
    expected = temperature_probabilities(sizes, 5.0)
    counts: Counter[str] = Counter()
    languages = sorted(data)
    for batch in itertools.islice(train_batches(data, max_tokens=2000, seed=3, pool_size=4096), 500):
        counts.update(languages[i] for i in batch.src_lang.tolist())
    n = sum(counts.values())
    assert n > 15_000
    for lang, p in expected.items():
        assert abs(counts[lang] / n - p) < 4 * math.sqrt(p * (1 - p) / n), (lang, counts[lang] / n, p)
    # Deterministic given the seed, different across seeds.
    first = [b.src_ids for b in itertools.islice(train_batches(data, max_tokens=2000, seed=3), 5)]
    again = [b.src_ids for b in itertools.islice(train_batches(data, max_tokens=2000, seed=3), 5)]
    other = [b.src_ids for b in itertools.islice(train_batches(data, max_tokens=2000, seed=4), 5)]
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(first, other))


def test_bucketing_groups_similar_lengths_within_budgets() -> None:
    data = synthetic({"a": 3000, "b": 300})
    spreads, padding = [], []
    for batch in itertools.islice(train_batches(data, max_tokens=1500, max_sentences=64, seed=0), 100):
        src_len = (~batch.src_pad_mask).sum(1)
        tgt_len = (~batch.tgt_pad_mask).sum(1)
        cost = torch.maximum(src_len, tgt_len)
        assert len(batch) <= 64
        assert len(batch) == 1 or len(batch) * int(cost.max()) <= 1500
        spreads.append(int(cost.max() - cost.min()))
        padding.append(float(batch.src_pad_mask.float().mean()))
    lengths = np.maximum(data["a"].src_lengths, data["a"].tgt_lengths)
    random_spread = np.mean([np.ptp(np.random.default_rng(i).choice(lengths, 30)) for i in range(100)])
    assert np.mean(spreads) < 0.2 * random_spread
    assert np.mean(padding) < 0.25
    assert cut_batches([1, 2, 3, 10, 10], max_tokens=20, max_sentences=None) == [(0, 3), (3, 5)]
    assert cut_batches([5, 5, 5], max_tokens=None, max_sentences=2) == [(0, 2), (2, 3)]
    assert cut_batches([50], max_tokens=10, max_sentences=None) == [(0, 1)]


def test_collate_shifts_targets_and_masks_padding() -> None:
    data = {0: TokenizedLanguage.from_lists([[7, 8, 9, EOS_ID], [7, EOS_ID]],
                                            [[11, 12, EOS_ID], [13, EOS_ID]])}
    batch = collate(data, [(0, 0), (0, 1)], pad_id=PAD_ID, bos_id=BOS_ID)
    assert batch.src_ids.tolist() == [[7, 8, 9, EOS_ID], [7, EOS_ID, PAD_ID, PAD_ID]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 11, 12], [BOS_ID, 13, PAD_ID]]
    assert batch.tgt_out.tolist() == [[11, 12, EOS_ID], [13, EOS_ID, PAD_ID]]
    assert batch.src_pad_mask.tolist() == [[False] * 4, [False, False, True, True]]
    assert batch.num_target_tokens == 5
    assert batch.src_ids.dtype == batch.tgt_in.dtype == batch.src_lang.dtype == torch.long
    src, tgt_in, tgt_out, lang = batch.as_tuple()
    assert src is batch.src_ids and tgt_in is batch.tgt_in and tgt_out is batch.tgt_out
    assert lang.tolist() == [0, 0] and batch.index.tolist() == [0, 1]


def test_eval_batches_cover_each_pair_once_in_length_order() -> None:
    table = synthetic({"a": 777})["a"]
    seen: list[int] = []
    longest = []
    for batch in eval_batches(table, 2, max_tokens=800, max_sentences=50):
        assert set(batch.src_lang.tolist()) == {2}
        seen += batch.index.tolist()
        cost = torch.maximum((~batch.src_pad_mask).sum(1), (~batch.tgt_pad_mask).sum(1))
        longest.append(int(cost.max()))
        for row, i in enumerate(batch.index.tolist()):
            assert batch.src_ids[row, :len(table.source(i))].tolist() == table.source(i).tolist()
    assert sorted(seen) == list(range(777))
    assert longest == sorted(longest)


def _pairs_file(path: Path, languages: tuple[str, ...]) -> Path:
    path.write_text("".join(json.dumps({"language": lang, "source": f"{lang} s {i}",
                                        "target": f"english {i}"}) + "\n"
                            for lang in languages for i in range(120)), encoding="utf-8")
    return path


def test_a_build_deletes_only_what_builds_wrote(tmp_path: Path) -> None:
    """A rebuild replaces the previous build's split files (a language it no longer has goes too)
    and nothing else; a .jsonl the user put in a split folder, or an input file inside the folder,
    makes the build refuse before reading anything, changing nothing."""
    corpus = tmp_path / "corpus"
    two = _pairs_file(tmp_path / "two.jsonl", ("xx", "yy"))
    build_local_corpus(corpus, [two], cache_dir=tmp_path / "hf")
    (corpus / "notes.txt").write_text("mine")
    assert (corpus / "train" / "yy.jsonl").exists()
    build_local_corpus(corpus, [_pairs_file(tmp_path / "one.jsonl", ("xx",))], cache_dir=tmp_path / "hf")
    assert not (corpus / "train" / "yy.jsonl").exists() and (corpus / "train" / "xx.jsonl").exists()
    assert (corpus / "notes.txt").read_text() == "mine" and not (corpus / BUILDING).exists()
    mine = corpus / "valid" / "my_dev_set.jsonl"
    mine.write_text('{"my": "held-out"}\n')
    before = sorted(p.relative_to(corpus).as_posix() for p in corpus.rglob("*"))
    with pytest.raises(FileExistsError, match="valid/my_dev_set.jsonl.*nothing was changed"):
        build_local_corpus(corpus, [two], cache_dir=tmp_path / "hf")
    assert sorted(p.relative_to(corpus).as_posix() for p in corpus.rglob("*")) == before
    mine.unlink()
    inside = _pairs_file(corpus / "train" / "pairs.jsonl", ("xx",))
    with pytest.raises(ValueError, match="inside the corpus folder"):
        build_local_corpus(corpus, [inside], cache_dir=tmp_path / "hf")
    assert inside.exists()


def test_a_stopped_build_can_be_rebuilt(tmp_path: Path) -> None:
    """A build stopped after removing its manifest still owns its files (its .building list)."""
    corpus = tmp_path / "corpus"
    two = _pairs_file(tmp_path / "two.jsonl", ("xx", "yy"))
    build_local_corpus(corpus, [two], cache_dir=tmp_path / "hf")
    files = sorted(json.loads((corpus / "manifest.json").read_text())["files"])
    (corpus / BUILDING).write_text(json.dumps(files))
    (corpus / "manifest.json").unlink()
    manifest = build_local_corpus(corpus, [two], cache_dir=tmp_path / "hf")
    assert sorted(manifest.files) == files


def test_a_malformed_local_file_is_one_error_naming_it(tmp_path: Path) -> None:
    """`corpus build --source local` on a broken JSONL file printed pyarrow's error through three
    tracebacks (265 lines, exit 1): it is one ValueError naming the file and the reason."""
    from gpipe_repro.data.corpus_builders import read_local_file
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"bad json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl could not be read as jsonl \(.*\): check the file"):
        read_local_file(bad, cache_dir=tmp_path / "cache")
