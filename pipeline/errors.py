"""The one exception that means "bad job" (the CLI prints its message as a
single line and exits 2, with no traceback), and the CLI's exit codes."""


class JobError(Exception):
    """A job that cannot run as specified; the message names the problem."""


EXIT_OK = 0
EXIT_ROW_ERRORS = 1
EXIT_BAD_JOB = 2
# An unexpected failure (a bug, not the job): sysexits' EX_SOFTWARE, apart from the codes above.
EXIT_CRASH = 70
