"""Packed attention alone: one Llama-3.2-1B layer's attention (32 query heads, 8 kv heads,
head size 64, causal, bf16), forward + backward, on batches with the lengths of WikiText-2
sections, three ways side by side:

  mask     the packed sequence with one ``[C, C]`` mask (``packed_attention(method="mask")``)
  rows     the packed tokens in rows of their own, cuDNN given the lengths
           (``packed_attention(method="rows")``, ``sebp_jax.packing.row_attention``)
  padded   no packing: the batch padded to its longest sequence, cuDNN given the lengths

Each case is timed in interleaved rounds (every way once a round); the record keeps each way's
median and spread and the ratios to ``padded``.

    python -m benchmarks.attention --batches 4x1024,16x4096,32x4096 --rounds 7
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks.harness import (append_json_lines, median_ms, non_negative_int, parse_pairs,
                                positive_int, record)
from sebp_jax.packing import (fused_attention_implementation, gather_tokens, pack_layout,
                              packed_attention, token_capacity)

LENGTHS = pathlib.Path(__file__).parent / "lengths" / "wikitext2_valid_sections_smollm2_bpe.json"
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
WAYS = ("mask", "rows", "padded")


def case(batch: int, length: int, seed: int, tiny: bool):
  """``(mask, fns, args)``: a right-padded mask with section lengths, and each way's forward +
  backward as a jitted function of its own q, k, v."""
  rng = np.random.default_rng(seed)
  lengths = np.minimum(rng.choice(json.loads(LENGTHS.read_text())["lengths"], batch), length)
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  heads, kv_heads, dim = (4, 2, 16) if tiny else (HEADS, KV_HEADS, HEAD_DIM)
  longest = min(length, -(-int(lengths.max()) // 64) * 64)
  capacity = token_capacity(mask)
  q = jnp.asarray(rng.standard_normal((batch, length, heads, dim)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((batch, length, kv_heads, dim)), jnp.bfloat16)
          for _ in range(2))

  def value_and_grad(attend):
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  def packed(method):
    def attend(q, k, v):
      layout = pack_layout(mask, capacity)
      return packed_attention(q, k, v, layout, causal=True, method=method)
    return attend

  padded_lengths = jnp.asarray(lengths, jnp.int32)

  def padded(q, k, v):
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=padded_lengths,
        key_value_seq_lengths=padded_lengths, implementation=fused_attention_implementation(q))

  layout = pack_layout(mask, capacity)
  packed_qkv = tuple(gather_tokens(a, layout) for a in (q, k, v))
  fns = {"mask": (value_and_grad(packed("mask")), packed_qkv),
         "rows": (value_and_grad(packed("rows")), packed_qkv),
         "padded": (value_and_grad(padded), tuple(a[:, :longest] for a in (q, k, v)))}
  return mask, longest, capacity, fns


def run(batches, rounds: int, seed: int, tiny: bool, out) -> list[dict]:
  rows = []
  for batch, length in tqdm(batches, desc="attention", file=sys.stdout):
    mask, longest, capacity, fns = case(batch, length, seed, tiny)
    samples = {way: [] for way in WAYS}
    for way in WAYS:
      fn, args = fns[way]
      median_ms(fn, *args, repeats=1)  # compile and warm up
    for _ in range(rounds):
      for way in WAYS:
        fn, args = fns[way]
        samples[way].append(median_ms(fn, *args, repeats=3, warmup=0))
    row = record(batch=batch, length=length, real_tokens=int(mask.sum()), capacity=capacity,
                 longest=longest, rounds=rounds, tiny=tiny,
                 **{f"{way}_ms": float(np.median(samples[way])) for way in WAYS},
                 **{f"{way}_rounds_ms": samples[way] for way in WAYS})
    for way in ("mask", "rows"):
      per_round = np.divide(samples[way], samples["padded"])
      row[f"{way}_vs_padded"] = float(np.median(per_round))
      row[f"{way}_vs_padded_range"] = [float(per_round.min()), float(per_round.max())]
    rows.append(row)
    append_json_lines(out, [row])
  print(f"{'B x L':>10} {'C':>6} {'longest':>7} {'mask ms':>8} {'rows ms':>8} "
        f"{'padded ms':>9} {'rows/padded (spread)':>22} {'mask/padded':>11}")
  for r in rows:
    print(f"{r['batch']:>4}x{r['length']:<5} {r['capacity']:6d} {r['longest']:7d} "
          f"{r['mask_ms']:8.2f} {r['rows_ms']:8.2f} {r['padded_ms']:9.2f} "
          f"{r['rows_vs_padded']:8.2f} ({r['rows_vs_padded_range'][0]:.2f}-"
          f"{r['rows_vs_padded_range'][1]:.2f}) {r['mask_vs_padded']:11.2f}")
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.attention",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n", 1)[1])
  parse_batches = functools.partial(parse_pairs, what="BxL")
  parser.add_argument("--batches", type=parse_batches,
                      help="comma list of BxL (default: 4x1024,16x4096,32x4096,64x2048; with "
                           "--tiny 2x128,4x256)")
  parser.add_argument("--rounds", type=positive_int, default=7, help="interleaved timing rounds")
  parser.add_argument("--seed", type=non_negative_int, default=0,
                      help="seed of the lengths and values")
  parser.add_argument("--tiny", action="store_true",
                      help="toy head counts and batches (CPU smoke run)")
  parser.add_argument("--out", default=None, help="append JSON lines here")
  args = parser.parse_args(argv)
  batches = args.batches or parse_batches(
      "2x128,4x256" if args.tiny else "4x1024,16x4096,32x4096,64x2048")
  return run(batches, args.rounds, args.seed, args.tiny, args.out)


if __name__ == "__main__":
  main()
