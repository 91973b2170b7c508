"""Streaming: the pipeline's peak memory does not grow with the input.

Each run is a fresh process so that ru_maxrss is that run's own peak. The
fast test drives the pipeline with the fake engine (the reader, packer,
writer and resume set are what could grow); the slow one uses the real
runtime on the tiny checkpoint."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, cli_env

SCRIPT = textwrap.dedent("""
    import json, resource, sys
    sys.path.insert(0, {tests!r})
    from conftest import fake_engine_factory
    from pipeline.runner import RunOptions, run_job
    from pipeline.spec import spec_from_dict
    doc = {doc}
    factory = fake_engine_factory() if {fake} else None
    kwargs = {{"engine_factory": factory}} if factory else {{}}
    result = run_job(spec_from_dict(doc), RunOptions(quiet=True), log=lambda s: None, **kwargs)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({{"rss": rss, "rows": result.summary["rows"], "errors": result.summary["errors"]}}))
""")


def write_rows(path, n):
    """n prompts of 20-60 characters, in row groups of 16384 rows."""
    writer = None
    rng = np.random.default_rng(0)
    for start in range(0, n, 16384):
        m = min(16384, n - start)
        ids = pa.array([f"row-{i:08d}" for i in range(start, start + m)])
        lens = rng.integers(20, 60, m)
        prompts = pa.array(
            [("the cat sat on the mat " * 3)[:k] + str(i) for i, k in zip(range(start, start + m), lens)]
        )
        table = pa.table({"id": ids, "prompt": prompts})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return path


def peak_rss(tmp_path, rows: int, model, fake: bool, name: str) -> dict:
    inp = write_rows(tmp_path / f"{name}.parquet", rows)
    doc = {
        "model": {"path": str(model)},
        "input": {"path": str(inp), "id_column": "id"},
        "prompt": {"column": "prompt"},
        "generation": {"max_tokens": 1},
        "output": {"path": str(tmp_path / f"out-{name}"), "flush_rows": 2000},
    }
    script = SCRIPT.format(tests=str(REPO / "tests"), doc=repr(doc), fake=fake)
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=1800
    )
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["rows"] == rows and result["errors"] == 0
    return result


def test_pipeline_memory_stays_flat_from_20k_to_200k_rows(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    small = peak_rss(tmp_path, 20_000, model, True, "small")
    large = peak_rss(tmp_path, 200_000, model, True, "large")
    growth = large["rss"] - small["rss"]
    print(
        f"peak RSS: 20k rows {small['rss'] / 1e6:.0f} MB, 200k rows {large['rss'] / 1e6:.0f} MB, "
        f"growth {growth / 1e6:.1f} MB"
    )
    # What may grow: 8 bytes a row for the id check and resume keys (1.6 MB),
    # and allocator noise. Holding the rows as Python objects would add >100 MB.
    assert growth < 60e6
    assert large["rss"] < 1.5e9


@pytest.mark.slow
def test_real_runtime_memory_is_bounded_over_a_large_input(tmp_path, tiny_model):
    small = peak_rss(tmp_path, 2_000, tiny_model, False, "small")
    large = peak_rss(tmp_path, 30_000, tiny_model, False, "large")
    growth = large["rss"] - small["rss"]
    print(
        f"real runtime peak RSS: 2k rows {small['rss'] / 1e6:.0f} MB, 30k rows {large['rss'] / 1e6:.0f} MB, "
        f"growth {growth / 1e6:.1f} MB"
    )
    assert growth < 150e6
    assert large["rss"] < 2e9
