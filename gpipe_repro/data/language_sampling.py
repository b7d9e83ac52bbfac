"""Multilingual batches: temperature sampling over languages, length bucketing, padding.

Why temperature sampling. The paper trains one model on languages whose data sizes differ by five
orders of magnitude. Sampling pairs in proportion to the data (T=1) starves low-resource languages;
sampling languages uniformly (T=inf) overfits them. The paper (after Arivazhagan et al. 2019) samples
language l with probability p_l proportional to (n_l / N)^(1/T), T=5 here by default.

Why buckets. A batch is padded to its longest sentence; drawing a pool of pairs and cutting it into
batches in length order keeps similar lengths together, so little compute goes to padding. The batch
ORDER is then shuffled so training does not see lengths in sequence.

The batch format (what the model and the training loop consume): `TranslationBatch`, every tensor
batch-first so that GPipe's micro-batching (tensor_split along dim 0) cuts all of them consistently:

    src_ids   LongTensor (B, S)   [<lang>] source pieces [eos], right-padded with pad_id
    tgt_in    LongTensor (B, T)   [bos] target pieces         (decoder input, teacher forcing)
    tgt_out   LongTensor (B, T)   target pieces [eos]         (labels; pad_id where padded)
    src_lang  LongTensor (B,)     index of the source language in `languages` (the sorted tuple)
    index     LongTensor (B,)     position of the pair in its TokenizedLanguage (= line of the split
                                  file when encoded with max_len=None); eval reorders outputs by it
    src_pad_mask / tgt_pad_mask   BoolTensor, True at PADDING (nn.MultiheadAttention's
                                  key_padding_mask convention); `num_target_tokens` counts labels.

`batch.as_tuple()` gives `(src_ids, tgt_in, tgt_out, src_lang)`. The loss is token-level cross
entropy on tgt_out with `ignore_index=pad_id` (tokenizer: pad 0, unk 1, bos 2, eos 3).

Everything is deterministic given the seed: numpy's PCG64 generator drives the language draws, the
per-language permutations and the batch order; no global RNG is touched.

End to end (after `gpipe-repro corpus build`):

    corpus = default_data_dir() / "gettext"                      # gpipe_repro.data.corpus_manifest
    tok = TranslationTokenizer.load(corpus / "spm8000")          # gpipe_repro.data.tokenizer
    train = encode_split(corpus, tok, "train", max_len=128)      # {lang: TokenizedLanguage}
    for batch in train_batches(train, max_tokens=4096, temperature=5.0, seed=0):
        src_ids, tgt_in, tgt_out, src_lang = batch.as_tuple()
    test = encode_split(corpus, tok, "test")                     # max_len=None: score every pair
    for i, lang in enumerate(sorted(test)):                      # per-language BLEU
        for batch in eval_batches(test[lang], i, max_tokens=4096): ...
    Manifest.load(corpus).languages[lang]["resource"]            # "high" | "low"
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

if TYPE_CHECKING:   # torch is imported where batches are made, not when this module is imported
    import torch

DEFAULT_TEMPERATURE = 5.0


def temperature_probabilities(sizes: Mapping[str, int],
                              temperature: float = DEFAULT_TEMPERATURE) -> dict[str, float]:
    """p_l proportional to (n_l / N)^(1/T) over the languages with n_l > 0 (others get 0)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    total = sum(sizes.values())
    if total <= 0:
        raise ValueError("temperature sampling needs at least one language with data")
    weights = {lang: (n / total) ** (1.0 / temperature) if n > 0 else 0.0
               for lang, n in sizes.items()}
    norm = sum(weights.values())
    return {lang: w / norm for lang, w in weights.items()}


def resource_groups(sizes: Mapping[str, int], threshold: int | None = None) -> dict[str, str]:
    """"high" or "low" resource per language, by training-set size.

    Default threshold: the median size, so the languages split into two halves (the larger half is
    "high"), which is how the paper's Figure 1b contrasts the two ends of its sorted language axis.
    """
    if not sizes:
        return {}
    if threshold is None:
        ordered = sorted(sizes.values(), reverse=True)
        threshold = ordered[(len(ordered) - 1) // 2]
    return {lang: "high" if n >= threshold else "low" for lang, n in sizes.items()}


@dataclass
class TokenizedLanguage:
    """One language's pairs as flat int32 token arrays with offsets (compact for 10^6 pairs)."""
    src_tokens: np.ndarray   # int32, concatenation of every source sequence
    src_offsets: np.ndarray  # int64, n + 1 offsets into src_tokens
    tgt_tokens: np.ndarray   # int32, target sequences WITHOUT bos (pieces + eos)
    tgt_offsets: np.ndarray

    @classmethod
    def from_lists(cls, sources: Sequence[Sequence[int]],
                   targets: Sequence[Sequence[int]]) -> TokenizedLanguage:
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} targets")

        def flat(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
            lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
            offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            tokens = np.fromiter((t for s in seqs for t in s), dtype=np.int32, count=int(offsets[-1]))
            return tokens, offsets

        src, src_off = flat(sources)
        tgt, tgt_off = flat(targets)
        return cls(src, src_off, tgt, tgt_off)

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    @property
    def src_lengths(self) -> np.ndarray:
        return np.diff(self.src_offsets)

    @property
    def tgt_lengths(self) -> np.ndarray:
        return np.diff(self.tgt_offsets)

    def source(self, i: int) -> np.ndarray:
        return self.src_tokens[self.src_offsets[i]: self.src_offsets[i + 1]]

    def target(self, i: int) -> np.ndarray:
        return self.tgt_tokens[self.tgt_offsets[i]: self.tgt_offsets[i + 1]]


# Tokenized languages by language index: a list (training) or {index: table} (one language, eval).
Tables = Union[Mapping[int, TokenizedLanguage], Sequence[TokenizedLanguage]]


@dataclass
class TranslationBatch:
    """A padded batch; see the module docstring for the meaning of each field."""
    src_ids: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    src_lang: torch.Tensor
    index: torch.Tensor
    pad_id: int

    @property
    def src_pad_mask(self) -> torch.Tensor:
        return self.src_ids == self.pad_id

    @property
    def tgt_pad_mask(self) -> torch.Tensor:
        return self.tgt_out == self.pad_id

    @property
    def num_target_tokens(self) -> int:
        return int((self.tgt_out != self.pad_id).sum())

    def __len__(self) -> int:
        return int(self.src_ids.shape[0])

    def as_tuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.src_ids, self.tgt_in, self.tgt_out, self.src_lang


def collate(data: Tables, items: Sequence[tuple[int, int]], *, pad_id: int,
            bos_id: int) -> TranslationBatch:
    """Pad the pairs `items` = [(language index, pair index), ...] into a TranslationBatch."""
    import torch

    sources = [data[lang].source(i) for lang, i in items]
    targets = [data[lang].target(i) for lang, i in items]
    batch = len(items)
    src = np.full((batch, max(len(s) for s in sources)), pad_id, dtype=np.int64)
    tgt_len = max(len(t) for t in targets)
    tgt_in = np.full((batch, tgt_len), pad_id, dtype=np.int64)
    tgt_out = np.full((batch, tgt_len), pad_id, dtype=np.int64)
    for row, (s, t) in enumerate(zip(sources, targets)):
        src[row, :len(s)] = s
        tgt_out[row, :len(t)] = t
        tgt_in[row, 0] = bos_id
        tgt_in[row, 1:len(t)] = t[:-1]       # shifted right: bos + pieces (the eos is not an input)
    return TranslationBatch(
        src_ids=torch.from_numpy(src), tgt_in=torch.from_numpy(tgt_in),
        tgt_out=torch.from_numpy(tgt_out),
        src_lang=torch.tensor([lang for lang, _ in items], dtype=torch.long),
        index=torch.tensor([i for _, i in items], dtype=torch.long), pad_id=pad_id)


def _pair_cost(data: Tables, lang: int, i: int) -> int:
    """Padded tokens a pair occupies per row: the longer of its source and target."""
    d = data[lang]
    return int(max(d.src_offsets[i + 1] - d.src_offsets[i], d.tgt_offsets[i + 1] - d.tgt_offsets[i]))


def cut_batches(costs: Sequence[int], max_tokens: int | None,
                max_sentences: int | None) -> list[tuple[int, int]]:
    """Cut a length-sorted sequence into [start, end) batches.

    A batch holds at most `max_sentences` pairs and at most `max_tokens` padded tokens, where padded
    tokens = rows * longest row (of the longer side). A pair longer than max_tokens forms a batch alone.
    """
    if max_tokens is None and max_sentences is None:
        raise ValueError("give max_tokens and/or max_sentences")
    spans = []
    start, longest = 0, 0
    for i, cost in enumerate(costs):
        new_longest = max(longest, cost)
        rows = i - start + 1
        too_many = max_sentences is not None and rows > max_sentences
        too_big = max_tokens is not None and rows * new_longest > max_tokens
        if rows > 1 and (too_many or too_big):
            spans.append((start, i))
            start, new_longest = i, cost
        longest = new_longest
    if start < len(costs):
        spans.append((start, len(costs)))
    return spans


def train_batches(data: Mapping[str, TokenizedLanguage], *, max_tokens: int | None = 4096,
                  max_sentences: int | None = None, temperature: float = DEFAULT_TEMPERATURE,
                  seed: int = 0, pool_size: int = 16384, pad_id: int = 0,
                  bos_id: int = 2) -> Iterator[TranslationBatch]:
    """Endless training batches: languages drawn by temperature, pairs bucketed by length.

    Each round draws `pool_size` pairs: a language per pair from p_l (`temperature_probabilities` on
    the language sizes), then that language's next pair from a per-language permutation (a fresh
    permutation after each pass over the language, so every pair is seen once per pass). The pool is
    sorted by length, cut by `cut_batches`, and the batches are yielded in shuffled order.
    `src_lang` indexes `sorted(data)`.
    """
    languages = sorted(data)
    tables = [data[lang] for lang in languages]
    sizes = {lang: len(data[lang]) for lang in languages}
    probs = temperature_probabilities(sizes, temperature)
    p = np.array([probs[lang] for lang in languages])
    rng = np.random.default_rng(seed)
    orders = [rng.permutation(len(t)) for t in tables]
    cursors = [0] * len(tables)
    while True:
        counts = np.bincount(rng.choice(len(languages), size=pool_size, p=p),
                             minlength=len(languages))
        pool: list[tuple[int, int]] = []
        for lang, count in enumerate(counts):
            for _ in range(int(count)):
                if cursors[lang] == len(orders[lang]):
                    orders[lang], cursors[lang] = rng.permutation(len(tables[lang])), 0
                pool.append((lang, int(orders[lang][cursors[lang]])))
                cursors[lang] += 1
        costs = np.array([_pair_cost(tables, lang, i) for lang, i in pool])
        order = np.argsort(costs, kind="stable")
        pool = [pool[k] for k in order]
        spans = cut_batches(costs[order].tolist(), max_tokens, max_sentences)
        for b in rng.permutation(len(spans)):
            start, end = spans[b]
            yield collate(tables, pool[start:end], pad_id=pad_id, bos_id=bos_id)


def eval_batches(data: TokenizedLanguage, language_index: int, *, max_tokens: int | None = 4096,
                 max_sentences: int | None = None, pad_id: int = 0,
                 bos_id: int = 2) -> Iterator[TranslationBatch]:
    """Every pair of one language exactly once, in length order; `batch.index` restores file order."""
    if len(data) == 0:
        return
    costs = np.maximum(data.src_lengths, data.tgt_lengths)
    order = np.argsort(costs, kind="stable")
    tables = {language_index: data}
    for start, end in cut_batches(costs[order].tolist(), max_tokens, max_sentences):
        items = [(language_index, int(i)) for i in order[start:end]]
        yield collate(tables, items, pad_id=pad_id, bos_id=bos_id)
