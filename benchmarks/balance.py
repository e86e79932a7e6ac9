"""What balancing the shards of a batch buys packing on several devices: the capacity every
device packs into is the fullest shard's real tokens, so the others wait on it. For random
batches drawn from real length distributions (``lengths/``), the fullest shard's tokens
against the mean shard's, with the batch split as drawn and reordered by
:func:`sebp_jax.packing.balanced_shard_order`. Host arithmetic only: no device, no timing.

    python -m benchmarks.balance --devices 2,4,8 --batches 500
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks.harness import (append_json_lines, non_negative_int, parse_positive_ints,
                                positive_int, record)
from benchmarks.model import LENGTHS_DIR, SETUPS
from sebp_jax.packing import balanced_shard_order


def balance(kind: str, devices: int, batches: int, seed: int) -> dict:
  """The mean over ``batches`` random batches (the setup's batch per device, lengths cut at
  its padded length) of the fullest shard's tokens, as drawn and balanced, over the mean
  shard's: the capacity's overhead above perfectly even shards."""
  setup = SETUPS[kind]
  lengths = np.asarray(json.loads((LENGTHS_DIR / setup.lengths_file).read_text())["lengths"])
  rng = np.random.default_rng(seed)
  drawn, balanced = [], []
  for _ in range(batches):
    batch = np.minimum(rng.choice(lengths, setup.batch_size * devices), setup.length)
    mean = batch.sum() / devices
    drawn.append(batch.reshape(devices, -1).sum(axis=1).max() / mean)
    ordered = batch[balanced_shard_order(batch, devices)]
    balanced.append(ordered.reshape(devices, -1).sum(axis=1).max() / mean)
  return record(model=kind, devices=devices, batch_size=setup.batch_size, batches=batches,
                seed=seed, fullest_over_mean_drawn=float(np.mean(drawn)),
                fullest_over_mean_balanced=float(np.mean(balanced)),
                worst_drawn=float(np.max(drawn)), worst_balanced=float(np.max(balanced)))


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.balance",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=sorted(SETUPS), action="append",
                      help="setups whose batch size and lengths to draw (default: bert, llama)")
  parser.add_argument("--devices", type=parse_positive_ints, default=[2, 4, 8],
                      help="comma list of device counts to split each batch over (default: "
                           "2,4,8)")
  parser.add_argument("--batches", type=positive_int, default=500,
                      help="random batches drawn per setup (default: 500)")
  parser.add_argument("--seed", type=non_negative_int, default=0,
                      help="seed of the drawn batches (default: 0)")
  parser.add_argument("--out", default=None, help="append JSON lines here")
  args = parser.parse_args(argv)
  rows = [balance(kind, devices, args.batches, args.seed)
          for kind in args.model or ["bert", "llama"] for devices in args.devices]
  append_json_lines(args.out, rows)
  print(f"{'model':12} {'devices':>7} {'fullest/mean drawn':>19} {'balanced':>9} "
        f"{'worst drawn':>11} {'balanced':>9}")
  for r in rows:
    print(f"{r['model']:12} {r['devices']:7d} {r['fullest_over_mean_drawn']:19.3f} "
          f"{r['fullest_over_mean_balanced']:9.3f} {r['worst_drawn']:11.3f} "
          f"{r['worst_balanced']:9.3f}")
  return rows


if __name__ == "__main__":
  main()
