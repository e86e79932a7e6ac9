"""SST-2 / WikiText-2 readers of the carried data/, fixed-length encoding for both shipped
tokenizers, and batching."""

import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from examples.datasets import DATA_DIR, batches, encode_fixed_length, load_sst2, load_wikitext2
from examples.pretrained import load_minilm_tokenizer, load_smollm2_tokenizer

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def minilm_tokenizer():
  return load_minilm_tokenizer()


@pytest.fixture(scope="module")
def smollm2_tokenizer():
  return load_smollm2_tokenizer()


@pytest.mark.parametrize("split, expected_rows", [("train", 60_614), ("dev", 6_735)])
def test_sst2_counts_and_labels(split, expected_rows):
  examples = load_sst2(split)
  assert len(examples) == expected_rows
  labels = np.array([label for _, label in examples])
  assert set(labels.tolist()) == {0, 1}
  assert 0.4 < labels.mean() < 0.6
  assert all(sentence and sentence == sentence.strip() for sentence, _ in examples)


def test_sst2_limit_and_bad_split():
  assert load_sst2("dev", limit=5) == load_sst2("dev")[:5]
  with pytest.raises(ValueError, match="split"):
    load_sst2("test")


def test_wikitext2_paragraphs():
  paragraphs = load_wikitext2()
  assert len(paragraphs) > 1000
  assert paragraphs[0].startswith("Homarus gammarus , known as the European lobster")
  assert not any(p.startswith("=") or not p or p != p.strip() for p in paragraphs)


def test_default_data_dir_is_the_carried_data():
  assert DATA_DIR == REPOSITORY / "data"
  for name in ("sst2/train.tsv", "sst2/dev.tsv", "wikitext2/valid.txt"):
    assert (DATA_DIR / name).is_file(), name


def test_loaders_read_only_the_carried_data(tmp_path):
  """Run from a working directory outside the repository, the loaders open the three files of
  the repository's data/ and nothing else, no data folder beside the repository: an audit hook
  records every open()."""
  script = textwrap.dedent("""
      import json, os, sys
      from examples.datasets import load_sst2, load_wikitext2
      opened = []
      def record_open(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
          opened.append(os.fsdecode(args[0]))
      sys.addaudithook(record_open)
      counts = [len(load_sst2("train")), len(load_sst2("dev")), len(load_wikitext2())]
      print(json.dumps({"counts": counts, "opened": opened}))
  """)
  result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True,
                          capture_output=True, text=True, env={"PYTHONPATH": str(REPOSITORY)})
  report = json.loads(result.stdout)
  assert report["counts"] == [60_614, 6_735, 1_841]
  assert {pathlib.Path(path).resolve() for path in report["opened"]} == {
      DATA_DIR / "sst2" / "train.tsv", DATA_DIR / "sst2" / "dev.tsv",
      DATA_DIR / "wikitext2" / "valid.txt"}


def test_explicit_data_dir(tmp_path):
  (tmp_path / "sst2").mkdir()
  sst2_dev = 'sentence\tlabel\nit \'s "fine" \t1\nbad\t0\n'  # quotes are not CSV quoting
  (tmp_path / "sst2" / "dev.tsv").write_text(sst2_dev, encoding="utf-8")
  assert load_sst2("dev", data_dir=tmp_path) == [('it \'s "fine"', 1), ("bad", 0)]
  with pytest.raises(FileNotFoundError, match="valid.txt"):
    load_wikitext2(data_dir=tmp_path)


@pytest.mark.parametrize("tokenizer_name", ["minilm_tokenizer", "smollm2_tokenizer"])
def test_encode_fixed_length_pads_and_truncates(tokenizer_name, request):
  tokenizer = request.getfixturevalue(tokenizer_name)
  max_length = 12
  texts = [sentence for sentence, _ in load_sst2("dev", limit=64)]
  encoded = encode_fixed_length(tokenizer, texts, max_length)
  input_ids, attention_mask = encoded["input_ids"], encoded["attention_mask"]
  assert input_ids.shape == attention_mask.shape == (len(texts), max_length)
  assert input_ids.dtype == attention_mask.dtype == np.int32

  pad_id = tokenizer.pad_token_id
  lengths = attention_mask.sum(axis=1)
  for row, text in enumerate(texts):
    ids = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
    assert lengths[row] == len(ids)
    # The mask is a prefix of ones, the real ids sit under it, and pad ids fill the rest.
    np.testing.assert_array_equal(attention_mask[row], np.arange(max_length) < len(ids))
    np.testing.assert_array_equal(input_ids[row, :len(ids)], ids)
    assert np.all(input_ids[row, len(ids):] == pad_id)
  # The slice holds both padded rows and truncated ones.
  assert lengths.min() < max_length and lengths.max() == max_length


def test_encode_fixed_length_keeps_bert_special_tokens_when_truncating(minilm_tokenizer):
  encoded = encode_fixed_length(minilm_tokenizer, ["word " * 100, "short"], max_length=8)
  assert encoded["input_ids"][0, 0] == minilm_tokenizer.cls_token_id
  assert encoded["input_ids"][0, -1] == minilm_tokenizer.sep_token_id
  assert minilm_tokenizer.pad_token_id == 0 and encoded["input_ids"][1, -1] == 0


def test_smollm2_pad_is_eos(smollm2_tokenizer):
  # SmolLM2 has no dedicated pad token: padding reuses <|im_end|> and relies on attention_mask.
  assert smollm2_tokenizer.pad_token_id == smollm2_tokenizer.eos_token_id == 2


def test_batches_in_order_without_the_short_last_one():
  arrays = {"x": np.arange(10), "y": np.arange(10) * 2}
  epoch = list(batches(arrays, 4))
  assert [batch["x"].tolist() for batch in epoch] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  for batch in epoch:
    np.testing.assert_array_equal(batch["y"], batch["x"] * 2)


def test_batches_rejects_mismatched_lengths():
  with pytest.raises(ValueError, match="leading dimension"):
    batches({"x": np.arange(4), "y": np.arange(5)}, 2)
