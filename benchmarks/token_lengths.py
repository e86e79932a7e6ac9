"""Writes the token lengths the model benchmark draws its batches from (``lengths/``): real
texts from ``data/`` through a real tokenizer, so that padding and packing see real length
distributions.

    python -m benchmarks.token_lengths
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from examples.datasets import load_wikitext2_sections
from examples.pretrained import load_smollm2_tokenizer

LENGTHS_DIR = pathlib.Path(__file__).parent / "lengths"


def write_lengths(name: str, source: str, tokenizer_name: str, texts: list[str],
                  tokenizer) -> dict:
  """``lengths/{name}.json``: the token count of each text, with where they came from."""
  lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
  record = {"source": source, "tokenizer": tokenizer_name, "lengths": lengths}
  (LENGTHS_DIR / f"{name}.json").write_text(json.dumps(record))
  print(f"{name}: {len(lengths)} texts, tokens mean {np.mean(lengths):.0f}, median "
        f"{np.median(lengths):.0f}, 90th percentile {np.percentile(lengths, 90):.0f}, "
        f"max {max(lengths)}")
  return record


def main(argv=None) -> None:
  argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
  write_lengths("wikitext2_valid_sections_smollm2_bpe",
                "wikitext2 valid, the text between two headings (any level)",
                "SmolLM2 byte-level BPE (stand-in for the Llama-3.2 tokenizer)",
                load_wikitext2_sections(), load_smollm2_tokenizer())


if __name__ == "__main__":
  main()
