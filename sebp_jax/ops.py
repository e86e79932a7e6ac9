"""The SEBP linear op: a dense, exact forward and a top-N-row backward.

``sebp_linear(x, kernel, bias, top_n=...)`` returns ``x @ kernel + bias`` computed exactly as
``flax.linen.Dense`` computes it. Its backward (a ``jax.custom_vjp``; JAX never differentiates
through the kernels) flattens dY to ``[T, N]``, keeps ``top_n`` rows (see
:mod:`sebp_jax.selection`) and computes dX, dW and db from those rows alone (see
:mod:`sebp_jax.backends`), at ``top_n / T`` of the dense FLOPs.

Why the choices:

* ``top_n`` is a static Python int so that every array in the backward has a fixed shape: jit
  compiles once, and no host round trip is needed to learn how many rows are active.
* Residuals are what the dense backward keeps (x and kernel in the compute dtype): no extra
  memory beyond the ``[top_n]`` index and the ``[top_n, *]`` gathered blocks.
* The cast to the compute dtype (``dtype``, as ``nn.Dense`` does it) happens inside the op, so
  the gradients come back in the arguments' own dtypes straight from the float32 sums: a
  float32 kernel used in bf16 gets its dW rounded once, not first to bf16 as autodiff through
  the cast would round it. (For precision: the speed was the same either way, H100, Llama-1B
  shapes 1.40x vs 1.40x and BERT-base 2.30x vs 2.29x, ``python -m benchmarks.ablations cast``.)
* With ``top_n >= T`` nothing can be skipped, and the dense backward runs; on GPU,
  ``backend="auto"`` also runs it where SEBP is predicted slower (small layers, many rows).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import canonicalize_dtype, promote_dtype
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from sebp_jax.backends import BACKEND_CHOICES, choose_backend, dense_backward, sparse_backward
from sebp_jax.selection import select_active_rows

Array = jax.Array

#: Name given to every SEBP output with ``jax.ad_checkpoint.checkpoint_name``. A remat policy
#: such as ``dots_saveable`` does not recognise a custom_vjp output as a dot; save SEBP outputs
#: with ``jax.checkpoint_policies.save_only_these_names(SEBP_CHECKPOINT_NAME)`` (or combine it).
SEBP_CHECKPOINT_NAME = "sebp_linear"


@dataclasses.dataclass(frozen=True)
class SEBPConfig:
  """The static (non-differentiable) arguments of the op; hashable for ``custom_vjp``."""
  top_n: int
  threshold: float
  precision: Any
  backend: str
  #: The compute dtype, as ``nn.Dense.dtype``: x, kernel and bias are cast to it inside the op.
  dtype: Any
  #: The dtypes of x, kernel and bias as given (integers already cast to ``dtype``; None
  #: without bias): those of their gradients.
  grad_dtypes: tuple[Any, Any, Any]

  @property
  def with_bias(self) -> bool:
    return self.grad_dtypes[2] is not None


def validate_top_n(top_n: Any, name: str = "top_n") -> int:
  """Returns ``top_n`` as a Python int, or raises ValueError saying what was expected."""
  if isinstance(top_n, jax.core.Tracer):
    raise ValueError(
        f"{name} must be a static positive Python int, got a traced value {top_n!r}: it fixes "
        "the shapes of the backward, so it cannot depend on data (pass it as a static argument "
        "of jit, or compute it from array shapes).")
  if isinstance(top_n, (bool, np.bool_)) or not isinstance(top_n, numbers.Integral):
    raise ValueError(f"{name} must be a positive Python int, got {top_n!r} "
                     f"of type {type(top_n).__name__}")
  if top_n <= 0:
    raise ValueError(f"{name} must be a positive Python int, got {top_n}")
  return int(top_n)


def validate_threshold(threshold: Any) -> float:
  """Returns ``threshold`` as a Python float, or raises ValueError saying what was expected."""
  if (isinstance(threshold, (bool, np.bool_, jax.core.Tracer))
      or not isinstance(threshold, numbers.Real)
      or not math.isfinite(threshold) or threshold < 0):
    raise ValueError(f"threshold must be a finite non-negative Python float, got {threshold!r}")
  return float(threshold)


def validate_active_rows(active_rows: Any, top_n: int) -> Array | None:
  """``active_rows`` as ``int32[top_n]`` (None stays None), or ValueError saying what was
  expected."""
  if active_rows is None:
    return None
  active_rows = jnp.asarray(active_rows)
  if active_rows.shape != (top_n,) or not jnp.issubdtype(active_rows.dtype, jnp.integer):
    raise ValueError(f"active_rows must be an integer array of shape ({top_n},) (top_n), "
                     f"got {active_rows.dtype}{list(active_rows.shape)}")
  return active_rows.astype(jnp.int32)


def _check_shapes(x: Array, kernel: Array, bias: Array | None) -> None:
  if kernel.ndim != 2:
    raise ValueError(f"kernel must be 2-D [in_features, out_features], got shape {kernel.shape}")
  if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"x's last dimension must equal kernel's first: x has shape {x.shape}, "
                     f"kernel has shape {kernel.shape}")
  if bias is not None and bias.shape != (kernel.shape[1],):
    raise ValueError(f"bias must have shape ({kernel.shape[1]},) to match kernel of shape "
                     f"{kernel.shape}, got bias of shape {bias.shape}")


def _dense_forward(x, kernel, bias, precision):
  """``flax.linen.Dense``'s forward, op for op, so that the result is bit-identical."""
  y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
  if bias is not None:
    y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
  return y


def nan_if_not_finite(dy: Array) -> Array:
  """A float32 scalar: 0 if every element of ``dy: [T, N]`` is finite, else NaN.

  A given index never looks at dY, so a NaN/Inf in a row it skips would vanish from the
  gradient. Passed to the backend as ``poison`` (see :mod:`sebp_jax.backends`), this makes dW
  and db NaN instead, so the error stays visible. It is one max over each row of dY and a max
  of those; it relies on XLA's max propagating NaN (its default; the GPU flag
  ``--xla_gpu_enable_fast_min_max`` would break that). Measured on an H100 with the shared
  index, backward speedup over dense with this check / ``all(isfinite)`` / a column sum / no
  check at all: 2.22x / 2.18x / 2.15x / 2.47x on BERT-base and 1.39x / 1.40x / 1.32x / 1.44x
  on Llama-1B shapes (``python -m benchmarks.ablations check``, ``benchmarks/RESULTS.md``).
  """
  row_max = jnp.max(jnp.abs(dy), axis=1)  # NaN propagates through max; |Inf| * 0 is NaN.
  # Multiplied before the cast, so that a finite float64 value past float32's range stays 0.
  return (jnp.max(row_max) * 0).astype(jnp.float32)


def _in_grad_dtypes(grads, config: SEBPConfig):
  return tuple(None if g is None else g.astype(dtype)
               for g, dtype in zip(grads, config.grad_dtypes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sebp_linear(x, kernel, bias, active_rows, config: SEBPConfig):
  del active_rows  # Only the backward uses it.
  return _dense_forward(*promote_dtype(x, kernel, bias, dtype=config.dtype), config.precision)


def _sebp_linear_fwd(x, kernel, bias, active_rows, config: SEBPConfig):
  # The dense backward's residuals (the cast inputs), plus the [top_n] index if one was given.
  x, kernel, bias = promote_dtype(x, kernel, bias, dtype=config.dtype)
  return _dense_forward(x, kernel, bias, config.precision), (x, kernel, active_rows)


def _sebp_linear_bwd(config: SEBPConfig, residuals, dy):
  x, kernel, active_rows = residuals
  num_rows = math.prod(x.shape[:-1])
  index_given = active_rows is not None
  backend = choose_backend(config.backend, num_rows=num_rows, in_features=kernel.shape[0],
                           out_features=kernel.shape[1], top_n=config.top_n,
                           itemsize=dy.dtype.itemsize, index_given=index_given)
  x2d = x.reshape(num_rows, x.shape[-1])
  dy2d = dy.reshape(num_rows, dy.shape[-1])
  options = dict(with_bias=config.with_bias, precision=config.precision,
                 dkernel_dtype=config.grad_dtypes[1])
  if backend == "dense":
    grads = dense_backward(x2d, kernel, dy2d, **options)
  else:
    if not index_given:
      active_rows = select_active_rows(dy2d, config.top_n, config.threshold)
    grads = sparse_backward(x2d, kernel, dy2d, active_rows, backend=backend,
                            poison=nan_if_not_finite(dy2d) if index_given else None, **options)
  dx, dkernel, dbias = _in_grad_dtypes(grads, config)
  return dx.reshape(x.shape), dkernel, dbias, None


_sebp_linear.defvjp(_sebp_linear_fwd, _sebp_linear_bwd)


def validate_backend(backend: Any) -> str:
  if backend not in BACKEND_CHOICES:
    raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
  return backend


def sebp_linear(x: Array, kernel: Array, bias: Array | None = None, *, top_n: int,
                threshold: float = 0.0, precision: Any = None, backend: str = "auto",
                active_rows: Array | None = None, dtype: Any = None) -> Array:
  """``x @ kernel + bias`` with a sparse, top-N-row backward.

  Args:
    x: ``[..., D]``; every leading dimension counts as rows, ``T = prod(x.shape[:-1])``.
    kernel: ``[D, N]``.
    bias: ``[N]`` or None.
    top_n: how many rows of dY the backward keeps (static positive int). ``top_n >= T`` runs
      the dense backward.
    threshold: a row of dY is active when its max ``|value|`` exceeds this (0.0: any
      non-zero). Rows with NaN or Inf are always active and kept first.
    precision: ``lax.Precision`` of the forward and backward dots, as in ``nn.Dense``.
    backend: ``"xla"`` (gather, dots, gather in jnp), ``"pallas"`` (kernels; Triton on GPU,
      interpreted elsewhere) or ``"auto"``: ``"xla"``, except that on GPU the dense backward
      (all rows kept, exact) runs where a cost model of the layer's static shapes predicts
      SEBP slower. See :func:`sebp_jax.backends.choose_backend`.
    active_rows: optional ``int32[top_n]`` index of the rows to keep, sorted and padded with the
      sentinel ``T`` (e.g. from :func:`sebp_jax.active_rows_from_mask`). Given, the backward
      skips scoring dY and uses it as is, so several layers can share one selection; it still
      reads dY once, so that a NaN/Inf in a skipped row makes dW and db NaN rather than vanish.
    dtype: the compute dtype, as ``nn.Dense``'s ``dtype``: x, kernel and bias are cast to it
      (None: to their promoted type, as ``flax.linen.dtypes.promote_dtype`` does).

  Returns:
    ``y: [..., N]``, bit-identical to ``flax.linen.Dense`` with the same params and dtype.
    The gradients w.r.t. x, kernel and bias come in their own dtypes; those of kernel and bias
    are rounded once from the float32 sums (not first to the compute dtype, as autodiff through
    the cast would round them).

  Under ``jax.vmap`` the top-N applies to each mapped instance separately. The output is named
  ``SEBP_CHECKPOINT_NAME`` for remat policies.
  """
  top_n = validate_top_n(top_n)
  threshold = validate_threshold(threshold)
  backend = validate_backend(backend)
  x, kernel, bias = (None if a is None else jnp.asarray(a) for a in (x, kernel, bias))
  _check_shapes(x, kernel, bias)
  dtype = canonicalize_dtype(x, kernel, bias, dtype=dtype)
  # Integer arguments have no gradient of their own dtype to come back in: cast them here.
  x, kernel, bias = (a if a is None or jnp.issubdtype(a.dtype, jnp.inexact) else a.astype(dtype)
                     for a in (x, kernel, bias))
  active_rows = validate_active_rows(active_rows, top_n)
  config = SEBPConfig(top_n=top_n, threshold=threshold, precision=precision, backend=backend,
                      dtype=dtype, grad_dtypes=(x.dtype, kernel.dtype,
                                                None if bias is None else bias.dtype))
  y = _sebp_linear(x, kernel, bias, active_rows, config)
  return checkpoint_name(y, SEBP_CHECKPOINT_NAME)
