"""An independent float64 numpy reference of the SEBP selection rule and backward.

Written without any of sebp_jax's code so that tests compare two implementations.
"""

import numpy as np


def reference_active_rows(dy, top_n, threshold=0.0):
  """Sorted indices of the rows kept by SEBP's rule, computed in float64 (at most top_n)."""
  dy = np.asarray(dy)
  dy = np.abs(dy) if np.iscomplexobj(dy) else dy.astype(np.float64)  # magnitudes of complex
  with np.errstate(over="ignore", invalid="ignore"):
    squared_norm = (dy * dy).sum(axis=1)
    max_abs = np.abs(dy).max(axis=1) if dy.shape[1] else np.zeros(len(dy))
  finite = np.isfinite(squared_norm)
  active = np.flatnonzero((max_abs > threshold) | ~finite)
  rank_key = np.where(finite[active], squared_norm[active], np.inf)
  # Largest norm first; ties to the lower index (stable sort on the negated key).
  order = np.argsort(-rank_key, kind="stable")
  return np.sort(active[order[:top_n]])


def reference_backward(x, kernel, dy, rows):
  """(dx, dkernel, dbias) in float64 from the rows `rows` of dy only; x/dy are [T, F]."""
  dtype = np.complex128 if any(np.iscomplexobj(a) for a in (x, kernel, dy)) else np.float64
  x, kernel, dy = (np.asarray(a, dtype) for a in (x, kernel, dy))
  dx = np.zeros(x.shape, dtype)
  dx[rows] = dy[rows] @ kernel.T
  return dx, x[rows].T @ dy[rows], dy[rows].sum(axis=0)


def reference_table_grad(num_embeddings, ids, dy, rows):
  """float64 gradient of an embedding table from the rows `rows` of dy only (ids flat [T],
  dy [T, F])."""
  d_table = np.zeros((num_embeddings, dy.shape[1]))
  np.add.at(d_table, ids[rows], np.asarray(dy, np.float64)[rows])
  return d_table


def reference_take_grad(num_embeddings, ids, dy):
  """float64 gradient of ``jnp.take(table, ids, axis=0)`` for the table (ids of any integer
  dtype and shape, dy ``[*ids.shape, F]``): each id adds its row of dy to the row take reads,
  a negative id plus the table's size, added in the ids' dtype (where the size does not fit
  it, it wraps, as in take), and nothing where that is still out of the table."""
  ids = np.asarray(ids)
  with np.errstate(over="ignore"):
    size = np.asarray(num_embeddings).astype(ids.dtype)
    rows = np.where(ids < 0, ids + size, ids).ravel()
  dy = np.asarray(dy, np.float64).reshape(-1, np.shape(dy)[-1])
  d_table = np.zeros((num_embeddings, dy.shape[1]))
  for position, row in enumerate(int(r) for r in rows):
    if 0 <= row < num_embeddings:
      d_table[row] += dy[position]
  return d_table


def random_sparse_rows(rng, num_rows, width, num_nonzero, dtype=np.float32):
  """[num_rows, width] normal data with all but `num_nonzero` random rows exactly zero."""
  dy = rng.standard_normal((num_rows, width)).astype(dtype)
  zero_rows = rng.permutation(num_rows)[num_nonzero:]
  dy[zero_rows] = 0
  return dy


def relative_error(actual, expected):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  denom = np.linalg.norm(expected)
  return np.linalg.norm(actual - expected) / (denom if denom else 1.0)
