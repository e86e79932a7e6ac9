"""Where the gradient's time goes: a device trace of the model benchmark's gradient, per op.

    python -m benchmarks.profile_model --model llama --model llama_nnx_bf16 \\
        --modes dense,sebp_shared,bound --out prof.json

Traces ``--iterations`` calls of the jitted gradient for each model and mode (set up exactly as
in ``benchmarks.model``), reads the trace back with ``jax.profiler.ProfileData`` and sums the
time of each XLA op (a GPU kernel, a CPU thunk) under the JAX op it came from: the op name in
the compiled HLO's metadata, such as ``transpose(jvp(...))/model/layers/*/mlp/up_proj/
dot_general``, with layer numbers folded into ``*`` so that each layer kind is one row where
op names carry module paths, as Linen's do (``--by kernel`` keeps XLA's kernel names
instead). GPU command buffers are turned off for the trace, so that every kernel names its
instruction. Prints, per model, a table of the largest rows with one column per mode, and
writes every row with ``--out``.

``--devices N`` traces the data-parallel call of ``benchmarks.model --devices N`` (every
device the one-device batch's lengths; ``--fsdp`` as there, one kind), ``--call step`` the
whole AdamW step in place of the gradient. Each mode then also gets a timeline per device, ms
per call: the wall time of the call, the time any kernel runs (busy), the time a computation
runs, the collectives' time, and the part of it no computation overlaps (exposed): what the
devices spend waiting on each other or on the host. The traced calls are dispatched back to back and
synced once, as a training loop runs them. ``--processes N`` traces as N processes of one GPU
each (as ``benchmarks.model --processes``); the first process's device is reported.

    python -m benchmarks.profile_model --model llama --modes dense,sebp_packed --devices 2 \
        --processes 2 --fsdp shard_map --call step
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import pathlib
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax._src import xla_bridge

from benchmarks.harness import join_processes, launch_processes
from benchmarks.model import (FSDP_KINDS, MODES, SETUPS, Placement, build_model, loss_weight,
                              make_batch, mode_loss, parse_modes, setup_for)
from sebp_jax.sharding import shard_row_counts
from sebp_jax.implementations import implementation_names

_COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="


def turn_off_command_buffers() -> None:
  """A GPU kernel names its HLO instruction in the trace only outside command buffers (CUDA
  graphs): turned off for this process, which must not have started JAX's backends yet."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_gpu_enable_command_buffer" in flags:
    return
  if getattr(xla_bridge, "backends_are_initialized", lambda: False)():
    logging.warning("JAX's backends are already up: GPU kernels inside command buffers are "
                    "reported under [command_buffer...] rows")
    return
  os.environ["XLA_FLAGS"] = f"{flags} {_COMMAND_BUFFERS_OFF}".strip()


_COMPUTATION = re.compile(r"(?:ENTRY )?%([^\s(]+) .*\{$")
_INSTRUCTION = re.compile(r"\s*(ROOT )?%([^\s=]+) = ")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%([^\s,]+)")


def hlo_op_names(hlo_text: str) -> dict[str, str]:
  """{HLO instruction name: the JAX op name in its metadata} of a compiled module's text; a
  fusion without metadata of its own takes that of its computation's root (or, where the
  root has none, of its first instruction that has one)."""
  op_names, calls, computation_op = {}, {}, {}
  computation = None
  for line in hlo_text.splitlines():
    if (header := _COMPUTATION.match(line)) is not None:
      computation = header.group(1)
      continue
    if (instruction := _INSTRUCTION.match(line)) is None:
      continue
    name, op_name = instruction.group(2), _OP_NAME.search(line)
    if op_name is not None:
      op_names[name] = op_name.group(1)
      if instruction.group(1) or computation not in computation_op:
        computation_op[computation] = op_name.group(1)
    elif (called := _CALLS.search(line)) is not None:
      calls[name] = called.group(1)
  for name, called in calls.items():
    if called in computation_op:
      op_names[name] = computation_op[called]
  return op_names


def op_row(op_name: str) -> str:
  """The table row of a JAX op name: without the ``jit(...)/`` prefix, layer numbers folded
  (``layers/3/`` and ``layers_3/`` into ``layers/*/`` and ``layers_*/``)."""
  op_name = re.sub(r"^jit\([^)]*\)/", "", op_name)
  return re.sub(r"/(\w*?_)?\d+(?=/)", lambda m: f"/{m.group(1) or ''}*", op_name)


def device_time(trace_dir: pathlib.Path, op_names: dict[str, str] | None) -> dict[str, float]:
  """{row: total ms} of the XLA ops in the newest trace under ``trace_dir``: device kernels
  (GPU) or the host's XLA thunks (CPU), the events that name an HLO instruction. Rows are JAX
  op names (``op_names``: instruction -> op name; an instruction without one keeps its own
  name in brackets) or, with ``op_names=None``, the kernels' names."""
  (path,) = sorted(trace_dir.rglob("*.xplane.pb"))[-1:]
  data = jax.profiler.ProfileData.from_file(str(path))
  totals: dict[str, float] = collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        instruction = dict(event.stats).get("hlo_op")
        if instruction is None:
          continue
        if op_names is None:
          row = event.name
        elif instruction in op_names:
          row = op_row(op_names[instruction])
        else:
          row = f"[{instruction}]"
        totals[row] += event.duration_ns / 1e6
  return totals


_COLLECTIVE = re.compile(r"nccl|all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute", re.IGNORECASE)


def _union_ns(intervals) -> int:
  """The length of the union of ``(start, end)`` intervals."""
  total, reach = 0, None
  for start, end in sorted(intervals):
    if reach is None or start > reach:
      total, reach = total + end - start, end
    elif end > reach:
      total, reach = total + end - reach, end
  return total


def device_timeline(trace_dir: pathlib.Path) -> dict[str, dict[str, float]]:
  """{device plane: busy / compute / collective / exposed-collective ms} of the newest trace
  under ``trace_dir``, over the XLA ops that name an HLO instruction: the union of all of
  their intervals, of the computations', the collectives' summed time, and the time only
  collectives run."""
  (path,) = sorted(trace_dir.rglob("*.xplane.pb"))[-1:]
  data = jax.profiler.ProfileData.from_file(str(path))
  timeline = {}
  for plane in data.planes:
    spans = {"compute": [], "collective": []}
    for line in plane.lines:
      for event in line.events:
        instruction = dict(event.stats).get("hlo_op")
        if instruction is None:
          continue
        kind = "collective" if _COLLECTIVE.search(f"{event.name} {instruction}") else "compute"
        spans[kind].append((event.start_ns, event.start_ns + event.duration_ns))
    if not spans["compute"] and not spans["collective"]:
      continue
    busy = _union_ns(spans["compute"] + spans["collective"])
    compute = _union_ns(spans["compute"])
    timeline[plane.name] = {
        "busy_ms": busy / 1e6, "compute_ms": compute / 1e6,
        "collective_ms": sum(end - start for start, end in spans["collective"]) / 1e6,
        "exposed_collective_ms": (busy - compute) / 1e6}
  return timeline


def profile(kind: str, modes, *, iterations: int, backend: str, tiny: bool, by: str,
            devices: int = 1, call: str = "grad", fsdp: str | None = None):
  """{mode: {row: ms per call}} for the model benchmark's ``kind``, and {mode: {device:
  timeline, ms per call}} (:func:`device_timeline`, with the call's wall time); ``fsdp`` as
  ``benchmarks.model``'s."""
  setup = setup_for(kind, tiny)
  model = build_model(kind, tiny, jnp.bfloat16)
  batch = make_batch(kind, model, setup, 0, shards=devices, shard_lengths="same")
  top_n = int(shard_row_counts(batch["attention_mask"], devices).max())
  placement = Placement.make(model.params, devices, fsdp=fsdp)
  report, timelines = {}, {}
  for mode in modes:
    host_batch, loss_fn = mode_loss(kind, model, mode, batch, top_n, backend,
                                    placement.sebp_sharding, num_shards=devices)
    fn, args = placement.calls(loss_fn, host_batch, stages=(call,),
                               weight_fn=loss_weight(kind))[call]
    if not hasattr(fn, "as_text"):
      fn = fn.lower(*args).compile()
    op_names = hlo_op_names(fn.as_text()) if by == "op" else None
    for _ in range(2):  # The second call's buffers are those the traced calls reuse.
      jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir):
        begin = time.perf_counter()
        for _ in range(iterations):
          out = None  # One result alive at a time, as in the timed benchmark.
          out = fn(*args)
        jax.block_until_ready(out)
        out = None
        wall_ms = (time.perf_counter() - begin) * 1e3 / iterations
      totals = device_time(pathlib.Path(trace_dir), op_names)
      timeline = device_timeline(pathlib.Path(trace_dir))
    local_devices = devices // jax.process_count()  # The devices this process traced.
    report[mode] = {row: ms / local_devices / iterations for row, ms in totals.items()}
    timelines[mode] = {device: {"wall_ms": wall_ms,
                                **{k: v / iterations for k, v in times.items()}}
                       for device, times in timeline.items()}
  return report, timelines


def print_table(kind: str, report: dict[str, dict[str, float]], top: int, call: str) -> None:
  modes = list(report)
  print(f"== {kind}: ms per {call}, per device")
  print("  ".join(f"{m[:12]:>12}" for m in modes) + "  op")
  print("  ".join(f"{sum(report[m].values()):12.2f}" for m in modes) + "  (all)")
  rows = {row for ms in report.values() for row in ms}
  for row in sorted(rows, key=lambda r: -max(report[m].get(r, 0.0) for m in modes))[:top]:
    print("  ".join(f"{report[m].get(row, 0.0):12.3f}" for m in modes) + f"  {row[:120]}")


def print_timelines(kind: str, timelines: dict[str, dict[str, dict[str, float]]]) -> None:
  print(f"== {kind}: timeline, ms per call")
  print(f"{'mode':28} {'device':24} {'wall':>8} {'busy':>8} {'compute':>8} {'collect.':>8} "
        f"{'exposed':>8}")
  for mode, devices in timelines.items():
    for device, t in devices.items():
      print(f"{mode:28} {device[-24:]:24} {t['wall_ms']:8.2f} {t['busy_ms']:8.2f} "
            f"{t['compute_ms']:8.2f} {t['collective_ms']:8.2f} {t['exposed_collective_ms']:8.2f}")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_model",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=sorted(SETUPS), action="append",
                      help="model(s) to trace (default: bert)")
  parser.add_argument("--modes", type=parse_modes, default=["dense", "sebp_shared"],
                      help=f"comma-separated subset of {','.join(MODES)}, each optionally "
                           "@BACKEND")
  parser.add_argument("--backend", default="auto", choices=("auto", *implementation_names()),
                      help="SEBP backend of the sebp_* modes")
  parser.add_argument("--by", choices=("op", "kernel"), default="op",
                      help="rows: JAX op names (layer numbers folded) or XLA kernel names")
  parser.add_argument("--iterations", type=int, default=3, help="calls traced per mode")
  parser.add_argument("--devices", type=int, default=1,
                      help="data parallel over this many devices (benchmarks.model --devices)")
  parser.add_argument("--call", choices=("grad", "step"), default="grad",
                      help="trace the gradient or the whole AdamW step")
  parser.add_argument("--fsdp", choices=FSDP_KINDS, default=None,
                      help="on several devices, the weight matrices split over them too, as "
                           "benchmarks.model --fsdp (one kind)")
  parser.add_argument("--processes", type=int, default=1,
                      help="trace as this many processes of one GPU each (jax.distributed); "
                           "--devices must then be the processes' devices together")
  parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--top", type=int, default=30, help="rows printed per model")
  parser.add_argument("--tiny", action="store_true", help="toy model sizes (CPU smoke run)")
  parser.add_argument("--out", default=None, help="write every row as JSON here")
  args = parser.parse_args(argv)
  if args.iterations <= 0:
    parser.error("--iterations must be positive")
  if args.devices <= 0 or args.processes <= 0:
    parser.error("--devices and --processes must be positive")
  if args.fsdp and args.devices == 1:
    parser.error("--fsdp splits the weights over several devices: add --devices N")
  turn_off_command_buffers()
  if args.process_id is None and args.processes > 1:
    launch_processes("benchmarks.profile_model", args.processes,
                     list(sys.argv[1:] if argv is None else argv))
    return json.loads(pathlib.Path(args.out).read_text())["models"] if args.out else {}
  if args.process_id is not None:
    join_processes(args.coordinator, args.processes, args.process_id)
    if args.devices != jax.device_count():
      parser.error(f"--devices {args.devices}: with --processes the trace spans all "
                   f"{jax.device_count()} devices of the processes")
  report, timelines = {}, {}
  quiet = jax.process_index() != 0  # Several processes: the first one speaks for all.
  for kind in args.model or ["bert"]:
    report[kind], timelines[kind] = profile(
        kind, args.modes, iterations=args.iterations, backend=args.backend, tiny=args.tiny,
        by=args.by, devices=args.devices, call=args.call, fsdp=args.fsdp)
    if not quiet:
      print_table(kind, report[kind], args.top, args.call)
      print_timelines(kind, timelines[kind])
  if args.out and not quiet:
    pathlib.Path(args.out).write_text(json.dumps(
        {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
         "by": args.by, "iterations": args.iterations, "devices": args.devices,
         "call": args.call, "fsdp": args.fsdp, "processes": args.processes,
         "models": report, "timelines": timelines}, indent=1))
  return report


if __name__ == "__main__":
  main()
