"""Where a verb's words go: stdout carries only what the verb was asked to print (a report, its
`--json` document); every status and progress line goes to stderr, so `headstart X --json | jq`
works whatever the cache state (a first run converts the model and salvages the data set)."""

from __future__ import annotations

import sys


def status(message: str) -> None:
    """One status line on stderr, flushed (progress bars write there too)."""
    print(message, file=sys.stderr, flush=True)
