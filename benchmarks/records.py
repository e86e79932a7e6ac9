"""Where the benchmarks put their measurements."""

from __future__ import annotations

import json


def append_json_lines(path: str | None, records) -> None:
  """Appends each record as one JSON line to ``path`` (nothing when ``path`` is None)."""
  if path:
    with open(path, "a") as f:
      f.writelines(json.dumps(record) + "\n" for record in records)
