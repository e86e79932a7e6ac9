"""Profile how sparse the rows of each linear layer's output gradient dY are while a real
pretrained model fine-tunes: the SEBP paper's Tables 1-2 (MiniLM on SST-2, SmolLM2 on
WikiText-2), Fig. 2 (heat map of dY rows) and Fig. 3 (CDF of |dY| with its noise threshold ε).

SEBP's backward costs what the rows it keeps cost, so what it can save is set by how many rows
of dY are zero or negligible in each layer. To observe that sparsity as it is, every Dense layer
runs under ``use_sebp(threshold=0.0, row_log=...)`` without an ``active_mask``: each layer finds
the non-zero rows of its own dY and keeps them all, so the run is exact (the dense training
run), and logs each row's max ``|dY|`` and squared norm. After ``--steps`` AdamW steps it:

* estimates ε from the row maxima of all layers and steps pooled, and draws their CDF with ε
  marked (``cdf.png``);
* tabulates, per layer: the row sparsity of dY, active rows against the capacity the backward
  ran at, and the share of dY's squared norm that keeping only rows above ``--threshold`` (ε by
  default), at most ``--top-n`` of them, would drop; prints the table and writes it with the
  run's settings to ``layers.json``;
* draws the first step's row maxima of every layer, and of the first layer as the [B, L] batch
  (``heatmap.png``).

From the repository root (defaults small enough for a CPU):

    python -m examples.profile_sparsity --model minilm-sst2 --out /tmp/profile_minilm
    python -m examples.profile_sparsity --help
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from typing import Callable

import jax
import numpy as np
import optax

from examples import finetune_bert_sst2, finetune_llama
from examples.common import check_paths, fit
from examples.datasets import DATA_DIR, SST2_FILES, WIKITEXT2_FILES
from examples.pretrained import load_bert_classifier, load_smollm2
from sebp_jax import RowLog, use_sebp
from sebp_jax.analysis import (estimate_threshold, format_table, layer_table, plot_row_heatmap,
                               plot_threshold)


@dataclasses.dataclass(frozen=True)
class Setup:
  """One model and data set to profile, with its defaults."""
  model: str
  data: str
  data_files: tuple[str, ...]  # Under --data-dir.
  steps: int
  batch_size: int
  max_length: int
  learning_rate: float
  weight_decay: float
  lm_head: bool
  # (args) -> (params, train batches, dense loss (params, batch, capacity=None) -> scalar)
  prepare: Callable


def _prepare_minilm_sst2(args):
  model, params, tokenizer = load_bert_classifier(num_labels=2, seed=args.seed)
  return (params, finetune_bert_sst2.load_train_batches(tokenizer, args),
          finetune_bert_sst2.make_loss(model, packed=False))


def _prepare_smollm2_wikitext(args):
  model, params, tokenizer = load_smollm2()
  return (params, finetune_llama.load_train_batches(tokenizer, args),
          finetune_llama.make_loss(model, lm_head=False, packed=False))


SETUPS = {
    "minilm-sst2": Setup("all-MiniLM-L6-v2", "SST-2 train", SST2_FILES, steps=3, batch_size=16,
                         max_length=128, learning_rate=1e-4, weight_decay=0.01, lm_head=False,
                         prepare=_prepare_minilm_sst2),
    "smollm2-wikitext": Setup("SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
                              "WikiText-2 valid", WIKITEXT2_FILES, steps=2, batch_size=4,
                              max_length=256, learning_rate=3e-5, weight_decay=0.0, lm_head=True,
                              prepare=_prepare_smollm2_wikitext),
}


def _threshold(text: str) -> float | str:
  if text == "auto":
    return text
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be 'auto' or a number, got {text!r}") from None
  if not value >= 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
  return value


def _per_model(field: str) -> str:
  return ", ".join(f"{getattr(setup, field)} for {name}" for name, setup in SETUPS.items())


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=sorted(SETUPS), default="minilm-sst2",
                      help="the pretrained model and the data it fine-tunes on "
                           "(default: minilm-sst2)")
  parser.add_argument("--steps", type=int, help=f"training steps (default: {_per_model('steps')})")
  parser.add_argument("--batch-size", type=int,
                      help=f"sequences per step (default: {_per_model('batch_size')})")
  parser.add_argument("--max-length", type=int,
                      help="tokens per sequence, truncated or right-padded to it "
                           f"(default: {_per_model('max_length')})")
  parser.add_argument("--learning-rate", type=float,
                      help=f"AdamW learning rate (default: {_per_model('learning_rate')})")
  parser.add_argument("--top-n", type=int,
                      help="cap of kept rows per layer for the dropped-share columns "
                           "(default: none)")
  parser.add_argument("--threshold", type=_threshold, default="auto",
                      help="ε of the dropped-share columns: rows whose max |dY| is at most it "
                           "count as dropped; 'auto' estimates it from the run's row maxima "
                           "(default: auto)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the data order and of the "
                      "classification head (default: 0)")
  parser.add_argument("--data-dir", type=pathlib.Path, default=DATA_DIR,
                      help="folder holding sst2/ and wikitext2/ (default: the repository's data/)")
  parser.add_argument("--out", "--out-dir", type=pathlib.Path,
                      help="folder for cdf.png, heatmap.png and layers.json, as the other "
                           "examples' --out (--out-dir: its former name; default: "
                           "runs/profile/MODEL)")
  args = parser.parse_args(argv)
  setup = SETUPS[args.model]
  if args.out is None:
    args.out = pathlib.Path("runs/profile") / args.model
  for name in ("steps", "batch_size", "max_length", "learning_rate"):
    if getattr(args, name) is None:
      setattr(args, name, getattr(setup, name))
  for name in ("steps", "batch_size", "max_length", "top_n"):
    value = getattr(args, name)
    if value is not None and value <= 0:
      parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
  if not 0 < args.learning_rate < float("inf"):
    parser.error(f"--learning-rate must be positive and finite, got {args.learning_rate}")
  if args.seed < 0:
    parser.error(f"--seed must be 0 or more, got {args.seed}")
  check_paths(parser, args, setup.data_files)
  return args


def profiled_loss(dense_loss, row_log: RowLog, lm_head: bool, forward_order: list[str]):
  """``dense_loss`` with every Dense layer (and, with ``lm_head``, the LM head) on the exact
  SEBP backward, each selecting its rows from its own dY and reporting them to ``row_log``.
  Tracing it fills ``forward_order`` with the swapped layers in the order the forward runs
  them."""
  def loss_fn(params, batch, capacity):
    with use_sebp(threshold=0.0, row_log=row_log, lm_head=lm_head, embeddings=False) as report:
      loss = dense_loss(params, batch, capacity)
    forward_order[:] = report.swapped
    return loss
  return loss_fn


def main(argv=None) -> dict:
  args = parse_args(argv)
  setup = SETUPS[args.model]
  args.out.mkdir(parents=True, exist_ok=True)

  params, train_batches, dense_loss = setup.prepare(args)
  if len(train_batches) < args.steps:
    raise SystemExit(f"{setup.data} has only {len(train_batches)} batches of {args.batch_size}")
  real_tokens = [int(batch["attention_mask"].sum()) for batch in train_batches]
  rows = args.batch_size * args.max_length
  print(f"{setup.model} on {setup.data}: {args.steps} steps of {args.batch_size}x"
        f"{args.max_length}; real tokens per batch: mean {np.mean(real_tokens):.0f} of {rows}")

  row_log = RowLog(row_values=True)
  forward_order: list[str] = []
  optimizer = optax.adamw(args.learning_rate, weight_decay=setup.weight_decay)
  _, losses, _ = fit(profiled_loss(dense_loss, row_log, setup.lm_head, forward_order), params,
                     train_batches, optimizer, "profile", [None] * len(train_batches))
  position = {layer: i for i, layer in enumerate(forward_order)}
  records = sorted(row_log.records, key=lambda record: position[record["layer"]])

  row_maxima = np.concatenate([record["row_max_abs"] for record in records])
  estimated = estimate_threshold(row_maxima)
  plot_threshold(row_maxima, estimated, args.out / "cdf.png",
                 title=f"max |dY| of each row, all {len(forward_order)} layers, {args.steps} "
                       f"steps: {args.model}")
  threshold = estimated if args.threshold == "auto" else args.threshold
  table = layer_table(records, top_n=args.top_n, threshold=threshold)
  plot_row_heatmap(records, args.out / "heatmap.png",
                   batch_shape=(args.batch_size, args.max_length), layers=forward_order)

  summary = {
      "model": setup.model, "data": setup.data, "steps": args.steps,
      "batch_size": args.batch_size, "max_length": args.max_length,
      "learning_rate": args.learning_rate, "seed": args.seed, "top_n": args.top_n,
      "threshold": threshold, "estimated_threshold": estimated,
      "real_tokens": real_tokens, "padding_share": 1 - float(np.mean(real_tokens)) / rows,
      "losses": losses, "device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
      "layers": table,
  }
  (args.out / "layers.json").write_text(json.dumps(summary, indent=2))
  print(format_table(table))
  sparsity = [row["row_sparsity"] for row in table]
  print(f"row sparsity of dY: mean {np.mean(sparsity):.3f} over {len(table)} layers (min "
        f"{min(sparsity):.3f}, max {max(sparsity):.3f}); padding share of rows "
        f"{summary['padding_share']:.3f}; ε estimated {estimated:.3g}, used {threshold:.3g}, "
        f"top_n {args.top_n}")
  written = (args.out / name for name in ("cdf.png", "heatmap.png", "layers.json"))
  print(f"wrote {', '.join(map(str, written))}")
  return summary


if __name__ == "__main__":
  main()
