from click.testing import CliRunner

from pipeline.cli import cli


def test_help_lists_the_commands():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "mtplx run" in result.output
