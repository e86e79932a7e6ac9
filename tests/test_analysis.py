"""The noise threshold ε: it separates a log-normal noise mass from the signal, whatever the
shares, and is 0.0 where there is no noise mass."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sebp_jax import row_scores
from sebp_jax.analysis import (_heatmap_values, dropped_share, estimate_threshold,
                               format_table, layer_table, plot_row_heatmap)


def _mixture(rng, noise_share, size=4000, noise_centre=-8.0, signal_centre=-3.0, spread=0.5):
  """(noise, signal): log-normal magnitudes, centres in log10, spread in decades."""
  num_noise = int(round(noise_share * size))
  noise = 10.0 ** rng.normal(noise_centre, spread, num_noise)
  signal = 10.0 ** rng.normal(signal_centre, spread, size - num_noise)
  signs = rng.choice([-1.0, 1.0], size)
  return noise * signs[:num_noise], signal * signs[num_noise:]


def _assert_separates(threshold, noise, signal):
  noise, signal = np.abs(noise), np.abs(signal)
  assert np.percentile(noise, 99) < threshold < np.percentile(signal, 1)


@pytest.mark.parametrize("noise_share", [0.1, 0.3, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("seed", [0, 1])
def test_separates_noise_from_signal(noise_share, seed):
  rng = np.random.default_rng(seed * 100 + int(noise_share * 10))
  noise, signal = _mixture(rng, noise_share)
  values = rng.permutation(np.concatenate([noise, signal]))
  _assert_separates(estimate_threshold(values), noise, signal)


@settings(max_examples=25, deadline=None)
@given(noise_share=st.floats(0.05, 0.95), gap=st.floats(4.5, 8.0),
       size=st.integers(2000, 6000), seed=st.integers(0, 2**32 - 1))
def test_separates_any_share_and_gap(noise_share, gap, size, seed):
  # Centres >= 4.5 decades (9 spreads) apart and >= 100 values a class. Closer, a few noise
  # outliers can sit nearer the signal than their own class: at 3 decades and a 10/90 share
  # the mixture's best boundary (where the weighted densities cross) is at the noise's ~99.4th
  # percentile, and the 99th percentile of 100 values is about their second largest.
  rng = np.random.default_rng(seed)
  noise, signal = _mixture(rng, noise_share, size, noise_centre=-4.0 - gap,
                           signal_centre=-4.0)
  _assert_separates(estimate_threshold(np.concatenate([signal, noise])), noise, signal)


@pytest.mark.parametrize("noise_share", [0.02, 0.98])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_separates_small_classes(noise_share, seed):
  rng = np.random.default_rng(seed + 30)
  noise, signal = _mixture(rng, noise_share, size=3000, noise_centre=-10.0)
  threshold = estimate_threshold(np.concatenate([noise, signal]))
  # Up to 0.1% of the noise mass may lie past the flat point: a few outliers of a large class.
  assert np.mean(np.abs(noise) > threshold) <= 0.002
  assert np.all(np.abs(signal) > threshold)


@pytest.mark.parametrize("noise_share", [0.1, 0.5, 0.9])
def test_separates_log_uniform_masses_with_zeros(noise_share):
  # Padding rows near zero (1e-9..1e-6, and exact zeros) against signal rows (1e-4..1e-1).
  rng = np.random.default_rng(int(noise_share * 10) + 20)
  num_noise = int(noise_share * 3000)
  noise = 10.0 ** rng.uniform(-9, -6, num_noise)
  signal = 10.0 ** rng.uniform(-4, -1, 3000 - num_noise)
  threshold = estimate_threshold(np.concatenate([noise, np.zeros(300), signal]))
  assert noise.max() < threshold < signal.min()


def test_exact_zeros_do_not_move_threshold():
  rng = np.random.default_rng(7)
  noise, signal = _mixture(rng, 0.4)
  values = np.concatenate([noise, signal])
  threshold = estimate_threshold(values)
  with_zeros = estimate_threshold(np.concatenate([values, np.zeros(3000)]))
  np.testing.assert_allclose(with_zeros, threshold, rtol=1e-6)
  _assert_separates(with_zeros, noise, signal)


def test_nan_and_inf_are_ignored():
  rng = np.random.default_rng(8)
  noise, signal = _mixture(rng, 0.6)
  values = np.concatenate([noise, signal])
  polluted = np.concatenate([values, [np.nan, np.inf, -np.inf]])
  assert estimate_threshold(polluted) == estimate_threshold(values)


@pytest.mark.parametrize("spread", [0.3, 1.0, 2.0])
def test_unimodal_signal_has_no_noise_floor(spread):
  rng = np.random.default_rng(int(spread * 10))
  values = 10.0 ** rng.normal(-3.0, spread, 4000)
  assert estimate_threshold(values) == 0.0
  assert estimate_threshold(10.0 ** rng.uniform(-6.0, -1.0, 4000)) == 0.0
  # Row maxima of dense gradient rows, and the same with zeros: one mass, nothing to cut.
  row_maxima = np.abs(rng.normal(0, 1e-3, (2000, 64))).max(axis=1)
  assert estimate_threshold(np.concatenate([row_maxima, np.zeros(500)])) == 0.0
  assert estimate_threshold(np.full(10, 0.5)) == 0.0


def test_scale_invariant():
  rng = np.random.default_rng(3)
  values = np.concatenate(_mixture(rng, 0.3))
  threshold = estimate_threshold(values)
  assert threshold > 0
  np.testing.assert_allclose(estimate_threshold(values * 1e3), threshold * 1e3, rtol=1e-6)


@pytest.mark.parametrize("values", [np.array([]), np.zeros((4, 3)), np.full(5, np.nan),
                                    np.array([0.0, np.inf, -np.inf])])
def test_values_without_positive_entries_have_no_noise_floor(values, tmp_path):
  assert estimate_threshold(values, plot=tmp_path / "cdf.png") == 0.0
  assert (tmp_path / "cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_complex_values_count_by_their_modulus():
  rng = np.random.default_rng(12)
  noise, signal = _mixture(rng, 0.4, size=3000)
  magnitudes = np.concatenate([noise, signal])
  phases = rng.uniform(0, 2 * np.pi, magnitudes.size)
  threshold = estimate_threshold(magnitudes * np.exp(1j * phases))
  assert threshold == pytest.approx(estimate_threshold(magnitudes), rel=1e-9)
  _assert_separates(threshold, noise, signal)


@pytest.mark.parametrize("bins", [3, 15, 200.0, True])
def test_rejects_bad_bins(bins):
  with pytest.raises(ValueError, match="bins"):
    estimate_threshold(np.ones(4), bins=bins)


def test_plot_writes_png(tmp_path):
  rng = np.random.default_rng(5)
  noise, signal = _mixture(rng, 0.5, size=2000)
  path = tmp_path / "cdf.png"
  threshold = estimate_threshold(np.concatenate([noise, signal, np.zeros(100)]), plot=path)
  assert threshold > 0
  data = path.read_bytes()
  assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
  unimodal = tmp_path / "unimodal.png"
  assert estimate_threshold(signal, plot=str(unimodal)) == 0.0
  assert unimodal.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_the_bins_the_estimate_used(tmp_path, monkeypatch):
  from matplotlib.figure import Figure
  drawn = []
  save = Figure.savefig

  def record_density(fig, *args, **kwargs):
    drawn.extend(len(line.get_xdata()) for ax in fig.axes for line in ax.get_lines()
                 if line.get_label() == "smoothed density")
    return save(fig, *args, **kwargs)

  monkeypatch.setattr(Figure, "savefig", record_density)
  rng = np.random.default_rng(6)
  noise, signal = _mixture(rng, 0.5, size=2000)
  values = np.concatenate([noise, signal])
  assert estimate_threshold(values, bins=48, plot=tmp_path / "a.png") == pytest.approx(
      estimate_threshold(values, bins=48))
  estimate_threshold(values, plot=tmp_path / "b.png")
  assert drawn == [48, 200]


def test_jax_input_and_shapes():
  rng = np.random.default_rng(11)
  noise, signal = _mixture(rng, 0.5, size=2048)
  values = np.concatenate([noise, signal]).astype(np.float32).reshape(64, 32)
  threshold = estimate_threshold(values)
  assert isinstance(threshold, float)
  assert estimate_threshold(jnp.asarray(values)) == threshold
  _assert_separates(threshold, noise, signal)


def test_import_does_not_import_matplotlib():
  import subprocess
  import sys
  code = "import sys, sebp_jax.analysis; assert 'matplotlib' not in sys.modules"
  subprocess.run([sys.executable, "-c", code], check=True)


def _random_records(rng, layers=("encoder/0/query", "encoder/0/value", "head"), steps=3,
                    rows=48):
  """RowLog-like records, steps interleaved across layers as a run logs them: rows of dY with
  a random share of exact zeros and magnitudes over decades."""
  records = []
  for step in range(steps):
    for layer in layers:
      row_max_abs = (10.0 ** rng.uniform(-9, -1, rows)).astype(np.float32)
      row_max_abs[rng.random(rows) < rng.uniform(0.1, 0.8)] = 0.0
      width = rng.integers(1, 64)
      row_squared_norm = (row_max_abs.astype(np.float64) ** 2
                          * rng.uniform(1, width, rows)).astype(np.float32)
      active = int(np.count_nonzero(row_max_abs))
      records.append({"layer": layer, "step": step, "rows": rows, "active": active,
                      "kept": active, "capacity": int(rng.choice([rows // 4, rows // 2, rows])),
                      "dropped_share": 0.0, "row_max_abs": row_max_abs,
                      "row_squared_norm": row_squared_norm})
  return records


def _reference_dropped_share(record, top_n, threshold):
  """Drops rows one by one: those at or below the threshold, then the smallest by norm while
  more than top_n remain."""
  norms = [float(n) for n in record["row_squared_norm"]]
  kept = [n for m, n in zip(record["row_max_abs"], norms) if float(m) > threshold]
  kept.sort(reverse=True)
  if top_n is not None:
    kept = kept[:top_n]
  total = sum(norms)
  return (total - sum(kept)) / total if total else 0.0


@pytest.mark.parametrize("top_n,threshold", [(None, None), (None, 1e-5), (5, None), (5, 1e-4),
                                             (1000, 1e-6)])
@pytest.mark.parametrize("seed", [0, 1])
def test_layer_table_matches_reference(top_n, threshold, seed):
  records = _random_records(np.random.default_rng(seed))
  table = layer_table(records, top_n=top_n, threshold=threshold)
  assert [row["layer"] for row in table] == ["encoder/0/query", "encoder/0/value", "head"]
  for row in table:
    mine = [r for r in records if r["layer"] == row["layer"]]
    active = [r["active"] for r in mine]
    above = [np.sum(r["row_max_abs"] > (threshold or 0.0)) for r in mine]
    shares = [_reference_dropped_share(r, top_n, threshold or 0.0) for r in mine]
    assert row["steps"] == 3 and row["rows"] == 48
    assert row["active_mean"] == pytest.approx(np.mean(active))
    assert row["active_max"] == max(active)
    assert row["row_sparsity"] == pytest.approx(1 - np.mean(active) / 48)
    assert row["capacity_max"] == max(r["capacity"] for r in mine)
    assert row["active_at_threshold_mean"] == pytest.approx(np.mean(above))
    assert row["dropped_share_mean"] == pytest.approx(np.mean(shares), rel=1e-9, abs=1e-12)
    assert row["dropped_share_max"] == pytest.approx(max(shares), rel=1e-9, abs=1e-12)
    assert 0 <= row["dropped_share_mean"] <= row["dropped_share_max"] <= 1


def test_layer_table_cap_and_threshold_drop_what_they_say():
  # Rows: norms 16, 9, 4, 1, 0 (max |dY| 4, 3, 2, 1, 0); total 30.
  record = {"layer": "dense", "step": 0, "rows": 5, "active": 4, "kept": 4, "capacity": 5,
            "dropped_share": 0.0, "row_max_abs": np.array([1, 4, 0, 3, 2], np.float32),
            "row_squared_norm": np.array([1, 16, 0, 9, 4], np.float32)}
  assert layer_table([record])[0]["dropped_share_mean"] == 0.0
  assert layer_table([record], top_n=2)[0]["dropped_share_mean"] == pytest.approx(5 / 30)
  assert layer_table([record], threshold=2.5)[0]["dropped_share_mean"] == pytest.approx(5 / 30)
  (row,) = layer_table([record], top_n=1, threshold=2.5)
  assert row["dropped_share_mean"] == pytest.approx(14 / 30)
  assert row["active_at_threshold_mean"] == 2 and row["active_mean"] == 4
  assert row["row_sparsity"] == pytest.approx(0.2)
  all_zero = dict(record, active=0, row_max_abs=np.zeros(5), row_squared_norm=np.zeros(5))
  assert layer_table([all_zero])[0]["dropped_share_max"] == 0.0


def test_layer_table_without_row_values_has_counts_only():
  records = [{"layer": "dense", "step": step, "rows": 8, "active": active, "kept": active,
              "capacity": 8, "dropped_share": 0.0, "row_max_abs": None,
              "row_squared_norm": None} for step, active in enumerate([2, 6])]
  (row,) = layer_table(records, top_n=4)
  assert row == {"layer": "dense", "steps": 2, "rows": 8, "active_mean": 4.0, "active_max": 6,
                 "row_sparsity": 0.5, "capacity_max": 8}


@pytest.mark.parametrize("kwargs,match", [({"top_n": 0}, "top_n"), ({"top_n": 2.5}, "top_n"),
                                          ({"threshold": -1.0}, "threshold"),
                                          ({"threshold": np.inf}, "threshold"),
                                          ({"threshold": np.nan}, "threshold"),
                                          ({"threshold": "0.5"}, "threshold")])
def test_layer_table_rejects_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    layer_table(_random_records(np.random.default_rng(0)), **kwargs)


@pytest.mark.parametrize("threshold", [np.nan, np.inf, -1.0, None, "0.5"])
def test_dropped_share_rejects_a_bad_threshold(threshold):
  with pytest.raises(ValueError, match="threshold"):
    dropped_share([1.0, 2.0], [1.0, 4.0], threshold=threshold)


def test_layer_table_counts_active_rows_as_the_selection_does():
  """NaN rows and rows at the float32 value next above the threshold are active in SEBP's
  selection; the table's count and dropped share follow the same rule."""
  rng = np.random.default_rng(5)
  threshold = 0.1
  dy = (rng.standard_normal((12, 6)) * rng.choice([0.0, 1e-3, 1.0], (12, 1))).astype(np.float32)
  dy[3] = 0.0
  dy[3, 2] = np.float32(threshold)  # 0.10000000149: above the threshold
  dy[5, 0] = np.nan
  _, active = row_scores(jnp.asarray(dy), threshold)
  row_max_abs = np.max(np.abs(dy), axis=1)
  squared = np.sum(np.square(dy.astype(np.float64)), axis=1)
  record = {"layer": "dense", "step": 0, "rows": 12, "active": int(np.sum(active)),
            "kept": int(np.sum(active)), "capacity": 12, "dropped_share": 0.0,
            "row_max_abs": row_max_abs, "row_squared_norm": squared}
  (row,) = layer_table([record], threshold=threshold)
  assert active[3] and active[5]
  assert row["active_at_threshold_mean"] == np.sum(active)
  finite = np.where(np.isnan(squared), 0.0, squared)
  expected = finite[~np.asarray(active)].sum() / finite.sum()
  assert dropped_share(row_max_abs, finite, threshold=threshold) == pytest.approx(expected)


def test_row_sparsity_is_the_share_of_all_rows_left_inactive():
  records = [{"layer": "dense", "step": step, "rows": rows, "active": active, "kept": active,
              "capacity": rows, "dropped_share": 0.0, "row_max_abs": None,
              "row_squared_norm": None} for step, (rows, active) in enumerate([(100, 50),
                                                                              (10, 10)])]
  (row,) = layer_table(records)
  assert row["row_sparsity"] == pytest.approx(1 - 60 / 110)
  assert row["rows"] == 100 and row["active_mean"] == 30


def test_format_table_aligns_columns():
  table = layer_table(_random_records(np.random.default_rng(2)), top_n=5)
  lines = format_table(table).splitlines()
  assert len(lines) == 2 + len(table)
  assert lines[0].split() == list(table[0])
  assert lines[2].startswith("encoder/0/query ") and lines[4].startswith("head ")
  # Right-aligned numbers: every column ends where its header does.
  for name in ("steps", "row_sparsity", "dropped_share_max"):
    end = lines[0].index(name) + len(name)
    assert all(line[end - 1] != " " and (len(line) == end or line[end] == " ")
               for line in lines[2:])


def test_plot_row_heatmap_writes_png(tmp_path):
  records = _random_records(np.random.default_rng(4), rows=4 * 12)
  path = tmp_path / "heatmap.png"
  plot_row_heatmap(records, path, batch_shape=(4, 12), step=1)
  data = path.read_bytes()
  assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
  plot_row_heatmap(records, tmp_path / "two.png", batch_shape=(4, 12),
                   layers=["head", "encoder/0/query"])
  assert (tmp_path / "two.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kwargs,match", [
    ({"batch_shape": (5, 12)}, "batch_shape"),
    ({"batch_shape": (4, 12), "step": 7}, "no record of step 7"),
    ({"batch_shape": (4, 12), "layers": ["missing"]}, "missing"),
    ({"batch_shape": (4, 12), "layers": []}, "layers is empty"),
])
def test_plot_row_heatmap_rejects_what_it_cannot_draw(tmp_path, kwargs, match):
  records = _random_records(np.random.default_rng(4), rows=4 * 12)
  with pytest.raises(ValueError, match=match):
    plot_row_heatmap(records, tmp_path / "heatmap.png", **kwargs)


def test_plot_row_heatmap_draws_the_token_layers_of_a_model_with_a_pooled_head(tmp_path):
  """BERT's pooler and classifier run on B rows, its encoder on B * L: by default the heat map
  draws the B * L layers; asked for a pooled layer, it names it."""
  rng = np.random.default_rng(8)
  records = (_random_records(rng, layers=("encoder/0/query", "encoder/0/value"), rows=4 * 12)
             + _random_records(rng, layers=("pooler",), rows=4))
  plot_row_heatmap(records, tmp_path / "heatmap.png", batch_shape=(4, 12))
  assert (tmp_path / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError, match=r"pooler \(4\)"):
    plot_row_heatmap(records, tmp_path / "all.png", batch_shape=(4, 12),
                     layers=["encoder/0/query", "pooler"])
  with pytest.raises(ValueError, match=r"no layer of step 0 has: they have \[4, 48\]"):
    plot_row_heatmap(records, tmp_path / "none.png", batch_shape=(2, 12))


def test_heatmap_draws_zeros_below_and_non_finite_rows_above_the_colour_scale():
  maxima = np.array([[1e-3, np.nan, 0.0, np.inf], [1e-1, 1e-2, -np.inf, 0.0]])
  drawn, low, high = _heatmap_values(maxima)
  assert (low, high) == pytest.approx((-3.0, -1.0))
  np.testing.assert_allclose(drawn[[0, 1, 1], [0, 0, 1]], [-3.0, -1.0, -2.0])
  assert np.all(drawn[[0, 1], [2, 3]] < low)
  assert np.all(drawn[[0, 0, 1], [1, 3, 2]] > high)
  drawn, low, high = _heatmap_values(np.array([[0.0, np.nan]]))
  assert drawn[0, 0] < low < high < drawn[0, 1]


def test_dropped_share_is_nan_where_dy_is_not_finite_as_in_the_row_log():
  for bad in (np.nan, np.inf):
    assert np.isnan(dropped_share([1.0, bad, 0.0], [1.0, bad, 0.0]))
  assert dropped_share([0.0, 0.0], [0.0, 0.0]) == 0.0
  assert dropped_share([1.0, 2.0], [1.0, 3.0], top_n=1) == 0.25
