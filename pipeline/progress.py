"""The progress bar: rows done, completion tokens per second, the running
acceptance rate and the share of prompt tokens taken from a shared prefix;
silent under --quiet."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, quiet: bool, initial_note: str = ""):
        self.start = time.monotonic()
        self.rows = 0
        self.errors = 0
        self.tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.prompt_tokens = 0
        self.shared_prefix_tokens = 0
        self._last_postfix = 0.0
        self.bar = tqdm(
            total=total,
            unit="row",
            disable=quiet,
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5,
            smoothing=0.05,
            desc=initial_note or None,
        )

    def row(
        self, tokens: int, drafted: int, accepted: int, error: bool, prompt_tokens: int = 0, shared: int = 0
    ) -> None:
        self.rows += 1
        self.prompt_tokens += prompt_tokens
        self.shared_prefix_tokens += shared
        self.errors += int(error)
        self.tokens += tokens
        self.drafted += drafted
        self.accepted += accepted
        self.bar.update(1)
        now = time.monotonic()
        if now - self._last_postfix >= 0.5:
            self._last_postfix = now
            self.bar.set_postfix_str(self.postfix(now), refresh=False)

    def postfix(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        acc = f"{self.accepted / self.drafted:.2f}" if self.drafted else "-"
        out = f"{self.tokens / elapsed:.0f} tok/s, acc {acc}, errors {self.errors}"
        if self.shared_prefix_tokens:
            out += f", shared prefix {self.shared_prefix_tokens / max(self.prompt_tokens, 1):.0%}"
        return out

    def close(self) -> None:
        # The postfix is refreshed at most twice a second: the bar's last
        # line would otherwise show the counts of up to half a second ago.
        if self.rows:
            self.bar.set_postfix_str(self.postfix(time.monotonic()), refresh=False)
        self.bar.close()
