"""An unexpected failure: one line for the terminal, the traceback in a file."""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Optional


def report_crash(error: BaseException, output: Optional[Path]) -> str:
    """The traceback written under the job's output directory (or to the returned
    text when there is none yet); returns the line to print."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    first = f"mtplx: internal error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if output is not None and Path(output).is_dir():
        from .outdir import META_DIR

        try:
            log = Path(output) / META_DIR / f"crash-{time.strftime('%Y%m%d-%H%M%S')}.log"
            log.parent.mkdir(exist_ok=True)
            log.write_text(text)
            return f"{first} (traceback in {log}; finished rows are kept, rerun to resume)"
        except OSError:
            pass
    return f"{first}\n{text.rstrip()}"
