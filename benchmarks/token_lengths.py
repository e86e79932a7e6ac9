"""Writes the token lengths the model benchmark draws its batches from (``lengths/``): real
texts from ``data/`` through a real tokenizer, so that padding and packing see real length
distributions.

    python -m benchmarks.token_lengths [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from benchmarks.model import LENGTHS_DIR
from examples.datasets import load_sst2, load_wikitext2, load_wikitext2_sections
from examples.pretrained import load_minilm_tokenizer, load_smollm2_tokenizer

SMOLLM2_BPE = "SmolLM2 byte-level BPE (stand-in for the Llama-3.2 tokenizer)"


def write_lengths(out: pathlib.Path, name: str, source: str, tokenizer_name: str,
                  texts: list[str], tokenizer, *, special_tokens: bool) -> dict:
  """``{out}/{name}.json``: the token count of each text, with where they came from."""
  ids = tokenizer(texts, add_special_tokens=special_tokens)["input_ids"]
  lengths = [len(text_ids) for text_ids in ids]
  record = {"source": source, "tokenizer": tokenizer_name, "lengths": lengths}
  path = out / f"{name}.json"
  path.write_text(json.dumps(record))
  print(f"{path}: {len(lengths)} texts, tokens mean {np.mean(lengths):.0f}, median "
        f"{np.median(lengths):.0f}, 90th percentile {np.percentile(lengths, 90):.0f}, "
        f"max {max(lengths)}")
  return record


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.token_lengths",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=pathlib.Path, default=LENGTHS_DIR,
                      help="folder to write the files into (default: the one the benchmarks "
                           "read, %(default)s)")
  out = parser.parse_args(argv).out
  out.mkdir(parents=True, exist_ok=True)
  write_lengths(out, "sst2_dev_bert_wordpiece", "sst2_dev_bert_wordpiece",
                "bert-base-uncased WordPiece (all-MiniLM-L6-v2 tokenizer), with [CLS]/[SEP]",
                [sentence for sentence, _ in load_sst2("dev")], load_minilm_tokenizer(),
                special_tokens=True)
  smollm2 = load_smollm2_tokenizer()
  write_lengths(out, "wikitext2_valid_smollm2_bpe", "wikitext2_valid_smollm2_bpe", SMOLLM2_BPE,
                load_wikitext2(), smollm2, special_tokens=False)
  write_lengths(out, "wikitext2_valid_sections_smollm2_bpe",
                "wikitext2 valid, the text between two headings (any level)", SMOLLM2_BPE,
                load_wikitext2_sections(), smollm2, special_tokens=False)


if __name__ == "__main__":
  main()
