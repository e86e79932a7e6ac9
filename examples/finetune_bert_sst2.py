"""Fine-tune the pretrained all-MiniLM-L6-v2 (BERT) on SST-2, dense vs SEBP, from the same seed.

Sentences are padded to a fixed length (default 128 tokens, far longer than most SST-2
sentences), so most rows of every layer are padding. The SEBP run wraps the unmodified
transformers model in ``use_sebp(active_mask=attention_mask, packed=True)``: the encoder runs on
the batch's real tokens only, packed into one sequence with per-sequence attention, and the
three embedding lookups take the SEBP backward on the index of the real tokens. With
``--no-packed`` the encoder runs on every row and its 36 Dense layers take the SEBP backward
on that index instead.

With ``--devices N`` both runs train on N devices, FSDP (``sebp_jax.sharding.fsdp_loss``): the
weights and AdamW's moments split over the devices, each device running the loss on its own
sentences of every batch, packed at its own capacity; the losses are one device's. The timing
stays on one device. ``--compiler-option NAME=VALUE`` passes an XLA option to the step's
compile.

Prints the loss and the dev accuracy of both runs, their largest per-step loss difference and
the backward- and gradient-time ratios, and writes ``loss_curves.png`` and ``summary.json``
under ``--out``.
From the repository root:

    python -m examples.finetune_bert_sst2            # the default run (the README's demo)
    python -m examples.finetune_bert_sst2 --devices 2
    python -m examples.finetune_bert_sst2 --help
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from benchmarks.harness import data_parallel_mesh
from examples.common import (describe_batches, finish_run, fit, loss_trend, parse_training_args,
                             run_capacities, sebp_context, timed_capacity)
from examples.datasets import SST2_FILES, batches, encode_fixed_length, load_sst2
from examples.pretrained import MINILM_POSITIONS, load_bert_classifier
from sebp_jax import RowLog

MODES = ("dense", "sebp")


def parse_args(argv=None):
  def dev_examples(parser):
    parser.add_argument("--dev-examples", type=int, default=872,
                        help="sentences of sst2/dev.tsv to score, from its first")
  return parse_training_args(__spec__.name, __doc__, argv, steps=70, batch_size=32,
                             max_length=128, learning_rate=1e-4, weight_decay=0.01,
                             timing_repeats=5, out="runs/sst2", data_files=SST2_FILES,
                             extra=dev_examples,
                             devices=True, longest=MINILM_POSITIONS)


def learning_rate_schedule(args: argparse.Namespace) -> optax.Schedule:
  """A tenth of the steps' warm-up from 0 to ``--learning-rate``, then a cosine decay to 0 at
  the last step (a run of one step: the warm-up alone)."""
  warmup = max(1, args.steps // 10)
  return optax.warmup_cosine_decay_schedule(0.0, args.learning_rate, warmup,
                                            max(args.steps, warmup + 1))


def make_loss(model, packed: bool, row_log: RowLog | None = None):
  """Mean cross-entropy of a batch; with a static ``capacity`` (the batch's, picked on the
  host), the encoder packed onto the batch's real tokens in that many slots (``packed``) or
  its Dense layers on SEBP with their index at that capacity (exact either way: the loss
  reads [CLS] only and attention masks padding); dense without. Dropout is off: the run is
  short, and dense and SEBP then see identical forwards."""
  def loss_fn(params, batch, capacity):
    with sebp_context(capacity, batch["attention_mask"], packed=packed, row_log=row_log):
      logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                     params=params).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
  return loss_fn


def accuracy(model, params, dev: dict[str, np.ndarray], batch_size: int, desc: str) -> float:
  """Dev accuracy, with a progress bar labelled ``desc``. Each batch is cut to its longest
  sentence (rounded up to 16 to bound the number of compiled shapes): with padding masked, the
  logits are the same."""
  predict = jax.jit(lambda p, ids, mask: jnp.argmax(
      model(ids, attention_mask=mask, params=p).logits, -1))
  correct = 0
  starts = range(0, len(dev["labels"]), batch_size)
  for start in tqdm(starts, desc=desc, unit="batch", file=sys.stdout):
    mask = dev["attention_mask"][start:start + batch_size]
    length = min(mask.shape[1], -(-int(mask.sum(1).max()) // 16) * 16)
    ids = dev["input_ids"][start:start + batch_size, :length]
    correct += int(np.sum(np.asarray(predict(params, ids, mask[:, :length]))
                          == dev["labels"][start:start + batch_size]))
  return correct / len(dev["labels"])


def load_train_batches(tokenizer, args) -> list[dict[str, np.ndarray]]:
  """``args.steps`` batches of SST-2 training sentences in a seeded random order, padded to
  ``args.max_length``, with their labels."""
  train = load_sst2("train", data_dir=args.data_dir)
  order = np.random.default_rng(args.seed).permutation(len(train))[:args.steps * args.batch_size]
  sentences = [train[i] for i in order]
  arrays = encode_fixed_length(tokenizer, [s for s, _ in sentences], args.max_length)
  arrays["labels"] = np.array([label for _, label in sentences], np.int32)
  train_batches = list(batches(arrays, args.batch_size))
  if len(train_batches) < args.steps:
    raise SystemExit(f"SST-2 has only {len(train_batches)} batches of {args.batch_size} "
                     f"sentences: give at most that many --steps")
  return train_batches


def main(argv=None) -> dict:
  args = parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)

  model, initial_params, tokenizer = load_bert_classifier(num_labels=2, seed=args.seed)
  dev_sentences = load_sst2("dev", data_dir=args.data_dir, limit=args.dev_examples)
  dev = encode_fixed_length(tokenizer, [s for s, _ in dev_sentences], args.max_length)
  dev["labels"] = np.array([label for _, label in dev_sentences], np.int32)
  train_batches = load_train_batches(tokenizer, args)

  # Each batch packs into the smallest of at most four capacities that holds it, picked on the host:
  # static, so exact, and at most four compiles of the step.
  capacities = run_capacities(train_batches, num_shards=args.devices)
  rows = args.batch_size * args.max_length
  print(f"{describe_batches(train_batches, args, capacities)} (SEBP keeps "
        f"{np.mean(capacities) * args.devices / rows:.0%} of the rows on average)")

  optimizer = optax.adamw(learning_rate_schedule(args), weight_decay=args.weight_decay)
  row_log = RowLog() if args.row_log else None
  loss_fns = {"dense": make_loss(model, args.packed),
              "sebp": make_loss(model, args.packed, row_log)}
  dense_capacities = [None] * len(capacities)
  results = {}
  for mode in MODES:
    params, losses, compiles = fit(loss_fns[mode], initial_params, train_batches, optimizer,
                                   mode, capacities if mode == "sebp" else dense_capacities,
                                   mesh=data_parallel_mesh(args.devices),
                                   compiler_options=args.compiler_options)
    dev_accuracy = accuracy(model, params, dev, args.batch_size, desc=f"{mode} dev")
    results[mode] = {"losses": losses, "dev_accuracy": dev_accuracy, "compiles": compiles}
    print(f"{mode}: {loss_trend(losses)}, dev accuracy {dev_accuracy:.2%}; the step "
          f"compiled {compiles} time{'s' * (compiles != 1)}")

  sebp_capacity = timed_capacity(capacities, train_batches[0])
  fields = {
      "model": "all-MiniLM-L6-v2", "task": "SST-2", "capacities": sorted(set(capacities)),
      "kept_fraction": sebp_capacity / rows, "packed": args.packed,
      "devices": args.devices, "compiler_options": args.compiler_options,
      **{f"{mode}_compiles": results[mode]["compiles"] for mode in MODES},
      **{f"{mode}_dev_accuracy": results[mode]["dev_accuracy"] for mode in MODES},
      **{f"{mode}_final_loss": float(np.mean(results[mode]["losses"][-10:])) for mode in MODES},
  }
  timed = {"dense": functools.partial(loss_fns["dense"], capacity=None),
           "sebp": functools.partial(make_loss(model, args.packed), capacity=sebp_capacity)}
  return finish_run(args, timed, initial_params, train_batches[0],
                    {mode: results[mode]["losses"] for mode in MODES}, row_log, fields,
                    {m: f"{m} (dev acc {results[m]['dev_accuracy']:.1%})" for m in MODES},
                    f"MiniLM-L6 on SST-2, {args.batch_size}x{args.max_length} padded; SEBP"
                    f"{' packed' if args.packed else ''}")


if __name__ == "__main__":
  main()
