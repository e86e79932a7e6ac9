"""What every benchmark shares: the timer, the records and the parsing of cases.

Timings are medians of wall time with a device sync, after warm-up calls that absorb
compilation; a record is one JSON object that names the device and the jax version it was
measured with.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.experimental.profiler import get_profiled_instructions_proto
from jax.sharding import AxisType

#: Layer shapes (in_features, out_features) of the models the benchmarks stand for.
SHAPES = {
    "bert-base": [(768, 768), (768, 3072), (3072, 768)],
    "llama-3.2-1b/3b": [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048),
                        (3072, 8192), (8192, 3072)],
}
ALL_SHAPES = [shape for shapes in SHAPES.values() for shape in shapes]


def median_ms(fn: Callable, *args, repeats: int, calls_per_repeat: int = 1,
              work_items: int = 1, warmup: int = 2,
              dispatch_ms: list[float] | None = None) -> float:
  """Median milliseconds of one of the ``work_items`` evaluations that each ``fn(*args)`` does.

  Each repeat runs ``calls_per_repeat`` calls back to back and syncs once, so that the host's
  dispatch overlaps the device's work as it does in a training loop. ``dispatch_ms``, where
  given, gets the median of the repeats' host time a call, until the calls returned and
  before the sync: near the whole time where the host, not the device, sets the pace.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples, dispatched = [], []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls_per_repeat):
      out = None  # Freed before the next call allocates its own: one result alive at a time.
      out = fn(*args)
    dispatched.append((time.perf_counter() - start) * 1e3 / calls_per_repeat)
    jax.block_until_ready(out)
    out = None
    samples.append((time.perf_counter() - start) * 1e3 / (calls_per_repeat * work_items))
  if dispatch_ms is not None:
    dispatch_ms.append(statistics.median(dispatched))
  return statistics.median(samples)


def over_input_sets(fn: Callable) -> Callable:
  """``fn`` applied to each of several argument tuples in one executable.

  One dispatch of several evaluations keeps the host's launch cost out of small cases, and
  distinct inputs keep a repeated evaluation from reading its operands out of L2.
  """
  return lambda *input_sets: [fn(*inputs) for inputs in input_sets]


def data_parallel_mesh(devices: int) -> jax.sharding.Mesh | None:
  """A mesh of the first ``devices`` devices on one ``Auto`` axis, ``"data"``; None for one."""
  if devices == 1:
    return None
  if devices > len(jax.devices()):
    raise ValueError(f"--devices {devices}: only {len(jax.devices())} devices here")
  return jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:devices])


def profile_guided(lowered: jax.stages.Lowered, args: tuple, runs: int) -> jax.stages.Compiled:
  """``lowered`` compiled for XLA's profile-guided latency estimator: a compile without CUDA
  graphs runs ``runs`` times, under a device trace on the first process, whose measured op
  times then schedule the collectives against the computation in the second, default
  compile (NVIDIA GPUs; elsewhere the trace has no op times and the second compile is the
  default one). Every process compiles with the first one's profile, so that all order
  their collectives alike; an error that stops one process alone (out of memory in these
  runs) leaves the others waiting for it."""
  # Command buffers off for the trace: inside a CUDA graph the ops it times are not seen.
  compiled = lowered.compile({"xla_gpu_enable_command_buffer": ""})
  jax.block_until_ready(compiled(*args))  # Warm-up, out of the trace.
  tracing = jax.process_index() == 0
  with tempfile.TemporaryDirectory() as trace_dir:
    if tracing:
      jax.profiler.start_trace(trace_dir)
    try:
      for _ in range(runs):
        jax.block_until_ready(compiled(*args))
    finally:
      if tracing:
        jax.profiler.stop_trace()
    profile = (get_profiled_instructions_proto(
        str(max(pathlib.Path(trace_dir, "plugins", "profile").iterdir()))) if tracing else b"")
  if jax.process_count() > 1:
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(profile))))
    mine = np.frombuffer(profile, np.uint8) if tracing else np.zeros(size, np.uint8)
    profile = np.asarray(multihost_utils.broadcast_one_to_all(mine), np.uint8).tobytes()
  return lowered.compile({"fdo_profile": profile})


def free_port() -> int:
  """A free TCP port on this host, for a ``jax.distributed`` coordinator."""
  with socket.socket() as probe:
    probe.bind(("localhost", 0))
    return probe.getsockname()[1]


def join_processes(coordinator: str, num_processes: int, process_id: int) -> None:
  """Joins the ``jax.distributed`` run of ``num_processes`` (Gloo collectives between CPU
  devices); before anything starts JAX's backends."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def launch_processes(module: str, num_processes: int, argv: list[str]) -> None:
  """Runs ``python -m module *argv`` as ``num_processes`` processes of one device each (``GPU
  i`` for process i, which joins with ``--process-id i --coordinator HOST:PORT``) and waits
  for them; the first one prints. A process that fails raises here with its output."""
  port = free_port()
  workers = []
  for rank in range(num_processes):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(rank)}
    command = [sys.executable, "-m", module, *argv, "--process-id", str(rank),
               "--coordinator", f"localhost:{port}"]
    # The first process speaks; the others' output is kept for an error.
    workers.append(subprocess.Popen(command, env=env, text=True,
                                    stdout=None if rank == 0 else subprocess.PIPE,
                                    stderr=None if rank == 0 else subprocess.STDOUT))
  logs = [worker.communicate()[0] for worker in workers]
  failed = [rank for rank, worker in enumerate(workers) if worker.returncode]
  if failed:
    raise RuntimeError(f"{module} processes {failed} failed:\n"
                       + "\n".join((logs[rank] or "(output above)")[-3000:] for rank in failed))


def record(**fields) -> dict:
  """One measurement, with the device and jax version it was taken on, and the XLA_FLAGS
  (when set) that every compile took."""
  flags = {"xla_flags": os.environ["XLA_FLAGS"]} if os.environ.get("XLA_FLAGS") else {}
  return {**fields, **flags, "device": jax.devices()[0].device_kind,
          "jax_version": jax.__version__}


def append_json_lines(path: str | pathlib.Path | None, records: Iterable[dict]) -> None:
  """Appends each record as one JSON line to ``path`` (nothing when ``path`` is None)."""
  if path:
    with open(path, "a") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)


def read_json_lines(path: str | pathlib.Path | None) -> list[dict]:
  """The records of a JSON-lines file (none when ``path`` is None or not there yet)."""
  if not path or not pathlib.Path(path).exists():
    return []
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def parse_pairs(text: str, what: str = "DxN") -> list[tuple[int, int]]:
  """A comma list of pairs of positive ints written ``what`` (``"2048x512"``)."""
  pairs = [item.lower().split("x") for item in text.split(",")]
  if not all(len(pair) == 2 and all(v.isdigit() and int(v) > 0 for v in pair)
             for pair in pairs):
    raise argparse.ArgumentTypeError(f"expected a comma list of {what}, got {text!r}")
  return [(int(a), int(b)) for a, b in pairs]


def parse_shapes(text: str) -> list[tuple[int, int]]:
  """``"all"``, a model name of :data:`SHAPES`, or a comma list of ``DxN``."""
  if text == "all":
    return ALL_SHAPES
  if text in SHAPES:
    return SHAPES[text]
  return parse_pairs(text, f"DxN, 'all' or one of {sorted(SHAPES)}")


def parse_positive_ints(text: str) -> list[int]:
  """A comma list of positive ints."""
  try:
    values = [int(v) for v in text.split(",")]
  except ValueError:
    values = []
  if not values or min(values) <= 0:
    raise argparse.ArgumentTypeError(f"expected a comma list of positive ints, got {text!r}")
  return values


def positive_int(text: str) -> int:
  """An argparse type: one positive int."""
  return _int_at_least(text, 1, "a positive int")


def non_negative_int(text: str) -> int:
  """An argparse type: one int of 0 or more (a seed, a count that may be none)."""
  return _int_at_least(text, 0, "an int of 0 or more")


def _int_at_least(text: str, smallest: int, what: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = smallest - 1
  if value < smallest:
    raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
  return value


def parse_compiler_option(text: str) -> tuple[str, bool | int | str]:
  """``NAME=VALUE`` as an XLA option: true / false as booleans, integers as such."""
  name, sep, value = text.partition("=")
  if not sep or not name:
    raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
  if value.lower() in ("true", "false"):
    return name, value.lower() == "true"
  try:
    return name, int(value)
  except ValueError:
    return name, value


def parse_subset(text: str, choices: Sequence[str]) -> list[str]:
  """A comma list of distinct names out of ``choices``."""
  names = [name for name in text.split(",") if name]
  unknown = sorted(set(names) - set(choices))
  if unknown or len(set(names)) != len(names) or not names:
    raise argparse.ArgumentTypeError(
        f"expected distinct names out of {','.join(choices)}, got {text!r}")
  return names
