"""Backends of the sparse backward: given the kept rows, compute dX, dW and db.

Every backend has one signature, ``sparse_backward(x, kernel, dy, active_rows, ...)``, with
``x: [T, D]``, ``kernel: [D, N]``, ``dy: [T, N]`` and ``active_rows: int32[K]`` as produced by
:func:`sebp_jax.selection.select_active_rows` (sorted, padded with the sentinel ``T``). It returns

* ``dx: [T, D]`` (dtype of x): ``dy[r] @ kernel.T`` for every kept row r, exactly 0 elsewhere;
* ``dkernel: [D, N]`` (dtype of kernel): ``x[rows].T @ dy[rows]``, float32 accumulation;
* ``dbias: [N]`` (dtype of dy) or None: ``sum(dy[rows])``, float32 accumulation
  (float64 for float64 operands).

``"xla"`` is the reference: a gather, two reduced dots and a scatter in plain jnp. It
materialises the gathered ``[K, N]`` and ``[K, D]`` copies, which the ``"pallas"`` backend avoids
by gathering inside its kernels (see ``pallas_kernels/``).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
Backend = Literal["xla", "pallas"]
BACKENDS: tuple[str, ...] = ("xla", "pallas")


def _gather_rows(a: Array, rows: Array) -> Array:
  """``a[rows]`` for ``a: [T, F]``, with zero rows for sentinel slots (``rows == T``)."""
  return jnp.take(a, rows, axis=0, mode="fill", fill_value=0, indices_are_sorted=True)


def accumulation_dtype(dtype) -> jnp.dtype:
  """float32 for 16-bit operands (and float32), float64 for float64 operands."""
  return jnp.promote_types(dtype, jnp.float32)


def xla_sparse_backward(x, kernel, dy, active_rows, *, with_bias, precision):
  """The jnp reference of :func:`sparse_backward` (see the module docstring for shapes)."""
  accumulate = accumulation_dtype(dy.dtype)
  dy_kept = _gather_rows(dy, active_rows)  # [K, N]
  x_kept = _gather_rows(x, active_rows)  # [K, D]
  dx_kept = lax.dot_general(
      dy_kept, kernel, (((1,), (1,)), ((), ())), precision=precision,
      preferred_element_type=accumulate)  # [K, D]
  # Sentinel slots point past the end: mode="drop" discards them. Indices are not declared
  # unique because the sentinel repeats.
  dx = jnp.zeros(x.shape, x.dtype).at[active_rows].set(
      dx_kept.astype(x.dtype), mode="drop", indices_are_sorted=True)
  dkernel = lax.dot_general(
      x_kept, dy_kept, (((0,), (0,)), ((), ())), precision=precision,
      preferred_element_type=accumulate).astype(kernel.dtype)
  dbias = jnp.sum(dy_kept, axis=0, dtype=accumulate).astype(dy.dtype) if with_bias else None
  return dx, dkernel, dbias


def pallas_sparse_backward(x, kernel, dy, active_rows, *, with_bias, precision):
  """:func:`sparse_backward` through the Pallas kernels (Triton on GPU, interpreted elsewhere)."""
  import pallas_kernels  # Imported lazily: the XLA path must not pay for Pallas' import.

  interpret = jax.default_backend() != "gpu"
  dx = pallas_kernels.gathered_dx(dy, kernel, active_rows, precision=precision,
                                  interpret=interpret).astype(x.dtype)
  dkernel, dbias = pallas_kernels.gathered_dw_db(
      x, dy, active_rows, with_bias=with_bias, precision=precision, interpret=interpret)
  return dx, dkernel.astype(kernel.dtype), dbias


def sparse_backward(x: Array, kernel: Array, dy: Array, active_rows: Array, *,
                    with_bias: bool, precision=None, backend: Backend = "xla"):
  """dX, dW, db of ``y = x @ kernel + b`` from the rows ``active_rows`` of ``dy`` alone.

  Args:
    x: ``[T, D]`` forward input.
    kernel: ``[D, N]``.
    dy: ``[T, N]`` output gradient.
    active_rows: ``int32[K]``, sorted, padded with the sentinel ``T``.
    with_bias: whether to return db.
    precision: ``lax.Precision`` for the dots, as in the forward.
    backend: ``"xla"`` or ``"pallas"``.

  Returns:
    ``(dx [T, D], dkernel [D, N], dbias [N] or None)`` in the dtypes of x, kernel and dy.
  """
  if backend == "xla":
    return xla_sparse_backward(x, kernel, dy, active_rows, with_bias=with_bias,
                               precision=precision)
  if backend == "pallas":
    return pallas_sparse_backward(x, kernel, dy, active_rows, with_bias=with_bias,
                                  precision=precision)
  raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
