"""``RowLog``: per step and per layer, what each SEBP backward did, read without breaking jit.

Each backward given a log entry sends, through ``jax.debug.callback``, how many rows of its dY
were active, how many it kept, the capacity it ran at and the share of dY's squared L2 norm
it dropped (rows below the threshold, outside the index, or beyond ``top_n`` under
``overflow="drop"``). A callback is a host round trip per layer: the log is opt-in, a tool to
look at a run, not to leave on in a fast one.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class LayerEntry:
  """The callable one layer's backward calls; hashable, so that it can sit in the op's static
  configuration."""
  log: RowLog
  layer: str

  def __call__(self, active, kept, capacity, dropped_share, rows, row_max_abs,
               row_squared_norm) -> None:
    values = self.log.row_values
    self.log.append(self.layer, active=int(active), kept=int(kept), capacity=int(capacity),
                    dropped_share=float(dropped_share), rows=int(rows),
                    row_max_abs=np.asarray(row_max_abs) if values else None,
                    row_squared_norm=np.asarray(row_squared_norm) if values else None)


class RowLog:
  """Collects one record per layer and backward::

      log = RowLog()
      with use_sebp(active_mask=mask, row_log=log):
        ...
      jax.block_until_ready(grads)
      print(log.summary())            # or log.records: a list of dicts

  A record holds ``layer``, ``step`` (that layer's count of backwards so far: a layer under
  ``nn.scan`` / ``nnx.scan`` or a vmap runs one backward per iteration or member, in the
  backward's order, so there a training step holds several), ``rows`` (T),
  ``active``, ``kept``, ``capacity``, ``dropped_share`` (dropped / total squared norm of
  dY; NaN when dY is not finite, or when a row's squares overflow float32, ``|dY|`` above about
  1e19) and, with ``row_values=True``, ``row_max_abs`` and
  ``row_squared_norm``: each row's max ``|value|`` (Inf for a row holding NaN) and squared
  L2 norm of dY, numpy
  arrays of T in float32 (float64 for float64 dY; None otherwise), for
  :mod:`sebp_jax.analysis` and heat maps.
  """

  def __init__(self, row_values: bool = False):
    self.row_values = row_values
    self._records: list[dict] = []
    self._steps: dict[str, int] = {}
    self._lock = threading.Lock()

  def __hash__(self) -> int:
    return id(self)

  def __eq__(self, other) -> bool:
    return self is other

  def for_layer(self, layer: str) -> LayerEntry:
    return LayerEntry(self, layer)

  def append(self, layer: str, **fields) -> None:
    with self._lock:
      step = self._steps.get(layer, 0)
      self._steps[layer] = step + 1
      self._records.append({"layer": layer, "step": step, **fields})

  @property
  def records(self) -> list[dict]:
    """Every record so far, after waiting for the callbacks still in flight."""
    jax.effects_barrier()
    with self._lock:
      return list(self._records)

  def clear(self) -> None:
    jax.effects_barrier()
    with self._lock:
      self._records.clear()
      self._steps.clear()

  def summary(self) -> str:
    """A table, one line per layer: backwards logged, rows (the largest), active rows (mean,
    max), kept rows (max), capacities run, largest dropped share."""
    by_layer: dict[str, list[dict]] = {}
    # Backwards run last layer first: reversed, the table reads in the forward's order.
    for record in reversed(self.records):
      by_layer.setdefault(record["layer"], []).append(record)
    width = max([len(layer) for layer in by_layer] + [5])
    lines = [f"{'layer':<{width}}  steps   rows  active(mean/max)  kept(max)  capacities  "
             "dropped share(max)"]
    for layer, records in by_layer.items():
      active = np.array([r["active"] for r in records])
      capacities = sorted({r["capacity"] for r in records})
      dropped = np.max([r["dropped_share"] for r in records])  # NaN when dY was not finite
      lines.append(f"{layer:<{width}}  {len(records):5d}  {max(r['rows'] for r in records):5d}  "
                   f"{active.mean():9.1f}/{active.max():<6d}  {max(r['kept'] for r in records):9d}"
                   f"  {','.join(map(str, capacities)):>10}  {dropped:.3g}")
    return "\n".join(lines)
