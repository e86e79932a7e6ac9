"""Where the backward time goes: a device trace of the model benchmark's gradient, per op.

    python -m benchmarks.profile_model --model bert --modes dense,sebp_shared --out prof.json

Traces ``--iterations`` calls of the jitted gradient for each mode (set up exactly as in
``benchmarks.model``), reads the trace back with ``jax.profiler.ProfileData`` and prints, per
mode, the device time summed by XLA op / kernel name, largest first.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import pathlib
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.harness import parse_subset
from benchmarks.model import MODES, SETUPS, build_model, make_batch, make_loss, setup_for
from sebp_jax.implementations import implementation_names
from sebp_jax.packing import token_capacity


def device_time_by_name(trace_dir: pathlib.Path) -> dict[str, dict[str, float]]:
  """{line name: {event name: total ms}} over the device planes of the newest trace."""
  (path,) = sorted(trace_dir.rglob("*.xplane.pb"))[-1:]
  data = jax.profiler.ProfileData.from_file(str(path))
  totals: dict[str, dict[str, float]] = collections.defaultdict(collections.Counter)
  for plane in data.planes:
    if not plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      for event in line.events:
        totals[line.name][event.name] += event.duration_ns / 1e6
  return totals


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_model",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=sorted(SETUPS), default="bert", help="model to trace")
  parser.add_argument("--modes", type=functools.partial(parse_subset, choices=MODES),
                      default=["dense", "sebp_shared"],
                      help=f"comma-separated subset of {','.join(MODES)}")
  parser.add_argument("--backend", default="auto", choices=("auto", *implementation_names()),
                      help="SEBP backend of the sebp_* modes")
  parser.add_argument("--iterations", type=int, default=3, help="gradients traced per mode")
  parser.add_argument("--top", type=int, default=25, help="ops listed per mode, largest first")
  parser.add_argument("--tiny", action="store_true", help="toy model sizes (CPU smoke run)")
  parser.add_argument("--out", default=None, help="write the report here as JSON")
  args = parser.parse_args(argv)

  setup = setup_for(args.model, args.tiny)
  model = build_model(args.model, args.tiny, jnp.bfloat16)
  batch = make_batch(args.model, model, setup, 0)
  top_n = int(batch["attention_mask"].sum())
  report = {}
  for mode in args.modes:
    loss_fn = make_loss(args.model, model, mode, top_n, args.backend,
                        token_capacity(batch["attention_mask"]))
    grad = jax.jit(jax.grad(loss_fn))
    jax.block_until_ready(grad(model.params, batch))
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir):
        for _ in range(args.iterations):
          jax.block_until_ready(grad(model.params, batch))
      totals = device_time_by_name(pathlib.Path(trace_dir))
    report[mode] = {}
    for line, events in totals.items():
      total = sum(events.values()) / args.iterations
      top = sorted(events.items(), key=lambda kv: -kv[1])[:args.top]
      report[mode][line] = {"total_ms": total,
                            "top": [(name, ms / args.iterations) for name, ms in top],
                            "count": len(events)}
      print(f"== {mode} / {line}: {total:.2f} ms per gradient, {len(events)} distinct names")
      for name, ms in top:
        print(f"  {ms / args.iterations:8.3f} ms  {name[:110]}")
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
