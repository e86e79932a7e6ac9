"""What ``backend="auto"`` runs, layer by layer, from static shapes."""

import dataclasses

import pytest

from sebp_jax.cost_model import GPU_COST_MODEL, choose_counted, choose_implementation
from sebp_jax.selection import capacity_ladder

BERT_LAYER = dict(in_features=768, out_features=768, itemsize=2)


def test_nothing_to_skip_runs_dense_whatever_was_asked():
  for backend in ("auto", "xla", "pallas"):
    assert choose_implementation(backend, num_rows=4096, top_n=4096, index_given=False,
                                 platform="cpu", **BERT_LAYER) == "dense"
    assert choose_implementation(backend, num_rows=0, top_n=8, index_given=True,
                                 platform="gpu", **BERT_LAYER) == "dense"


def test_an_explicit_implementation_is_kept():
  for backend in ("xla", "pallas", "dense"):
    assert choose_implementation(backend, num_rows=4096, top_n=800, index_given=False,
                                 platform="gpu", **BERT_LAYER) == backend


def test_auto_off_gpu_is_xla():
  assert choose_implementation("auto", num_rows=4096, top_n=4000, index_given=False,
                               platform="cpu", **BERT_LAYER) == "xla"


@pytest.mark.parametrize("case,expected", [
    # A bert-base layer at T=4096 with a fifth or half kept: the gathers cost more than the
    # matmuls they save.
    (dict(num_rows=4096, top_n=820, index_given=False, **BERT_LAYER), "dense"),
    (dict(num_rows=4096, top_n=2048, index_given=False, **BERT_LAYER), "dense"),
    # The same layer with the index from the padding mask, 3% of the rows kept.
    (dict(num_rows=16384, top_n=430, index_given=True, **BERT_LAYER), "xla"),
    # Llama MLP layers: large enough that SEBP wins even with half the rows kept.
    (dict(num_rows=16384, in_features=2048, out_features=8192, top_n=3277, itemsize=2,
          index_given=False), "xla"),
    (dict(num_rows=4096, in_features=3072, out_features=8192, top_n=2048, itemsize=2,
          index_given=False), "xla"),
    (dict(num_rows=4096, in_features=3072, out_features=8192, top_n=2048, itemsize=2,
          index_given=True), "xla"),
    (dict(num_rows=4096, in_features=2048, out_features=2048, top_n=2048, itemsize=2,
          index_given=True), "xla"),
])
def test_auto_on_gpu_follows_the_cost_model(case, expected):
  assert choose_implementation("auto", platform="gpu", **case) == expected
  shapes = {k: v for k, v in case.items() if k != "top_n" and k != "index_given"}
  sparse = GPU_COST_MODEL.sparse_seconds(top_n=case["top_n"], index_given=case["index_given"],
                                         **shapes)
  assert (sparse * GPU_COST_MODEL.margin < GPU_COST_MODEL.dense_seconds(**shapes)) == (
      expected == "xla")


def test_the_model_is_monotone_in_the_kept_rows():
  """Fewer kept rows never predict a slower SEBP backward, and a given index never a slower
  one than scoring dY."""
  shapes = dict(num_rows=16384, in_features=2048, out_features=8192, itemsize=2)
  times = [GPU_COST_MODEL.sparse_seconds(top_n=k, index_given=False, **shapes)
           for k in (16, 256, 4096, 16384)]
  assert times == sorted(times)
  assert (GPU_COST_MODEL.sparse_seconds(top_n=256, index_given=True, **shapes)
          < GPU_COST_MODEL.sparse_seconds(top_n=256, index_given=False, **shapes))


LADDER_16K = (1024, 2048, 4096, 8192, 16384)  # top_n="auto" at T = 16,384


def test_counted_needs_a_choice_left_to_run_time():
  for backend in ("auto", "pallas"):
    assert choose_counted(backend, plan=(16384,), num_rows=16384, platform="gpu",
                          **BERT_LAYER) is None


def test_an_explicit_backend_runs_once_where_its_cost_follows_the_count():
  shapes = dict(plan=LADDER_16K, num_rows=16384, platform="cpu", **BERT_LAYER)
  assert choose_counted("pallas", **shapes) == "pallas"
  assert choose_counted("xla", **shapes) is None
  assert choose_counted("dense", **shapes) is None


@pytest.mark.parametrize("case,expected", [
    # BERT-base at 32x512 and Llama-1B at 4x1024: each layer's run-time branch costs more
    # than the kernels lose to XLA's matmuls.
    (dict(num_rows=16384, **BERT_LAYER), "pallas"),
    (dict(num_rows=16384, in_features=3072, out_features=768, itemsize=2), "pallas"),
    (dict(num_rows=4096, in_features=2048, out_features=8192, itemsize=2), "pallas"),
    # Llama's MLP at 16,384 rows: the matmuls dominate, and XLA's are faster.
    (dict(num_rows=16384, in_features=8192, out_features=3072, itemsize=2), None),
    # The kernels' rates are fitted to 16-bit operands.
    (dict(num_rows=16384, in_features=768, out_features=768, itemsize=4), None),
])
def test_auto_on_gpu_runs_once_where_the_cost_model_says(case, expected):
  plan = (*capacity_ladder(case["num_rows"]), case["num_rows"])
  assert choose_counted("auto", plan=plan, platform="gpu", **case) == expected
  assert choose_counted("auto", plan=plan, platform="cpu", **case) is None
  # Operands varying over a shard_map's manual axes: no pallas_call (it needs their types).
  assert choose_counted("auto", plan=plan, platform="gpu", varying=True, **case) is None


def test_the_counted_model_weighs_the_branch_against_the_kernels():
  """No branch cost and slow kernels: the branches win; a costly branch: one counted run."""
  shapes = dict(num_rows=16384, in_features=2048, out_features=2048, plan=LADDER_16K,
                itemsize=2)
  assert not dataclasses.replace(GPU_COST_MODEL, branch_fixed_s=0.0,
                                 counted_flops_per_s=1e14).counted_wins(**shapes)
  assert dataclasses.replace(GPU_COST_MODEL, branch_fixed_s=1e-2).counted_wins(**shapes)
  times = [GPU_COST_MODEL.counted_seconds(16384, 2048, 2048, count, 2)
           for count in (0, 16, 1024, 16384)]
  assert times == sorted(times)
