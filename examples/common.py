"""What the fine-tuning examples share: the command line, the training loop, side-by-side
timing, the plot."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pathlib
import sys
from typing import Callable

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from benchmarks.harness import median_ms, parse_compiler_option
from examples.datasets import DATA_DIR
from sebp_jax import RowLog, capacity_buckets, token_capacity, use_sebp
from sebp_jax.sharding import fsdp_loss, fsdp_specs, shard_row_counts

LossFn = Callable[[dict, dict], jax.Array]  # (params, batch) -> scalar loss
#: (params, batch, capacity) -> scalar loss: SEBP at that static capacity, dense for None.
CapacityLossFn = Callable[[dict, dict, "int | None"], jax.Array]


def parse_training_args(module: str, doc: str, argv, *, steps: int, batch_size: int,
                        max_length: int, learning_rate: float, weight_decay: float,
                        timing_repeats: int, out: str, data_files: tuple[str, ...],
                        extra=None,
                        packed: bool = True, devices: bool = False,
                        packed_row_log: bool = True,
                        longest: int | None = None) -> argparse.Namespace:
  """The command line the examples share (defaults per example, ``packed`` that of
  ``--packed``) of the example run as ``python -m module``; ``extra(parser)`` adds more;
  ``devices``: ``--devices``, training on several (:func:`fit`), and ``--compiler-option``,
  XLA options for the training step, checked here. ``data_files``: those the run reads under
  ``--data-dir`` (:func:`check_paths`, which also checks ``--out``). Every count must be positive
  (``--timing-repeats`` may be 0: no timing), the learning rate too, the weight decay at
  least 0. ``packed_row_log=False``: packed, no layer runs SEBP, so ``--row-log`` with
  ``--packed`` is refused. ``longest``: the most positions the model takes (``--max-length``
  past it is refused)."""
  parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=steps, help="training steps per run")
  parser.add_argument("--batch-size", type=int, default=batch_size,
                      help="sequences per training step")
  parser.add_argument("--max-length", type=int, default=max_length,
                      help="tokens per sequence: truncated or right-padded to it")
  parser.add_argument("--learning-rate", type=float, default=learning_rate,
                      help="AdamW learning rate (its peak where the example schedules it)")
  parser.add_argument("--weight-decay", type=float, default=weight_decay,
                      help="AdamW weight decay")
  parser.add_argument("--timing-repeats", type=int, default=timing_repeats,
                      help="repeats of the side-by-side forward/backward timing (0: none)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the data order and of any newly initialised weights")
  parser.add_argument("--data-dir", type=pathlib.Path, default=DATA_DIR,
                      help="folder holding sst2/ and wikitext2/")
  parser.add_argument("--out", type=pathlib.Path, default=out,
                      help="folder for the plot and summary.json")
  parser.add_argument("--packed", action=argparse.BooleanOptionalAction, default=packed,
                      help="the second run packs the model's layers onto the real tokens "
                           "(use_sebp(packed=True); in NNX, pack_decoder_inputs): padding "
                           "costs nothing in the whole step")
  parser.add_argument("--row-log", action="store_true",
                      help="log, per step and layer, what the SEBP backward did (active and "
                           "kept rows, capacity, share of dY's norm dropped) and print it"
                           "; packed, only the layers outside the packed stack run SEBP")
  if devices:
    parser.add_argument("--devices", type=int, default=1,
                        help="train on this many devices, FSDP: each device runs the loss "
                             "on its own rows of every batch, at its own capacity, the weights "
                             "split over the devices (sebp_jax.sharding.fsdp_loss)")
    parser.add_argument("--compiler-option", type=parse_compiler_option, action="append",
                        default=[], metavar="NAME=VALUE", dest="compiler_options",
                        help="an XLA option the training step compiles with (repeatable), "
                             "such as xla_gpu_reduce_scatter_combine_threshold_bytes=268435456 "
                             "for --devices 2 on GPUs (README, several GPUs)")
  if extra:
    extra(parser)
  args = parser.parse_args(argv)
  for name, value in vars(args).items():
    if isinstance(value, int) and not isinstance(value, bool):
      if name in ("timing_repeats", "seed") and value < 0:
        parser.error(f"--{name.replace('_', '-')} must be 0 or more, got {value}")
      elif name not in ("timing_repeats", "seed") and value <= 0:
        parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
  if longest is not None and args.max_length > longest:
    parser.error(f"--max-length {args.max_length}: the model takes at most {longest} positions")
  if not 0 < args.learning_rate < float("inf"):
    parser.error(f"--learning-rate must be positive and finite, got {args.learning_rate}")
  if not 0 <= args.weight_decay < float("inf"):
    parser.error(f"--weight-decay must be 0 or more and finite, got {args.weight_decay}")
  if args.row_log and args.packed and not packed_row_log:
    parser.error("--row-log logs the layers that run SEBP, and packed none does here: leave "
                 "out --packed or --row-log")
  if getattr(args, "devices", 1) > 1:
    if args.devices > jax.device_count():
      parser.error(f"--devices {args.devices}: this machine has {jax.device_count()} (on a "
                   "CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)")
    if args.batch_size % args.devices:
      parser.error(f"--batch-size {args.batch_size} does not split over --devices "
                   f"{args.devices}")
    if args.row_log:
      parser.error("--row-log runs on one device: leave out --devices")
  check_paths(parser, args, data_files)
  if devices:
    names = [name for name, _ in args.compiler_options]
    repeated = [name for name in dict.fromkeys(names) if names.count(name) > 1]
    if repeated:
      parser.error(f"--compiler-option {repeated[0]} given twice")
    args.compiler_options = dict(args.compiler_options)
    if args.compiler_options:
      try:  # A misspelt name or a bad value fails here, not after the model has loaded.
        jax.jit(lambda: 0, compiler_options=args.compiler_options).lower().compile()
      except jax.errors.JaxRuntimeError as error:
        parser.error(f"--compiler-option: {error}")
  return args


def check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace,
                data_files: tuple[str, ...]) -> None:
  """Refuses, before any model loads, a ``--data-dir`` without the files the run reads and an
  ``--out`` that cannot be made a folder (the run makes it)."""
  missing = [name for name in data_files if not (args.data_dir / name).is_file()]
  if missing:
    parser.error(f"--data-dir {args.data_dir}: no {missing[0]} there (the folder holding sst2/ "
                 f"and wikitext2/; by default the repository's data/)")
  existing = next(path for path in (args.out, *args.out.parents) if path.exists())
  if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
    parser.error(f"--out {args.out}: {existing} is not a folder to write in")


def sebp_context(top_n: int | None, attention_mask, **sebp_kwargs):
  """``use_sebp`` on the index of the batch's real tokens (more ``use_sebp`` arguments in
  ``sebp_kwargs``), or nothing (dense) for None.

  ``top_n`` covers the batch, picked on the host (:func:`run_capacities`), so it cannot
  overflow: ``overflow="nan"`` compiles no run-time branch (and would show a mistake as
  NaN)."""
  if top_n is None:
    return contextlib.nullcontext()
  return use_sebp(top_n=top_n, overflow="nan", active_mask=attention_mask, **sebp_kwargs)


def print_row_log(log: RowLog | None) -> str | None:
  """Prints and returns the row log's per-layer table (None without a log)."""
  if log is None:
    return None
  table = log.summary()
  print(f"SEBP row log, per layer over the run:\n{table}")
  return table


def run_capacities(train_batches: list[dict], count: int = 4, num_shards: int = 1) -> list[int]:
  """Each batch's packing capacity (and SEBP ``top_n``), picked on the host from a short
  geometric ladder over the run (:func:`sebp_jax.capacity_buckets`): at most ``count``
  compiles of the step, each batch in the smallest bucket that holds its real tokens (its
  fullest shard's, each batch split into ``num_shards`` along its rows: a device's)."""
  masks = [batch["attention_mask"] for batch in train_batches]
  buckets = capacity_buckets(max(int(shard_row_counts(m, num_shards).max()) for m in masks),
                             count)
  return [token_capacity(mask, buckets=buckets, num_shards=num_shards) for mask in masks]


def timed_capacity(capacities: list[int], batch: dict) -> int:
  """The capacity the side-by-side timing (:func:`finish_run`) runs SEBP at, on ``batch``
  whole on one device: the run's first, unless that is a device's share of it (training on
  several devices), then the whole batch's."""
  return max(capacities[0], token_capacity(batch["attention_mask"]))


def fit(loss_fn: CapacityLossFn, params: dict, train_batches: list[dict],
        optimizer: optax.GradientTransformation, desc: str,
        capacities: list[int | None], mesh: jax.sharding.Mesh | None = None,
        weight_fn: Callable | None = None,
        compiler_options: dict | None = None) -> tuple[dict, list[float], int]:
  """Runs one jitted optimizer step per batch with a progress bar, each batch at its static
  capacity (None: dense); returns params, losses and how many times the step compiled.

  With a ``mesh`` (``benchmarks.harness.data_parallel_mesh``), FSDP: the params and the
  optimizer's moments are split over its devices (:func:`sebp_jax.sharding.fsdp_specs`),
  each batch's rows too, and each device runs ``loss_fn`` on its own rows at ``capacity``,
  a device's (:func:`sebp_jax.sharding.fsdp_loss`; ``weight_fn`` as there): the losses and
  gradients are one device's. ``compiler_options``: XLA options the step compiles with."""
  compiles = []
  place = lambda batch: batch
  if mesh is not None:
    specs = fsdp_specs(params, mesh)
    params = jax.device_put(params, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs))
    place = lambda batch: jax.device_put(batch, NamedSharding(mesh, P("data")))
    one_device_loss = loss_fn

    def loss_fn(params, batch, capacity):
      return fsdp_loss(functools.partial(one_device_loss, capacity=capacity), mesh, specs,
                       weight_fn=weight_fn)(params, batch)

  @functools.partial(jax.jit, static_argnames="capacity",
                     compiler_options=compiler_options or None)
  def train_step(params, opt_state, batch, capacity):
    compiles.append(capacity)  # Runs only while tracing: once per compile.
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, capacity)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = optimizer.init(params)
  if mesh is not None:
    # Laid out as the step returns it: a count made on one device would come back replicated
    # over the mesh, and the step compile again.
    opt_state = jax.device_put(opt_state, jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), fsdp_specs(opt_state, mesh)))
  losses = []
  progress = tqdm(zip(train_batches, capacities), total=len(train_batches),
                  desc=f"{desc:>5}", unit="step", file=sys.stdout)
  for batch, capacity in progress:
    params, opt_state, loss = train_step(params, opt_state, place(batch), capacity=capacity)
    losses.append(float(loss))
    progress.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
  return params, losses, len(compiles)


def time_forward_backward(loss_fns: dict[str, LossFn], params: dict, batch: dict,
                          repeats: int) -> dict[str, dict]:
  """Milliseconds of the jitted forward and forward + backward of each loss, on one batch.

  ``repeats`` interleaved rounds, each timing every stage once, so that a change in the
  machine's load falls on dense and SEBP alike; per mode, each stage's median
  (``forward_ms``, ``forward_backward_ms``, ``backward_ms``: their difference) and its rounds
  (``rounds``: ``{stage: [ms, ...]}``). Two warm-up calls per stage absorb the compilation.
  """
  stages = [(mode, stage, jax.jit(fn)) for mode, loss_fn in loss_fns.items()
            for stage, fn in (("forward", loss_fn), ("forward_backward", jax.grad(loss_fn)))]
  rounds = {mode: {"forward": [], "forward_backward": []} for mode in loss_fns}
  progress = tqdm(stages, desc="compile", unit="stage", file=sys.stdout)
  for mode, stage, fn in progress:
    progress.set_postfix_str(f"{mode} {stage.replace('_', ' + ')}")
    for _ in range(2):
      value = jax.block_until_ready(fn(params, batch))
    if stage == "forward" and not np.isfinite(value):
      raise ValueError(f"the {mode} loss timed is {float(value)}, not finite: its timing "
                       "would not be that of the run's work")
  for _ in tqdm(range(repeats), desc="timing", unit="round", file=sys.stdout):
    for mode, stage, fn in stages:
      rounds[mode][stage].append(median_ms(fn, params, batch, repeats=1, warmup=0))
  timings = {}
  for mode, by_stage in rounds.items():
    by_stage["backward"] = [max(both - forward, 1e-6) for forward, both
                            in zip(by_stage["forward"], by_stage["forward_backward"])]
    timings[mode] = {f"{stage}_ms": float(np.median(samples))
                     for stage, samples in by_stage.items()}
    timings[mode]["rounds"] = by_stage
  return timings


def plot_loss_curves(losses: dict[str, list[float]], labels: dict[str, str], title: str,
                     path: pathlib.Path, window: int = 10) -> None:
  """Each run's training loss per step (faint) and its ``window``-step moving average (bold)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  window = max(1, min([window, *map(len, losses.values())]))
  fig, ax = plt.subplots(figsize=(7, 4))
  for i, (mode, curve) in enumerate(losses.items()):
    curve = np.asarray(curve)
    smooth = np.convolve(curve, np.ones(window) / window, mode="valid")
    ax.plot(curve, alpha=0.25, linewidth=1, color=f"C{i}")
    ax.plot(np.arange(window - 1, len(curve)), smooth, color=f"C{i}", linewidth=2.5,
            linestyle="-" if i == 0 else "--", label=labels[mode])
  ax.set_xlabel("step")
  ax.set_ylabel("training loss")
  ax.set_title(title, fontsize=10)
  ax.legend(title=f"bold: {window}-step moving average; faint: loss per step",
            title_fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def speedups(timings: dict[str, dict], repeats: int,
             kept_fraction: float | None = None) -> dict[str, float]:
  """Prints and returns dense / SEBP time of the backward and of the gradient (forward +
  backward) from :func:`time_forward_backward`: the median of the rounds' ratios, and
  ``{stage}_range``, their smallest and largest."""
  ratios = {}
  for stage in ("backward", "forward_backward"):
    per_round = np.divide(timings["dense"]["rounds"][stage], timings["sebp"]["rounds"][stage])
    ratios[stage] = float(np.median(per_round))
    ratios[f"{stage}_range"] = [float(per_round.min()), float(per_round.max())]
  spread = lambda stage: "{:.2f}-{:.2f}x".format(*ratios[f"{stage}_range"])
  print(f"time, dense / SEBP: gradient (forward + backward) {ratios['forward_backward']:.2f}x "
        f"(rounds {spread('forward_backward')}), backward {ratios['backward']:.2f}x (rounds "
        f"{spread('backward')}); {jax.devices()[0].device_kind}, median of {repeats} "
        "interleaved rounds. Wall-clock ratios move with the machine's load: rerun to see how "
        "much.")
  if ratios["backward"] < 1 and kept_fraction is not None:
    print(f"SEBP's backward is slower here: it keeps {kept_fraction:.0%} of the rows (the "
          "timed batch's capacity), so it saves little of the dense matmuls and still "
          "pays for gathering and scattering the rows. It pays where padding dominates.")
  return ratios


def describe_batches(train_batches: list[dict], args: argparse.Namespace,
                     capacities: list[int]) -> str:
  """The run's steps, their batches' real tokens and the capacities they pack into."""
  real_tokens = [int(batch["attention_mask"].sum()) for batch in train_batches]
  steps = len(train_batches)
  per_device = " per device" * (getattr(args, "devices", 1) > 1)
  return (f"{steps} step{'s' * (steps != 1)} of {args.batch_size}x{args.max_length}; real "
          f"tokens per batch: mean {np.mean(real_tokens):.0f}, max {max(real_tokens)} of "
          f"{args.batch_size * args.max_length}; capacities{per_device} "
          f"{sorted(set(capacities))}")


#: The losses :func:`loss_trend` averages at the end of a run.
TREND_STEPS = 10


def loss_trend(losses: list[float], last: int = TREND_STEPS) -> str:
  """``first -> mean of the last few`` losses, saying how many."""
  last = min(last, len(losses))
  return (f"loss {losses[0]:.4f} -> {np.mean(losses[-last:]):.4f} (first step -> mean of "
          f"last {last})")


def max_loss_difference(losses: dict[str, list[float]]) -> float:
  """Prints and returns the largest per-step difference between the dense and SEBP losses."""
  # np.max, not max: a NaN loss on either side makes the difference NaN, not skipped.
  difference = float(np.max(np.abs(np.subtract(losses["dense"], losses["sebp"]))))
  print(f"largest per-step loss difference, dense vs SEBP: {difference:.2e}")
  return difference


def strict_json(value):
  """``value`` with every non-finite float (a NaN loss, say) as None: JSON has no NaN, and
  ``json.dumps`` would write a bare ``NaN`` that strict readers refuse."""
  if isinstance(value, dict):
    return {key: strict_json(item) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict_json(item) for item in value]
  if isinstance(value, (float, np.floating)) and not np.isfinite(value):
    return None
  return value


def save_run(out: pathlib.Path, summary: dict, labels: dict[str, str], title: str) -> None:
  """Writes ``summary.json`` (non-finite numbers as null) and ``loss_curves.png`` (from
  ``summary["losses"]``) under out."""
  (out / "summary.json").write_text(json.dumps(strict_json(summary), indent=2,
                                               allow_nan=False))
  plot_loss_curves(summary["losses"], labels, title, out / "loss_curves.png")
  print(f"wrote {out / 'summary.json'} and {out / 'loss_curves.png'}")


def finish_run(args: argparse.Namespace, loss_fns: dict[str, LossFn], params, batch: dict,
               losses: dict[str, list[float]], row_log: RowLog | None, fields: dict,
               labels: dict[str, str], title: str) -> dict:
  """What every example does after its runs: times ``loss_fns`` (dense and SEBP, without the
  row log: its callbacks are host round trips) side by side on ``batch`` (unless
  ``--timing-repeats 0``: the timing fields are then None), prints the largest loss
  difference and the row log, and writes ``summary.json`` (``fields``, then the figures every
  example reports) and the plot, titled ``title`` and the gradient speedup. Returns the
  summary."""
  timings, ratios = None, dict.fromkeys(
      ("backward", "forward_backward", "backward_range", "forward_backward_range"))
  if args.timing_repeats:
    timings = time_forward_backward(loss_fns, params, batch, args.timing_repeats)
    ratios = speedups(timings, args.timing_repeats, fields.get("kept_fraction"))
  summary = {
      **fields, "steps": len(losses["dense"]), "batch_size": args.batch_size,
      "max_length": args.max_length, "learning_rate": args.learning_rate, "seed": args.seed,
      "device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
      "backward_speedup": ratios["backward"], "gradient_speedup": ratios["forward_backward"],
      "backward_speedup_range": ratios["backward_range"],
      "gradient_speedup_range": ratios["forward_backward_range"],
      "timings": timings, "max_loss_difference": max_loss_difference(losses),
      "row_log": print_row_log(row_log), "losses": losses,
  }
  speedup = ratios["forward_backward"]
  save_run(args.out, summary, labels,
           f"{title}: " + (f"gradient {speedup:.2f}x faster" if timings else "not timed"))
  print_recap(summary)
  return summary


def print_recap(summary: dict) -> None:
  """The run in a few lines at the very end, below the progress bars: each mode's loss (and
  dev accuracy, where the example scores one), the speedups, the largest loss difference."""
  print("\nsummary:")
  for mode, losses in summary["losses"].items():
    accuracy = summary.get(f"{mode}_dev_accuracy")
    print(f"  {mode:>5}: {loss_trend(losses)}"
          + ("" if accuracy is None else f", dev accuracy {accuracy:.2%}"))
  if summary["gradient_speedup"] is not None:
    print(f"  dense / SEBP time: gradient {summary['gradient_speedup']:.2f}x, backward "
          f"{summary['backward_speedup']:.2f}x on {summary['device']}")
  print(f"  largest per-step loss difference: {summary['max_loss_difference']:.2e}")
