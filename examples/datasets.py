"""SST-2 and WikiText-2 from the repository's ``data/`` folder, fixed-length encoding, batching.

``data/`` holds ``sst2/{train,dev}.tsv`` and ``wikitext2/valid.txt``; ``data/README.md`` says
where they come from and under which terms.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

#: The data carried in the repository: the folder holding ``sst2/`` and ``wikitext2/``.
DATA_DIR = pathlib.Path(__file__).resolve().parents[1] / "data"
#: The files under a data folder that SST-2's and WikiText-2's loaders read.
SST2_FILES = ("sst2/train.tsv", "sst2/dev.tsv")
WIKITEXT2_FILES = ("wikitext2/valid.txt",)
_SST2_SPLITS = ("train", "dev")


def _dataset_file(data_dir: str | pathlib.Path, *parts: str) -> pathlib.Path:
  path = pathlib.Path(data_dir).joinpath(*parts)
  if not path.is_file():
    raise FileNotFoundError(f"{path} does not exist")
  return path


def load_sst2(split: str, data_dir: str | pathlib.Path = DATA_DIR,
              limit: int | None = None) -> list[tuple[str, int]]:
  """SST-2 sentences and binary sentiment labels (1 = positive), in file order.

  Args:
    split: "train" (60,614 rows) or "dev" (6,735 rows).
    data_dir: folder holding ``sst2/{split}.tsv`` (header ``sentence<TAB>label``).
    limit: keep only the first ``limit`` rows.

  Returns:
    [(sentence, label)], sentences stripped of the trailing space the files carry.
  """
  if split not in _SST2_SPLITS:
    raise ValueError(f"split must be one of {_SST2_SPLITS}, got {split!r}")
  path = _dataset_file(data_dir, "sst2", f"{split}.tsv")
  examples = []
  with path.open(encoding="utf-8") as lines:
    header = next(lines).rstrip("\n").split("\t")
    if header != ["sentence", "label"]:
      raise ValueError(f"{path}: unexpected header {header}")
    for line_number, line in enumerate(lines, start=2):
      if limit is not None and len(examples) >= limit:
        break
      # Split on the last tab only: plain str.split, not csv, because sentences contain quotes.
      sentence, label = line.rstrip("\n").rsplit("\t", 1)
      if label not in ("0", "1"):
        raise ValueError(f"{path}:{line_number}: label {label!r} is not 0 or 1")
      examples.append((sentence.strip(), int(label)))
  return examples


def load_wikitext2_sections(data_dir: str | pathlib.Path = DATA_DIR) -> list[str]:
  """WikiText-2 validation sections: the paragraphs between two headings (any level), one
  text each, paragraphs joined by newlines; long documents of the kind long-context
  fine-tuning packs.

  Args:
    data_dir: folder holding ``wikitext2/valid.txt``.
  """
  path = _dataset_file(data_dir, "wikitext2", "valid.txt")
  sections, current = [], []
  with path.open(encoding="utf-8") as lines:
    for line in lines:
      text = line.strip()
      if text.startswith("=") and text.endswith("="):
        sections.append(current)
        current = []
      elif text:
        current.append(text)
  sections.append(current)
  return ["\n".join(paragraphs) for paragraphs in sections if paragraphs]


def load_wikitext2(data_dir: str | pathlib.Path = DATA_DIR) -> list[str]:
  """WikiText-2 validation paragraphs, stripped, without blank lines and ``= Heading =`` lines.

  Args:
    data_dir: folder holding ``wikitext2/valid.txt``.
  """
  path = _dataset_file(data_dir, "wikitext2", "valid.txt")
  paragraphs = []
  with path.open(encoding="utf-8") as lines:
    for line in lines:
      text = line.strip()
      is_heading = text.startswith("=") and text.endswith("=")
      if text and not is_heading:
        paragraphs.append(text)
  return paragraphs


def encode_fixed_length(tokenizer, texts: Sequence[str], max_length: int) -> dict[str, np.ndarray]:
  """Tokenise, truncate to ``max_length`` and right-pad to exactly ``max_length``.

  Works for tokenizers with or without a pad token: the pad id is the tokenizer's pad id, else its
  eos id, else 0; padded positions are identified only by ``attention_mask`` == 0. Truncation is
  done by the tokenizer, so special tokens it adds (BERT's [SEP]) survive it.

  Returns:
    {"input_ids": int32 [len(texts), max_length], "attention_mask": int32 [len(texts), max_length]},
    the mask 1 on the real tokens (a prefix of each row) and 0 on padding.
  """
  pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
  token_ids = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
  input_ids = np.full((len(token_ids), max_length), pad_id, dtype=np.int32)
  attention_mask = np.zeros((len(token_ids), max_length), dtype=np.int32)
  for row, ids in enumerate(token_ids):
    input_ids[row, :len(ids)] = ids
    attention_mask[row, :len(ids)] = 1
  return {"input_ids": input_ids, "attention_mask": attention_mask}


def batches(arrays: Mapping[str, np.ndarray],
            batch_size: int) -> Iterator[dict[str, np.ndarray]]:
  """Consecutive mini-batches: dicts with the same keys as ``arrays``, each value [batch, ...].

  All arrays must share their leading dimension N; the examples shuffle before encoding. A
  final short batch is skipped, keeping shapes static for jit.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  if not arrays:
    raise ValueError("arrays is empty")
  arrays = {name: np.asarray(array) for name, array in arrays.items()}
  lengths = {name: len(array) for name, array in arrays.items()}
  if len(set(lengths.values())) != 1:
    raise ValueError(f"arrays must share their leading dimension, got {lengths}")
  num_examples = next(iter(lengths.values()))
  stop = num_examples - num_examples % batch_size
  # The checks above run at call time; only the slicing is deferred to iteration.
  return ({name: array[start:start + batch_size] for name, array in arrays.items()}
          for start in range(0, stop, batch_size))


def grouped_batches(arrays: Mapping[str, np.ndarray], groups: Sequence[Sequence[int]],
                    batch_size: int) -> list[dict[str, np.ndarray]]:
  """One mini-batch per group of example indices (:func:`sebp_jax.token_budget_batches`),
  each padded to ``batch_size`` rows with empty ones (all zeros: no real token), so that every
  batch has one shape."""
  out = []
  for group in groups:
    if not 0 < len(group) <= batch_size:
      raise ValueError(f"a group of {len(group)} examples does not fit {batch_size} rows")
    out.append({name: np.concatenate([np.asarray(array)[list(group)], np.zeros(
        (batch_size - len(group), *np.shape(array)[1:]), np.asarray(array).dtype)])
        for name, array in arrays.items()})
  return out
