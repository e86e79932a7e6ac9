"""Outputs remembered with a cheaper form of themselves that a loss may read instead.

A packed module's output is scattered back to the batch's shape ``[B, L, ...]`` for the model
to return, but a loss can read its packed rows (:func:`packed_rows_of`); an LM head's logits
can be computed by the loss from the head's inputs and kernel (:class:`LinearHead`), a few
rows at a time or on each device's columns of a vocabulary split over devices. What the loss
does not read is dead code, and XLA drops it (the ``[B, L, V]`` logits, a gathered kernel).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


@flax.struct.dataclass
class LinearHead:
  """The linear layer that made an output, ``rows = inputs @ kernel + bias`` in the layer's
  dtype: a loss can compute the output's rows from it, a few at a time
  (:func:`sebp_jax.losses.masked_causal_lm_loss`'s ``head_chunk``), or on the columns each
  device holds.

  Attributes:
    inputs: ``[N, D]``, the head's input rows (packed, or every position), in its dtype.
    kernel: ``[D, V]`` in the layer's dtype; with ``vocab_axis``, this device's block of
      ``V / devices`` columns.
    bias: ``[V]`` (with ``vocab_axis``, this device's block) or None.
    precision: the layer's matmul precision.
    vocab_axis: None, or the mesh axis (of the ``jax.shard_map`` the head runs in) whose
      devices each hold a block of the kernel's columns, in order: the whole head is never
      on one device (:func:`sebp_jax.sharding.fsdp_loss`).
  """
  inputs: Array
  kernel: Array
  bias: Array | None
  precision: Any = flax.struct.field(pytree_node=False, default=None)
  vocab_axis: str | None = flax.struct.field(pytree_node=False, default=None)


def unread_parameters_reason(names, read: tuple[str | None, ...]) -> str | None:
  """Why a layer that holds parameters (``names``) its own computation does not read (those
  of ``read``) stays dense, or None: an adapter that intercepts the layer's ops (qwix's LoRA)
  adds to its output, and the SEBP backward, which knows the layer's own, would drop that
  part of dX."""
  unread = sorted(set(names) - set(read))
  if not unread:
    return None
  return (f"parameters its computation does not read ({', '.join(unread)}): an adapter that "
          "intercepts its ops, such as qwix's LoRA, may add to its output")


#: Primitives that only type a value as varying over mesh axes (``jax.shard_map``).
_VARYING = ("pvary", "pcast")


def linear_head_reason(module: nn.Dense) -> str | None:
  """Why a loss may not compute the output of ``module`` (a Dense layer that runs
  ``nn.Dense.__call__``, in its call, its parameters made) from its kernel and bias alone, as
  a :class:`LinearHead`, or None: a custom ``dot_general``, parameters its computation does
  not read (an adapter: qwix's LoRA), or a ``dot_general`` that an op interceptor rewrites in
  this layer's call (qwix's quantization-aware training, which adds no parameter)."""
  if module.dot_general is not None or module.dot_general_cls is not None:
    return "a custom dot_general"
  reason = unread_parameters_reason(module.variables.get("params", {}), ("kernel", "bias"))
  if reason:
    return reason
  kernel = nn.meta.unbox(module.get_variable("params", "kernel"))
  probe = jax.ShapeDtypeStruct((1, jnp.shape(kernel)[0]), jnp.result_type(kernel))
  matmul = jax.make_jaxpr(
      lambda x: jax.lax.dot_general(x, kernel, (((1,), (0,)), ((), ()))))(probe)
  # Inside a shard_map the probe is first marked as varying over the kernel's axes.
  ops = [eqn.primitive.name for eqn in matmul.eqns if eqn.primitive.name not in _VARYING]
  if ops != ["dot_general"]:
    return "its dot_general rewritten by an op interceptor (qwix's quantization)"
  return None


@dataclasses.dataclass(frozen=True)
class PackedOutput:
  """A packed module's output as :func:`remember_packed` keeps it: ``rows [1, C, ...]``, its
  ``layout`` (a :class:`sebp_jax.packing.PackedLayout`), and the ``head`` that made it where
  it is a linear layer's (else None)."""
  rows: Array
  layout: Any
  head: LinearHead | None = None


# Per thread, arrays (weakly: an entry lives as long as its array) with what they were made
# from: a loss that finds its input here reads that instead.
_REMEMBERED = threading.local()


def _remember(array: Array, made_from: PackedOutput | LinearHead) -> Array:
  if not hasattr(_REMEMBERED, "entries"):
    _REMEMBERED.entries = {}
  entries = _REMEMBERED.entries
  key = id(array)
  entries[key] = (weakref.ref(array), made_from)
  weakref.finalize(array, entries.pop, key, None)
  return array


def _recall(array: Array, kind: type) -> Any:
  entry = getattr(_REMEMBERED, "entries", {}).get(id(array))
  if entry is None or entry[0]() is not array or not isinstance(entry[1], kind):
    return None
  return entry[1]


def remember_packed(scattered: Array, packed: Array, layout: Any,
                    head: LinearHead | None = None) -> Array:
  """``scattered`` (:func:`sebp_jax.packing.scatter_tokens` of ``packed``), remembered with
  its packed rows (and the linear ``head`` that made them, if given) so that
  :func:`packed_rows_of` finds them: a loss reading the rows leaves the scatter dead, and XLA
  drops the ``[B, L, ...]`` buffer (an LM head's ``[B, L, vocabulary]`` logits)."""
  return _remember(scattered, PackedOutput(packed, layout, head))


def packed_rows_of(scattered: Array) -> PackedOutput | None:
  """The :class:`PackedOutput` of an output remembered by :func:`remember_packed` (the very
  array, in the trace that made it), else None."""
  return _recall(scattered, PackedOutput)


def remember_head(outputs: Array, head: LinearHead) -> Array:
  """``outputs``, a linear layer's, remembered with the :class:`LinearHead` that computes
  them, so that :func:`head_of` finds it."""
  return _remember(outputs, head)


def head_of(outputs: Array) -> LinearHead | None:
  """The :class:`LinearHead` of outputs remembered by :func:`remember_head` (the very array,
  in the trace that made it), else None."""
  return _recall(outputs, LinearHead)
