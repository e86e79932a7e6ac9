"""Looking at dY: the noise threshold ε, per-layer tables and heat maps of a :class:`RowLog`.

* :func:`estimate_threshold` / :func:`plot_threshold`: ε at the knee of the CDF of ``|dY|``;
* :func:`layer_table` / :func:`format_table` / :func:`dropped_share`: per layer, the row
  sparsity of dY, the active rows against the capacity run, and the share of dY's norm a
  given ``top_n`` / ε would drop, from the records of a ``RowLog(row_values=True)``;
* :func:`plot_row_heatmap`: each row's max ``|dY|``, per layer and token (the paper's Fig. 2).

``python -m examples.profile_sparsity`` runs them on the real pretrained models.

The threshold, from the distribution of ``|dY|`` (its row maxima, say):

SEBP keeps a row of dY when its max ``|value|`` exceeds ε. The paper picks ε at the knee of the
CDF of ``|dY|``. Those values are a mixture, in any proportion: a mass of near-zero "noise"
(padding rows, 1e-9..1e-6) and the "signal" (1e-4..1e-1), decades apart. So the rule works in
log10 space, on the strictly positive finite values (exact zeros are below any ε; NaN/Inf
carry no scale), where both masses are roughly Gaussian, and must land in the gap between
them whatever their shares:

1. histogram the log values on ``bins`` equal bins;
2. split them in two by minimum-error thresholding (Kittler-Illingworth: the split whose two
   Gaussians, each with its own share and variance, fit best). Otsu's split assumes equal
   variances and shares of one order, and misses a class of a few percent;
3. smooth the histogram (Gaussian, the larger of the two classes' Silverman bandwidths);
4. no noise floor (ε = 0.0: keep every non-zero row) unless the split is meaningful: each
   class holds >= 1% and >= 10 of the values, their between-class variance is >= 0.3 of the
   total, and the smoothed density dips between the two modes to <= 0.3 of the lower one;
5. ε is where the noise population's rise ends: the first bin edge past the noise mode at
   which the smoothed CDF is within 0.1% of its value at the valley, i.e. where it turns
   flat. The knee by curvature (the most negative slope change) lies inside the noise's upper
   flank, at +1σ of a log-normal noise, and would leave 16% of it above ε; a Kneedle chord
   moves with the shares. Past a sparse tail ε sits just above the last noise values; where
   the two masses overlap it is at most the valley.
"""

from __future__ import annotations

import os

import numpy as np

from sebp_jax.selection import validate_threshold

_MIN_CLASS_SHARE = 0.01
_MIN_CLASS_COUNT = 10
_MIN_SEPARABILITY = 0.3
_MAX_VALLEY_RATIO = 0.3
_FLAT_TOLERANCE = 1e-3


def _magnitudes(values) -> np.ndarray:
  """``|values|`` in float64, flattened: a complex entry's modulus, imaginary part included."""
  return np.abs(np.asarray(values)).astype(np.float64).ravel()


def _log_positive(values) -> np.ndarray:
  """log10 of the strictly positive finite entries of ``|values|``, flattened (maybe none)."""
  magnitudes = _magnitudes(values)
  return np.log10(magnitudes[np.isfinite(magnitudes) & (magnitudes > 0)])


def _silverman(logs: np.ndarray) -> float:
  iqr = np.subtract(*np.percentile(logs, [75, 25]))
  spread = min(np.std(logs), iqr / 1.34) if iqr > 0 else np.std(logs)
  return 0.9 * spread * logs.size ** -0.2


def _smooth(counts: np.ndarray, sigma_bins: float) -> np.ndarray:
  radius = int(np.ceil(4 * sigma_bins))
  kernel = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma_bins) ** 2)
  return np.convolve(counts, kernel / kernel.sum())[radius:radius + counts.size]


def _split(counts: np.ndarray, width: float) -> int | None:
  """Last bin of the lower class by minimum-error thresholding, or None if not meaningful."""
  p = counts / counts.sum()
  centres = (np.arange(counts.size) + 0.5) * width  # from the first edge: shift-invariant
  w0 = np.cumsum(p)[:-1]
  w1 = 1 - w0
  s0, q0 = np.cumsum(p * centres)[:-1], np.cumsum(p * centres ** 2)[:-1]
  total, total_sq = s0[-1] + p[-1] * centres[-1], q0[-1] + p[-1] * centres[-1] ** 2
  smaller = np.minimum(w0, w1)
  valid = (smaller >= _MIN_CLASS_SHARE) & (smaller * counts.sum() >= _MIN_CLASS_COUNT)
  if not valid.any():
    return None
  with np.errstate(divide="ignore", invalid="ignore"):
    m0, m1 = s0 / w0, (total - s0) / w1
    # A class in one bin still has the variance of a uniform over it.
    v0 = np.maximum(q0 / w0 - m0 ** 2, width ** 2 / 12)
    v1 = np.maximum((total_sq - q0) / w1 - m1 ** 2, width ** 2 / 12)
    cost = w0 * np.log(v0) + w1 * np.log(v1) - 2 * (w0 * np.log(w0) + w1 * np.log(w1))
  k = int(np.argmin(np.where(valid, cost, np.inf)))
  separability = w0[k] * w1[k] * (m0[k] - m1[k]) ** 2 / (total_sq - total ** 2)
  return k if separability >= _MIN_SEPARABILITY else None


def _analyse(logs: np.ndarray, bins: int):
  """(edges [bins + 1], smoothed counts [bins], ε) of the log values ``logs``; with none
  (no finite non-zero value), an empty histogram and ε = 0."""
  if logs.size == 0:
    return np.linspace(-1.0, 0.0, bins + 1), np.zeros(bins), 0.0
  counts, edges = np.histogram(logs, bins=bins)
  width = edges[1] - edges[0]
  k = _split(counts, width) if np.ptp(logs) > 0 else None
  if k is None:
    return edges, _smooth(counts, max(_silverman(logs) / width, 1.0)), 0.0
  below = logs < edges[k + 1]
  sigma_bins = max(_silverman(logs[below]), _silverman(logs[~below])) / width
  smoothed = _smooth(counts, max(sigma_bins, 1.0))
  # Modes of each class alone: a small signal class may peak below the noise's tail.
  noise = _smooth(np.where(np.arange(bins) <= k, counts, 0), max(sigma_bins, 1.0))
  noise_mode, signal_mode = int(np.argmax(noise)), int(np.argmax(smoothed - noise))
  if signal_mode <= noise_mode:
    return edges, smoothed, 0.0
  valley = noise_mode + int(np.argmin(smoothed[noise_mode:signal_mode + 1]))
  if smoothed[valley] > _MAX_VALLEY_RATIO * min(smoothed[noise_mode], smoothed[signal_mode]):
    return edges, smoothed, 0.0
  cdf = np.cumsum(smoothed)  # cdf[i]: mass up to the right edge of bin i
  flat = cdf[noise_mode:valley + 1] >= (1 - _FLAT_TOLERANCE) * cdf[valley]
  return edges, smoothed, float(10.0 ** edges[noise_mode + int(np.argmax(flat)) + 1])


def _check_bins(bins) -> int:
  if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or bins < 16:
    raise ValueError(f"bins must be an int >= 16, got {bins!r}")
  return int(bins)


def estimate_threshold(values, *, bins: int = 200,
                       plot: str | os.PathLike | None = None) -> float:
  """ε at the knee of the CDF of ``|values|``, in the units of ``values`` (see module doc).

  Args:
    values: array-like of any shape (numpy or jax), e.g. row maxima ``[T]`` or dY ``[T, F]``;
      complex values count by their modulus.
    bins: number of log-spaced histogram bins, an int >= 16.
    plot: if given, a path where :func:`plot_threshold` saves the CDF with ε marked.

  Returns:
    ε as a Python float: above the noise mass and below the signal mass, or 0.0 when the
    positive values are not bimodal (no noise floor), and when there are none (empty, all
    zeros, NaN or Inf).
  """
  bins = _check_bins(bins)
  _, _, threshold = _analyse(_log_positive(values), bins)
  if plot is not None:
    plot_threshold(values, threshold, plot, bins=bins)
  return threshold


def plot_threshold(values, threshold: float, path, *, title: str | None = None,
                   bins: int = 200) -> None:
  """Draws the log-x CDF of ``|values|`` and, on a twin axis, its smoothed density over
  ``bins`` log-spaced bins (as :func:`estimate_threshold` takes them); marks ε (``threshold``)
  with a vertical line and its value; saves a PNG to ``path``.

  The CDF is that of all finite values: exact zeros show as its value at the left edge.
  """
  # A bare Figure renders PNG through Agg without pyplot: no display needed, and the
  # caller's pyplot backend and figures are left alone.
  from matplotlib.figure import Figure

  logs = _log_positive(values)
  num_finite = int(np.isfinite(_magnitudes(values)).sum())
  edges, smoothed, _ = _analyse(logs, _check_bins(bins))
  counts = np.histogram(logs, bins=edges)[0]
  cdf = ((num_finite - logs.size + np.concatenate([[0], np.cumsum(counts)]))
         / max(num_finite, 1))
  x = 10.0 ** edges

  fig = Figure(figsize=(7, 4))
  ax = fig.subplots()
  ax.step(x, cdf, where="post", color="C0", label="CDF")
  ax.set(xscale="log", xlabel="|value|", ylabel="CDF", ylim=(0, 1.02), title=title)
  twin = ax.twinx()
  twin.plot(np.sqrt(x[:-1] * x[1:]), smoothed, color="C1", alpha=0.7, label="smoothed density")
  twin.set_ylabel("smoothed count per log bin")
  if threshold > 0:
    ax.axvline(threshold, color="C3", linestyle="--", label=f"ε = {threshold:.3g}")
  else:
    ax.plot([], [], " ", label="ε = 0 (no noise floor)")
  handles, labels = (a + b for a, b in zip(ax.get_legend_handles_labels(),
                                           twin.get_legend_handles_labels()))
  twin.legend(handles, labels, loc="center right")  # on the top axes, above both curves
  fig.tight_layout()
  fig.savefig(path, format="png")


def _validate_top_n(top_n) -> int | None:
  if top_n is None:
    return None
  if isinstance(top_n, bool) or not isinstance(top_n, (int, np.integer)) or top_n < 1:
    raise ValueError(f"top_n must be a positive int or None, got {top_n!r}")
  return int(top_n)


def dropped_share(row_max_abs, row_squared_norm, *, top_n: int | None = None,
                  threshold: float = 0.0) -> float:
  """The share of dY's squared L2 norm that SEBP drops when it keeps only the rows whose max
  ``|value|`` exceeds ``threshold`` and, of those, at most ``top_n`` (the largest by norm; None:
  no cap), from each row's max ``|value|`` and squared norm (``[T]`` each). 0.0 when dY is all
  zeros: there is nothing to drop; NaN when it is not finite, as in the :class:`RowLog`, or
  when a row's squares overflowed the float32 they were summed in (``|dY|`` above about 1e19)."""
  top_n = _validate_top_n(top_n)
  threshold = validate_threshold(threshold)
  squared = np.asarray(row_squared_norm, dtype=np.float64).ravel()
  above = _active_at(row_max_abs, threshold)
  candidates = np.sort(squared[above])
  beyond_cap = 0 if top_n is None else max(candidates.size - top_n, 0)
  # Summing the dropped rows themselves: nothing dropped is exactly 0.0.
  dropped = squared[~above].sum() + candidates[:beyond_cap].sum()
  total = squared.sum()
  if not np.isfinite(total):
    return float("nan")
  return float(dropped / total) if total > 0 else 0.0


def _active_at(row_max_abs, threshold: float) -> np.ndarray:
  """The rows SEBP counts active at ``threshold``: a max ``|value|`` above it, or NaN."""
  return ~(np.asarray(row_max_abs, dtype=np.float64).ravel() <= threshold)


def layer_table(records, *, top_n: int | None = None,
                threshold: float | None = None) -> list[dict]:
  """One row per layer of a :class:`sebp_jax.RowLog`'s ``records``, aggregated over its steps,
  in the order in which the layers first appear.

  Each row holds ``layer``, ``steps`` (records of the layer), ``rows`` (T, the largest seen),
  ``active_mean`` and ``active_max`` (rows of dY the backward found active), ``row_sparsity``
  (the share of the layer's rows over all its steps that were not active) and
  ``capacity_max``. Where every record of the layer carries row values
  (``RowLog(row_values=True)``), also what a given ``top_n``/``threshold`` would do:
  ``active_at_threshold_mean`` (rows whose max ``|dY|`` exceeds ``threshold``, 0 when None,
  or that hold NaN) and ``dropped_share_mean``/``dropped_share_max`` (:func:`dropped_share`
  of each step).
  """
  top_n = _validate_top_n(top_n)
  threshold = 0.0 if threshold is None else validate_threshold(threshold)
  by_layer: dict[str, list[dict]] = {}
  for record in records:
    by_layer.setdefault(record["layer"], []).append(record)
  table = []
  for layer, layer_records in by_layer.items():
    active = np.array([r["active"] for r in layer_records], dtype=np.float64)
    all_rows = sum(r["rows"] for r in layer_records)
    row = {"layer": layer, "steps": len(layer_records),
           "rows": max(r["rows"] for r in layer_records),
           "active_mean": float(active.mean()), "active_max": int(active.max()),
           "row_sparsity": float(1 - active.sum() / all_rows) if all_rows else 0.0,
           "capacity_max": max(r["capacity"] for r in layer_records)}
    if all(r.get("row_max_abs") is not None and r.get("row_squared_norm") is not None
           for r in layer_records):
      above = [np.count_nonzero(_active_at(r["row_max_abs"], threshold))
               for r in layer_records]
      shares = [dropped_share(r["row_max_abs"], r["row_squared_norm"], top_n=top_n,
                              threshold=threshold) for r in layer_records]
      row.update(active_at_threshold_mean=float(np.mean(above)),
                 dropped_share_mean=float(np.mean(shares)),
                 dropped_share_max=float(np.max(shares)))
    table.append(row)
  return table


def _format_cell(value) -> str:
  if isinstance(value, (bool, str)) or value is None:
    return str(value)
  if isinstance(value, (int, np.integer)):
    return str(int(value))
  return f"{value:.4g}"


def format_table(rows) -> str:
  """A fixed-width text table of ``rows`` (dicts, e.g. from :func:`layer_table`): one column per
  key, in the order the keys first appear; text left-aligned, numbers right-aligned, floats
  to 4 significant digits, a blank where a row lacks a key."""
  rows = list(rows)
  columns = list(dict.fromkeys(key for row in rows for key in row))
  cells = [[_format_cell(row[key]) if key in row else "" for key in columns] for row in rows]
  widths = [max([len(key)] + [len(line[i]) for line in cells]) for i, key in enumerate(columns)]
  numeric = [all(isinstance(row.get(key, 0), (int, float, np.number))
                 and not isinstance(row.get(key), bool) for row in rows) for key in columns]

  def line(values):
    return "  ".join(value.rjust(width) if is_number else value.ljust(width)
                     for value, width, is_number in zip(values, widths, numeric)).rstrip()

  return "\n".join([line(columns), line(["-" * width for width in widths])]
                   + [line(values) for values in cells])


def _short_names(layers: list[str]) -> list[str]:
  """The layer paths less the leading path components they all share."""
  parts = [layer.split("/") for layer in layers]
  shared = 0
  while (all(len(p) > shared + 1 for p in parts)
         and len({p[shared] for p in parts}) == 1):
    shared += 1
  return ["/".join(p[shared:]) for p in parts]


def _layer_ticks(layers: list[str], max_labels: int = 40) -> tuple[list[int], list[str]]:
  """(positions, labels) of the labelled layers: every layer while they are few, else the
  first layer of each block (its path up to its first numeric component, ``layers/7``),
  labelled with the block, and of those every n-th while there are still too many."""
  names = _short_names(layers)
  if len(names) <= max_labels:
    return list(range(len(names))), names
  blocks = []
  for name in names:
    parts = name.split("/")
    numeric = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    blocks.append("/".join(parts[:numeric + 1]))
  starts = [i for i, block in enumerate(blocks) if i == 0 or block != blocks[i - 1]]
  starts = starts[::max(1, -(-len(starts) // max_labels))]
  return starts, [blocks[i] for i in starts]


def _heatmap_values(maxima: np.ndarray) -> tuple[np.ndarray, float, float]:
  """``(drawn, vmin, vmax)``: log10 of each row's max ``|dY|`` between ``vmin`` and ``vmax``,
  exact zeros below ``vmin`` and rows holding NaN or Inf above ``vmax``, where the colour map's
  "under" and "over" colours draw them (imshow would draw NaN and -inf in one "bad" colour)."""
  finite = np.isfinite(maxima)
  shown = finite & (maxima > 0)
  logs = np.zeros(maxima.shape)
  np.log10(maxima, out=logs, where=shown)
  low, high = (logs[shown].min(), logs[shown].max()) if shown.any() else (-1.0, 0.0)
  high = max(high, low + 1e-3)
  return np.where(shown, logs, np.where(finite, low - 1, high + 1)), float(low), float(high)


def plot_row_heatmap(records, path, *, batch_shape: tuple[int, int], step: int = 0,
                     layers=None) -> None:
  """Draws the SEBP paper's Fig. 2: log10 of each row's max ``|dY|`` at one step, for every
  layer; saves a PNG to ``path``.

  The top panel is [layers x T] (a row per layer, a column per token of the flattened batch,
  minor ticks where sequences start); the bottom one is the first layer's rows as the [B, L]
  batch. Rows that are exactly zero (padding, under a masked loss) are white, below the colour
  scale, which starts at the smallest non-zero row; rows holding NaN or Inf are red, above it.

  Args:
    records: a :class:`sebp_jax.RowLog`'s records, with ``row_values=True``.
    batch_shape: (B, L) with B * L = T, the rows of each layer.
    step: which backward of each layer (its record's ``step``) to draw.
    layers: the layers to draw, top to bottom, each with B * L rows; default: those of
      ``step`` with B * L rows (not a pooled head's), in the order of their records.
  """
  from matplotlib import colormaps
  from matplotlib.figure import Figure
  from matplotlib.ticker import MaxNLocator

  batch, length = batch_shape
  at_step = {r["layer"]: r for r in records if r["step"] == step}
  if not at_step:
    raise ValueError(f"no record of step {step}")
  rows_of = {layer: np.size(record["row_max_abs"]) for layer, record in at_step.items()
             if record.get("row_max_abs") is not None}
  if layers is None:
    layers = [layer for layer, rows in rows_of.items() if rows == batch * length]
    if not layers and rows_of:
      raise ValueError(f"batch_shape {batch_shape} has {batch * length} rows, no layer of "
                       f"step {step} has: they have {sorted(set(rows_of.values()))}")
  layers = list(layers)
  if not layers and rows_of:
    raise ValueError("layers is empty: name at least one layer to draw")
  missing = [layer for layer in layers if layer not in at_step]
  if missing:
    raise ValueError(f"no record of step {step} for layers {missing[:5]}")
  if not layers or any(layer not in rows_of for layer in layers):
    raise ValueError("records have no row values: log them with RowLog(row_values=True)")
  other = [f"{layer} ({rows_of[layer]})" for layer in layers if rows_of[layer] != batch * length]
  if other:
    raise ValueError(f"batch_shape {batch_shape} has {batch * length} rows, the layers "
                     f"{', '.join(other[:5])} other counts (rows)")
  maxima = np.stack([np.asarray(at_step[layer]["row_max_abs"], dtype=np.float64).ravel()
                     for layer in layers])
  drawn, low, high = _heatmap_values(maxima)

  layers_height = float(np.clip(0.14 * len(layers), 2.5, 8.0))
  batch_height = float(np.clip(0.2 * batch, 1.2, 4.0))
  fig = Figure(figsize=(11, layers_height + batch_height + 1.8))
  grid = fig.add_gridspec(2, 2, width_ratios=[40, 1], height_ratios=[layers_height, batch_height])
  image_options = dict(aspect="auto", interpolation="nearest", vmin=low, vmax=high,
                       cmap=colormaps["viridis"].with_extremes(under="white", over="red"))
  layers_ax = fig.add_subplot(grid[0, 0])
  image = layers_ax.imshow(drawn, **image_options)
  # Sequence starts as minor ticks: a line over the image would hide the token beside it.
  layers_ax.set_xticks(np.arange(batch) * length - 0.5, minor=True)
  layers_ax.tick_params(axis="x", which="minor", length=4, color="0.4")
  positions, labels = _layer_ticks(layers)
  layers_ax.set_yticks(positions, labels, fontsize=6)
  if len(positions) < len(layers):
    layers_ax.set_yticks(range(len(layers)), minor=True)
  layers_ax.set(xlabel=f"token of the flattened batch (B x L = {batch} x {length})",
                title=f"max |dY| of each row, step {step}")
  batch_ax = fig.add_subplot(grid[1, 0])
  batch_ax.imshow(drawn[0].reshape(batch, length), **image_options)
  batch_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
  batch_ax.set(xlabel="position in the sequence", ylabel="sequence",
               title=f"{layers[0]}, as the [B, L] batch")
  colorbar = fig.colorbar(image, cax=fig.add_subplot(grid[:, 1]), extend="both",
                          extendfrac=0.03)
  colorbar.set_label("log10 max |dY| of the row (white: exactly zero; red: NaN or Inf)")
  fig.tight_layout()
  # A pixel per token at least (up to 300 dpi): downsampled, a lone active row ([CLS]) vanishes.
  fig.savefig(path, format="png", dpi=float(np.clip(batch * length / (0.8 * 11), 120, 300)))
