"""The Ray engine: the same job on a Ray cluster gives the local engine's rows,
every row exactly once, also when an actor dies mid-job or a job is rerun.

Tests marked `ray` start one local Ray instance (2 CPUs, no dashboard) for the
module and skip when Ray is not installed; the others run without Ray.
"""

import logging
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pyarrow.parquet as pq
import pytest
from conftest import REPO, cli_env, invoke, write_job, write_parquet

from pipeline.errors import JobError
from pipeline.spec import load_spec

ROWS = 48
N = 2  # samples per prompt: sampled rows show that keyed randomness ignores batching


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
    prompts = [" ".join(words[(i + j) % 8] for j in range(1 + i % 9)) + f" {i}" for i in range(ROWS)]
    prompts[7] = None  # an error row, written by an actor like any other
    return write_parquet(
        tmp_path_factory.mktemp("ray_in") / "in.parquet", id=[f"r{i}" for i in range(ROWS)], prompt=prompts
    )


def job_file(path, model, inp, out, engine="local"):
    return write_job(
        path,
        (
            f'name = "raytest"\nengine = "{engine}"\n'
            f'[model]\npath = "{model}"\ndepth = 2\n[input]\npath = "{inp}"\nid_column = "id"\n'
            f'[prompt]\ncolumn = "prompt"\n[sampling]\ntemperature = 0.9\ntop_p = 0.95\nseed = 5\n'
            f"[generation]\nmax_tokens = 10\nn = {N}\n[batch]\nmax_batch = 4\n"
            f'[ray]\nactors = 2\nshard_rows = 4\n[output]\npath = "{out}"\nflush_rows = 3\n'
        ),
    )


def rows_by_key(out):
    t = pq.read_table(sorted(out.glob("part-*.parquet")))
    rows = {}
    for r in t.to_pylist():
        key = (r["id"], r["sample_index"])
        assert key not in rows, f"row {key} appears more than once"
        rows[key] = r
    return rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, inputs):
    """The local engine's output for the job."""
    d = tmp_path_factory.mktemp("ray_ref")
    r = invoke("run", job_file(d / "job.toml", tiny_model, inputs, d / "out"), "--quiet")
    assert r.exit_code == 1, r.output  # the null prompt is a row error
    rows = rows_by_key(d / "out")
    assert len(rows) == ROWS * N
    return d / "out", rows


def assert_same_rows(out, reference_rows):
    rows = rows_by_key(out)
    assert rows.keys() == reference_rows.keys()
    differing = [k for k in rows if rows[k] != reference_rows[k]]
    print(f"{len(differing)} of {len(rows)} rows differ from the local engine's")
    assert not differing, differing[:3]


def summary_of(out):
    import json

    return json.loads((out / ".mtplx" / "summary.json").read_text())


# ----------------------------------------------------------- on a Ray cluster


@pytest.mark.ray
def test_ray_job_with_two_actors_writes_the_local_engines_rows_and_summary(
    tmp_path, tiny_model, inputs, reference, ray_cluster
):
    ref_out, ref_rows = reference
    out = tmp_path / "out"
    job = job_file(tmp_path / "job.toml", tiny_model, inputs, out)
    r = invoke("run", job, "--engine", "ray", "--actors", "2", "--quiet")
    assert r.exit_code == 1, r.output  # same exit code as locally: one null prompt, n error rows
    assert_same_rows(out, ref_rows)
    assert all(p.name.startswith("part-s") for p in out.glob("part-*.parquet"))
    assert pq.read_schema(next(out.glob("part-*.parquet"))) == pq.read_schema(next(ref_out.glob("part-*.parquet")))
    s, ref = summary_of(out), summary_of(ref_out)
    for k in (
        "rows",
        "errors",
        "finish_reasons",
        "prompt_tokens",
        "completion_tokens",
        "decode_steps",
        "acceptance_by_depth",
        "acceptance_rate",
        "mean_accepted_length",
        "spec_hash",
    ):
        assert s[k] == ref[k], k
    assert s["runtime"]["engine"] == "ray" and s["runtime"]["actors"] == 2
    assert len(s["runtime"]["per_actor"]) == 2
    assert s["runtime"]["shards"] == -(-(ROWS) // 4)
    assert s["runtime"]["stats"]["decode_tokens"] > 0 and s["rows_this_run"] == ROWS * N
    shown = invoke("inspect", out)
    assert shown.exit_code == 0 and f"{ROWS * N} rows" in shown.output
    from test_pipeline_readers import _ids  # every reader opens the shards' parts as it opens a local run's

    for reader, ids in _ids(out).items():
        assert len(ids) == ROWS * N and set(ids) == set(pq.read_table(ref_out).column("id").to_pylist()), reader


@pytest.mark.ray
def test_an_actor_killed_mid_job_still_gives_every_row_exactly_once(
    tmp_path, tiny_model, inputs, reference, ray_cluster
):
    from pipeline.runner import RunOptions, run_job

    ray = ray_cluster
    out = tmp_path / "out"
    spec = load_spec(job_file(tmp_path / "job.toml", tiny_model, inputs, out, engine="ray"))
    result = {}
    runner = threading.Thread(target=lambda: result.update(r=run_job(spec, RunOptions(quiet=True), log=print)))
    runner.start()
    deadline = time.monotonic() + 120
    while not list(out.glob("part-s*.parquet")) and runner.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    victims = [a for a in ray.util.list_named_actors() if a.startswith("mtplx-raytest-")]
    assert len(victims) == 2 and runner.is_alive(), "the job finished before an actor could be killed"
    ray.kill(ray.get_actor(victims[0]))
    runner.join(timeout=240)
    r = result["r"]
    assert r.exit_code == 1, r.warnings
    assert r.summary["runtime"]["actors_lost"] == 1
    assert r.summary["runtime"]["retried_shards"] >= 1
    assert r.summary["rows_this_run"] == ROWS * N
    assert_same_rows(out, reference[1])


@pytest.mark.ray
def test_rerun_on_ray_resumes_a_partly_written_local_output(tmp_path, tiny_model, inputs, reference, ray_cluster):
    """An interrupted job (here: the local engine's output with parts missing)
    rerun on Ray writes exactly the missing rows, beside the existing parts."""
    ref_out, ref_rows = reference
    out = tmp_path / "out"
    shutil.copytree(ref_out, out)
    (out / ".mtplx" / "summary.json").unlink()
    parts = sorted(out.glob("part-*.parquet"))
    missing = sum(pq.read_metadata(p).num_rows for p in parts[::2])
    for p in parts[::2]:
        p.unlink()
    job = job_file(tmp_path / "job.toml", tiny_model, inputs, out)
    r = invoke("run", job, "--engine", "ray", "--quiet")
    assert r.exit_code == 1, r.output
    assert summary_of(out)["rows_this_run"] == missing
    assert_same_rows(out, ref_rows)
    assert {p.name[:6] for p in out.glob("part-*.parquet")} == {"part-0", "part-s"}


# ----------------------------------------------------------- without a cluster


def test_a_retried_shard_writes_only_the_rows_its_first_attempt_did_not(tmp_path, tiny_model, inputs, reference):
    """ShardWorker without Ray: an attempt that died after writing some parts,
    retried, completes the shard with every row once (no Ray needed)."""
    from pipeline.outdir import open_output, output_lock, shard_part_files, start_output
    from pipeline.prompts import PromptEncoder
    from pipeline.ray_worker import ShardWorker
    from pipeline.reader import read_rows
    from pipeline.runner import RunOptions, prepare

    out = tmp_path / "out"
    with output_lock(out):  # as the driver holds it through a run
        job = prepare(load_spec(job_file(tmp_path / "job.toml", tiny_model, inputs, out, engine="ray")), RunOptions())
        state = open_output(out, job.plan, job.manifest, overwrite=False)
        start_output(state, job.manifest)
        worker = ShardWorker(job.ref, job.spec, job.plan, str(out))
        assert worker.ready()["error"] is None

        def shard_rows():
            rows = read_rows(job.source, job.plan, PromptEncoder(job.spec.prompt, worker.engine.tokenizer), state.done)
            return [r for r, _ in zip(rows, range(10))]

        first = worker.run_shard(3, shard_rows())
        parts = shard_part_files(out, 3)
        assert first.tally.rows == 10 * N and len(parts) > 2
        lost = pq.read_metadata(parts[-1]).num_rows
        parts[-1].unlink()  # the first attempt died before writing its last part...
        (out / ("." + parts[-1].name + ".tmp")).write_bytes(b"half a part")  # ...while writing it

        retry = worker.run_shard(3, shard_rows())
        assert retry.skipped == 10 * N - lost and retry.tally.rows == lost
        assert not list(out.glob(".*.tmp"))
        rows = rows_by_key(out)
        assert len(rows) == 10 * N
        assert all(rows[k] == reference[1][k] for k in rows)


def test_an_actor_that_does_not_see_the_output_directory_refuses_to_start(tmp_path, tiny_model, inputs):
    from pipeline.ray_worker import ShardWorker
    from pipeline.runner import RunOptions, prepare

    job = prepare(load_spec(job_file(tmp_path / "job.toml", tiny_model, inputs, tmp_path / "out")), RunOptions())
    worker = ShardWorker(job.ref, job.spec, job.plan, str(tmp_path / "not-shared"))  # no driver's lock there
    error = worker.ready()["error"]
    assert error.startswith(f"on node {worker.node}:") and "every node shares" in error
    with pytest.raises(JobError, match="mtplx.lock"):
        worker.run_shard(0, [])


def test_ray_engine_without_ray_installed_says_how_to_install_it(tmp_path, tiny_model, inputs, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    r = invoke("run", job_file(tmp_path / "job.toml", tiny_model, inputs, tmp_path / "out"), "--engine", "ray")
    assert r.exit_code == 2
    assert "pip install 'mtplx[ray]'" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_importing_the_pipeline_never_imports_ray():
    code = (
        "import sys, pipeline, pipeline.cli, pipeline.runner, pipeline.ray_engine, pipeline.ray_worker, "
        "pipeline.ray_dispatch; assert 'ray' not in sys.modules, 'ray was imported'"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr


def test_actors_go_one_per_mlx_machine_else_one_cpu_each_spread_over_nodes():
    from pipeline.ray_engine import place_actors

    by_mlx = place_actors({"CPU": 32.0, "mlx": 3.0}, nodes=4, wanted=None)
    assert by_mlx.actors == 3 and by_mlx.options["resources"] == {"mlx": 1}
    assert place_actors({"CPU": 32.0, "mlx": 3.0}, nodes=4, wanted=2).actors == 2
    with pytest.raises(JobError, match="advertises 3 'mlx'"):
        place_actors({"CPU": 32.0, "mlx": 3.0}, nodes=4, wanted=4)
    by_cpu = place_actors({"CPU": 8.0}, nodes=2, wanted=None)
    assert by_cpu.actors == 2 and by_cpu.options == {"num_cpus": 1, "scheduling_strategy": "SPREAD"}
    with pytest.raises(JobError, match="has 2 CPUs"):
        place_actors({"CPU": 2.0}, nodes=1, wanted=3)


def test_the_engine_is_scheduling_only_so_a_job_resumes_across_engines(tmp_path, tiny_model, inputs):
    from pipeline.runner import RunOptions, prepare

    local = load_spec(job_file(tmp_path / "a.toml", tiny_model, inputs, tmp_path / "out"))
    on_ray = load_spec(job_file(tmp_path / "b.toml", tiny_model, inputs, tmp_path / "out", engine="ray"))
    assert (local.engine, on_ray.engine) == ("local", "ray")
    assert on_ray.ray.actors == 2 and on_ray.ray.shard_rows == 4
    wider = replace(on_ray, ray=replace(on_ray.ray, actors=7, address="auto"))
    hashes = {prepare(s, RunOptions()).manifest["spec_hash"] for s in (local, on_ray, wider)}
    assert len(hashes) == 1


@pytest.mark.parametrize(
    "engine, ray, message",
    [
        ("spark", "actors = 2", "engine must be one of"),
        ("ray", "actors = 0", "[ray] actors must be an integer"),
        ("ray", "workers = 2", "unknown key 'workers' in [ray]"),
    ],
)
def test_bad_engine_settings_are_bad_jobs(tmp_path, tiny_model, inputs, engine, ray, message):
    text = job_file(tmp_path / "base.toml", tiny_model, inputs, tmp_path / "out", engine=engine).read_text()
    text = text.replace("[ray]\nactors = 2\n", f"[ray]\n{ray}\n")
    r = invoke("run", write_job(tmp_path / "job.toml", text), "--dry-run")
    assert r.exit_code == 2 and message in r.output, r.output


def test_address_without_the_ray_engine_is_a_bad_job(tmp_path, tiny_model, inputs):
    r = invoke("run", job_file(tmp_path / "job.toml", tiny_model, inputs, tmp_path / "out"), "--address", "auto")
    assert r.exit_code == 2 and "--engine ray" in r.output


def test_shards_are_long_but_every_actor_gets_work():
    from pipeline.ray_engine import MAX_SHARD_ROWS, shard_size

    assert shard_size(None, prompts=128, actors=2, max_batch=16) == 64  # one shard per actor, not one in all
    assert shard_size(None, prompts=10_000, actors=4, max_batch=16) == 625  # about 4 shards per actor
    assert shard_size(None, prompts=40, actors=2, max_batch=4) == 20
    assert shard_size(None, prompts=10**7, actors=8, max_batch=16) == MAX_SHARD_ROWS
    assert shard_size(7, prompts=10**7, actors=8, max_batch=16) == 7  # [ray] shard_rows wins


@pytest.mark.ray
def test_ray_actors_sample_at_one_auto_depth_which_a_resume_reuses(tmp_path, tiny_model, inputs, ray_cluster):
    import json

    out = tmp_path / "out"
    job = job_file(tmp_path / "job.toml", tiny_model, inputs, out)
    job.write_text(job.read_text().replace("depth = 2", 'depth = "auto"').replace("max_tokens = 10", "max_tokens = 3"))
    r = invoke("run", job, "--engine", "ray", "--actors", "2", "--quiet")
    assert r.exit_code == 1, r.output
    actors = summary_of(out)["runtime"]["per_actor"]
    depths = {a["sampled_depth"] for a in actors}
    assert len(actors) == 2 and len(depths) == 1  # the second actor took the first one's depth
    manifest = json.loads((out / ".mtplx" / "manifest.json").read_text())
    assert manifest["auto_sampled_depth"] == depths.pop()
    other = (manifest["auto_sampled_depth"] + 1) % 4  # a first run that chose another depth
    (out / ".mtplx" / "manifest.json").write_text(json.dumps({**manifest, "auto_sampled_depth": other}))
    for part in sorted(out.glob("part-*.parquet"))[1:]:
        part.unlink()
    r = invoke("run", job, "--engine", "ray", "--actors", "2", "--quiet")
    assert r.exit_code == 1, r.output
    assert {a["sampled_depth"] for a in summary_of(out)["runtime"]["per_actor"]} == {other}
    assert len(rows_by_key(out)) == ROWS * N


@pytest.mark.ray
def test_ray_actors_open_no_more_slots_than_the_job_has_samples_left(tmp_path, tiny_model, ray_cluster):
    inp = write_parquet(tmp_path / "in.parquet", id=["a", "b", "c"], prompt=["the cat", "a dog", "one"])
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "job.toml",
        (
            f'name = "few"\nengine = "ray"\n[model]\npath = "{tiny_model}"\n[input]\npath = "{inp}"\nid_column = "id"\n'
            f'[prompt]\ncolumn = "prompt"\n[generation]\nmax_tokens = 2\n[batch]\nmax_batch = 16\n'
            f'[ray]\nactors = 1\n[output]\npath = "{out}"\n'
        ),
    )
    r = invoke("run", job, "--quiet")
    assert r.exit_code == 0, r.output
    assert [a["max_batch"] for a in summary_of(out)["runtime"]["per_actor"]] == [3]
    assert pq.read_table(sorted(out.glob("part-*.parquet"))).num_rows == 3
