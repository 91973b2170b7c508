from click.testing import CliRunner

from pipeline.cli import cli


def test_help_lists_the_commands():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "mtplx run" in result.output


def test_overwrite_and_retry_errors_together_are_refused_in_one_line(tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "generate",
            "--input",
            str(tmp_path / "in.parquet"),
            "--output",
            str(tmp_path / "out"),
            "--overwrite",
            "--retry-errors",
        ],
    )
    assert result.exit_code == 2 and "--overwrite and --retry-errors" in result.output
    assert not (tmp_path / "out").exists()


def test_preloads_put_missing_openblas_and_jemalloc_first_and_keep_the_users(monkeypatch):
    from pipeline import preload

    monkeypatch.setattr(preload.sys, "platform", "linux")
    monkeypatch.setattr(preload, "uses_cuda", lambda: False)
    monkeypatch.setattr(preload.os.path, "exists", lambda p: p in (preload.OPENBLAS, preload.JEMALLOC))
    env = preload.with_preloads({"LD_PRELOAD": "/opt/mine.so"})
    assert env["LD_PRELOAD"] == f"{preload.OPENBLAS} {preload.JEMALLOC} /opt/mine.so"
    assert preload.with_preloads(env) == env  # nothing twice
    monkeypatch.setattr(preload.os.path, "exists", lambda p: p == preload.OPENBLAS)  # no jemalloc here
    assert preload.with_preloads({})["LD_PRELOAD"] == preload.OPENBLAS
    assert preload.missing_preloads(preload.OPENBLAS) == []
    monkeypatch.setattr(preload.os.path, "exists", lambda p: True)
    assert preload.missing_preloads("/opt/libtcmalloc_minimal.so.4") == [preload.OPENBLAS]  # the user's malloc stays


def test_preloads_set_the_openblas_thread_timeout_unless_the_user_did(monkeypatch):
    from pipeline import preload

    monkeypatch.setattr(preload.sys, "platform", "linux")
    monkeypatch.setattr(preload, "uses_cuda", lambda: False)
    assert preload.with_preloads({})["OPENBLAS_THREAD_TIMEOUT"] == "20"
    assert preload.with_preloads({"OPENBLAS_THREAD_TIMEOUT": "28"})["OPENBLAS_THREAD_TIMEOUT"] == "28"
    monkeypatch.setattr(preload.sys, "platform", "darwin")  # Accelerate, not OpenBLAS
    assert preload.with_preloads({}) == {}


def test_with_mlxs_cuda_backend_nothing_is_preloaded_or_set(monkeypatch):
    from pipeline import preload

    monkeypatch.setattr(preload.sys, "platform", "linux")
    monkeypatch.setattr(preload.os.path, "exists", lambda p: True)  # OpenBLAS and jemalloc are there
    assert preload.with_preloads({}, cuda=False)["LD_PRELOAD"]  # the premise: the CPU backend would take them
    assert preload.with_preloads({}, cuda=True) == {}
    assert preload.with_preloads({"LD_PRELOAD": "/opt/mine.so"}, cuda=True) == {"LD_PRELOAD": "/opt/mine.so"}
    monkeypatch.setattr(preload, "uses_cuda", lambda: True)
    assert preload.with_preloads({}) == {}
