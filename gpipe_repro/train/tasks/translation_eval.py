"""Scoring a many-to-English model: translations of each language's evaluation sample, BLEU per
language and per resource group, token NLL.

Why pooled BLEU per group. The paper contrasts high- and low-resource languages. Our low-resource
test sets hold a few dozen short sentences each, so a per-language BLEU swings by several points
with one sentence; pooling the n-gram statistics of every sentence of a group into one corpus BLEU
(sacrebleu over the concatenated hypotheses and references) is far steadier than averaging noisy
per-language scores. Both are reported: pooled per group, and the per-language scores (with their
sentence counts) for the plot against training-set size.

Translations come from a cached decoder (`translation_decoders.py`) and the search of
`translation_search.py`; teacher-forced NLL, one big batch, always goes through the pipelined forward.
References are the corpus's raw English sentences (not the detokenized pieces), scored with
sacrebleu's default 13a tokenization.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gpipe_repro.data.language_sampling import TokenizedLanguage, TranslationBatch, eval_batches
from gpipe_repro.train.tasks.translation_search import Decoder, decode_batch


def evenly_spaced(n: int, limit: int | None) -> np.ndarray:
    """`limit` indices spread evenly over range(n) (all of them when n <= limit): a deterministic
    sample that does not favour one end of a file sorted by its English side."""
    if limit is None or n <= limit:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, limit).round().astype(np.int64))


def subset(data: TokenizedLanguage, indices: np.ndarray) -> TokenizedLanguage:
    return TokenizedLanguage.from_lists([data.source(int(i)).tolist() for i in indices],
                                        [data.target(int(i)).tolist() for i in indices])


@dataclass
class EvalLanguage:
    """One language's evaluation sample: its tokenized pairs and the raw English references."""
    language: str
    index: int                   # position in the task's sorted language list (its src_lang id)
    data: TokenizedLanguage
    references: list[str]
    train_size: int
    group: str                   # "high" | "low"


@torch.no_grad()
def translate(decoder: Decoder, item: EvalLanguage, decode_text: Callable[[list[int]], str], *,
              device: torch.device, beam: int, max_tokens: int, max_len: int, pad_id: int,
              bos_id: int, eos_id: int) -> list[str]:
    """Hypotheses for every pair of `item`, in its order (eval_batches sorts by length; `index`
    puts them back). `decode_text(ids) -> str` is the tokenizer's decode; `device` is where the
    decoder takes its source ids (the first cell's)."""
    out: list[str] = [""] * len(item.data)
    for batch in eval_batches(item.data, item.index, max_tokens=max_tokens, pad_id=pad_id,
                              bos_id=bos_id):
        ids = decode_batch(decoder, batch.src_ids.to(device), beam=beam, bos_id=bos_id,
                           eos_id=eos_id, pad_id=pad_id, max_len=max_len).cpu()
        for row, position in enumerate(batch.index.tolist()):
            out[position] = decode_text(ids[row, 1:].tolist())
    return out


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """sacrebleu corpus BLEU (13a tokenization, default smoothing); 0 for an empty set."""
    import sacrebleu

    if not hypotheses:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def bleu_by_language_and_group(hypotheses: Mapping[str, Sequence[str]],
                               items: Sequence[EvalLanguage]) -> dict[str, float]:
    """`bleu_<lang>` per language, `bleu_<group>` pooled over each group's sentences, `bleu` pooled
    over every sentence, and `bleu_<group>_mean` (the unweighted mean of the group's languages)."""
    metrics: dict[str, float] = {}
    pooled: dict[str, tuple[list[str], list[str]]] = {}
    per_group: dict[str, list[float]] = {}
    for item in items:
        hyps = list(hypotheses[item.language])
        score = corpus_bleu(hyps, item.references)
        metrics[f"bleu_{item.language}"] = score
        per_group.setdefault(item.group, []).append(score)
        for key in (item.group, "all"):
            h, r = pooled.setdefault(key, ([], []))
            h += hyps
            r += item.references
    for key, (h, r) in sorted(pooled.items()):
        metrics["bleu" if key == "all" else f"bleu_{key}"] = corpus_bleu(h, r)
    for group, scores in sorted(per_group.items()):
        metrics[f"bleu_{group}_mean"] = float(np.mean(scores))
    return metrics


def teacher_forced_batches(items: Sequence[EvalLanguage], max_tokens: int, pad_id: int,
                           bos_id: int) -> Iterator[TranslationBatch]:
    for item in items:
        yield from eval_batches(item.data, item.index, max_tokens=max_tokens, pad_id=pad_id,
                                bos_id=bos_id)


def token_nll(outputs: Iterator[torch.Tensor], batches: Sequence[TranslationBatch],
              pad_id: int) -> float:
    """Mean negative log-likelihood per target token (nats, no label smoothing) of logits
    `outputs` (one per batch, e.g. a pipelined forward) against the batches' `tgt_out`."""
    total, tokens = 0.0, 0
    for batch, logits in zip(batches, outputs):
        target = batch.tgt_out.to(logits.device)
        total += float(F.cross_entropy(logits.float().flatten(0, 1), target.flatten(),
                                       ignore_index=pad_id, reduction="sum"))
        tokens += batch.num_target_tokens
    return total / max(tokens, 1)
