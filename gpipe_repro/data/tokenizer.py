"""A shared sentencepiece vocabulary for all source languages and English, with language tags.

The paper uses one 64k vocabulary shared by its 102 languages and English; ours is smaller (default
8000: the corpus is ~10^6 short sentences, and a small softmax keeps the CPU experiments cheap).

Ids are fixed: pad 0, unk 1, bos 2, eos 3, then one tag per source language, `<fr>`, `<zh_Hant>`, ...
in sorted order (ids 4, 5, ...), then the learned pieces. Sequences:

    source  = [<lang>] pieces [eos]        the tag tells the encoder which language it reads
    target  =          pieces [eos]        (the batcher makes tgt_in = [bos] pieces, tgt_out = pieces [eos])

Why a SOURCE tag and no target tag: every target is English, so a target-language token (`<2en>`,
Johnson et al. 2017) would carry no information; a source tag is optional for many-to-one models but
cheap, it helps closely related languages that share a script (sr/hr/bs, es/gl/ast), and it lets a
model condition on the language whose resource level we study. `add_tag=False` drops it.

Why BPE rather than sentencepiece's default unigram model: on 2 cores it trains on 200k sentences in
seconds where unigram takes tens of seconds, and nothing the paper measures hinges on the subword
algorithm (`model_type="unigram"` remains available).

Determinism: the training sentences are chosen by hashing (no RNG), fed in a fixed order with
sentencepiece's own sampling and shuffling off, with a fixed thread count and random seed, and the
model is written through `model_writer` (a `model_prefix` would embed the output path in the
model), so the same corpus gives a byte-identical model wherever it is written.

Which sentences: the source side of each language's training split, temperature-sampled like the
training batches (otherwise French alone would decide the pieces), plus the distinct English targets;
`byte_fallback` spells any unseen character as UTF-8 bytes instead of <unk>.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from gpipe_repro.data.corpus_manifest import Manifest
from gpipe_repro.data.corpus_readers import read_split
from gpipe_repro.data.language_sampling import (
    DEFAULT_TEMPERATURE,
    TokenizedLanguage,
    temperature_probabilities,
)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPECIAL_PIECES = ("<pad>", "<unk>", "<s>", "</s>")
TRAINING_THREADS = 2      # fixed, not os.cpu_count(), so no result can depend on the machine
TRAINING_SEED = 0


def too_small_vocabulary(vocab_size: int, languages: Sequence[str] | None) -> str | None:
    """What is wrong with `vocab_size` pieces for `languages` (None: one at least), or None: the
    special pieces, 256 byte-fallback pieces and a tag per language are reserved."""
    reserved = len(SPECIAL_PIECES) + 256 + max(1, len(languages or ()))
    if vocab_size > reserved:
        return None
    return (f"--vocab-size {vocab_size} is too small: {len(SPECIAL_PIECES)} special pieces, 256 "
            "byte-fallback pieces and one tag per language are reserved, so it must be above "
            f"{reserved} (more with more languages)")


def manifest_digest(corpus_dir: str | os.PathLike[str]) -> str:
    """sha256 of a corpus's manifest.json: tells whether a tokenizer was trained on this build."""
    return hashlib.sha256((Path(corpus_dir) / "manifest.json").read_bytes()).hexdigest()


def language_tag(language: str) -> str:
    return f"<{language}>"


def _hash_rank(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()


def tokenizer_sentences(train: Mapping[str, Sequence[tuple[str, str]]], max_sentences: int,
                        temperature: float = DEFAULT_TEMPERATURE) -> list[str]:
    """The sentences a vocabulary is trained on, chosen without RNG.

    Half the budget goes to source sentences, split over languages by temperature sampling
    (language l gets ceil(budget * p_l) of its sentences, all of them if it has fewer); half to
    distinct English targets. Within a language, sentences are taken in hash order.
    """
    sizes = {lang: len(pairs) for lang, pairs in train.items() if pairs}
    probs = temperature_probabilities(sizes, temperature)
    budget = max_sentences // 2
    chosen: list[str] = []
    for lang in sorted(sizes):
        sources = sorted({src for src, _ in train[lang]}, key=_hash_rank)
        chosen += sources[:math.ceil(budget * probs[lang])]
    targets = sorted({tgt for pairs in train.values() for _, tgt in pairs}, key=_hash_rank)
    chosen += targets[:max_sentences - budget]
    return chosen


def train_tokenizer(corpus_dir: str | os.PathLike[str], vocab_size: int = 8000, *,
                    languages: Iterable[str] | None = None, max_sentences: int = 200_000,
                    temperature: float = DEFAULT_TEMPERATURE, model_type: str = "bpe",
                    character_coverage: float = 0.9995,
                    out_dir: str | os.PathLike[str] | None = None) -> TranslationTokenizer:
    """Train the shared vocabulary on the training split; save it in `<corpus>/spm<vocab_size>/`."""
    import sentencepiece as spm

    train = read_split(corpus_dir, "train", languages)
    langs = sorted(train)
    sentences = tokenizer_sentences(train, max_sentences, temperature)
    reserved = len(SPECIAL_PIECES) + len(langs) + 256          # specials, tags, byte pieces
    if vocab_size <= reserved:
        raise ValueError(f"--vocab-size {vocab_size} is too small: {reserved} ids are reserved "
                         f"(4 specials, {len(langs)} language tags, 256 byte-fallback pieces)")
    out = Path(out_dir) if out_dir is not None else Path(corpus_dir) / f"spm{vocab_size}"
    out.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()   # a model_writer, not a model_prefix: the prefix path would be stored in it
    spm.set_random_generator_seed(TRAINING_SEED)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            pad_piece=SPECIAL_PIECES[0], unk_piece=SPECIAL_PIECES[1],
            bos_piece=SPECIAL_PIECES[2], eos_piece=SPECIAL_PIECES[3],
            user_defined_symbols=[language_tag(lang) for lang in langs],
            byte_fallback=True, input_sentence_size=0, shuffle_input_sentence=False,
            num_threads=TRAINING_THREADS, hard_vocab_limit=False, minloglevel=2)
    except RuntimeError as error:   # sentencepiece reports bad settings as RuntimeError
        raise ValueError(f"sentencepiece could not train a {vocab_size}-piece vocabulary: {error}; "
                         f"increase --vocab-size") from error
    model_bytes = model.getvalue()
    (out / "spm.model").write_bytes(model_bytes)
    processor = spm.SentencePieceProcessor(model_proto=model_bytes)
    (out / "spm.vocab").write_text("".join(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n"
                                           for i in range(processor.get_piece_size())),
                                   encoding="utf-8")
    meta = {"languages": langs, "vocab_size_requested": vocab_size, "model_type": model_type,
            "character_coverage": character_coverage, "max_sentences": max_sentences,
            "temperature": temperature, "training_sentences": len(sentences),
            "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
            "corpus": Manifest.load(corpus_dir).name,
            "corpus_manifest_sha256": manifest_digest(corpus_dir),
            "ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}}
    (out / "tokenizer.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n",
                                        encoding="utf-8")
    return TranslationTokenizer.load(out)



class TranslationTokenizer:
    """sentencepiece + language tags; see the module docstring for the sequence layout."""

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    def __init__(self, model_file: str | os.PathLike[str], languages: Sequence[str]) -> None:
        import sentencepiece as spm

        self.model_file = Path(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.languages = tuple(languages)
        self._tag_ids = {lang: self.sp.piece_to_id(language_tag(lang)) for lang in self.languages}
        wrong = [lang for lang, i in self._tag_ids.items() if i == UNK_ID]
        if wrong:
            raise ValueError(f"{model_file} has no tag for language(s) {wrong}: retrain the tokenizer")
        self._special_ids = {PAD_ID, BOS_ID, EOS_ID, *self._tag_ids.values()}

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> TranslationTokenizer:
        """Load `<directory>/spm.model` with the languages listed in its tokenizer.json."""
        meta_path = Path(directory) / "tokenizer.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"no tokenizer in {directory}: run `gpipe-repro corpus build` "
                                    f"(it trains one unless --vocab-size 0)")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        return cls(Path(directory) / "spm.model", meta["languages"])

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def language_id(self, language: str) -> int:
        if language not in self._tag_ids:
            raise KeyError(f"language {language!r} has no tag; this tokenizer knows "
                           f"{list(self.languages)}")
        return self._tag_ids[language]

    def encode_source(self, texts: Sequence[str], language: str,
                      add_tag: bool = True) -> list[list[int]]:
        prefix = [self.language_id(language)] if add_tag else []
        return [prefix + ids + [EOS_ID] for ids in self.sp.encode(list(texts))]

    def encode_target(self, texts: Sequence[str]) -> list[list[int]]:
        return [ids + [EOS_ID] for ids in self.sp.encode(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of one sequence; pad/bos/eos and language tags are dropped, decoding stops at eos."""
        pieces: list[int] = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i not in self._special_ids:
                pieces.append(i)
        return self.sp.decode(pieces)


def encode_split(corpus_dir: str | os.PathLike[str], tokenizer: TranslationTokenizer, split: str,
                 languages: Iterable[str] | None = None, max_len: int | None = None,
                 add_tag: bool = True) -> dict[str, TokenizedLanguage]:
    """Tokenize one split for `language_sampling.train_batches` / `eval_batches`.

    `max_len` drops pairs whose source or target (tags and eos included) is longer: use it for
    training, and leave it None for evaluation so every test sentence is scored.
    """
    data: dict[str, TokenizedLanguage] = {}
    for lang, pairs in read_split(corpus_dir, split, languages).items():
        sources = tokenizer.encode_source([s for s, _ in pairs], lang, add_tag)
        targets = tokenizer.encode_target([t for _, t in pairs])
        if max_len is not None:
            kept = [k for k in range(len(pairs))
                    if len(sources[k]) <= max_len and len(targets[k]) <= max_len]
            sources, targets = [sources[k] for k in kept], [targets[k] for k in kept]
        data[lang] = TokenizedLanguage.from_lists(sources, targets)
    return data
