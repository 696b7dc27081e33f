"""Subcommands for launching on clusters (`plan`, `submit`), registered into the CLI.

Each parser sets `func` (a handler taking the parsed args and returning an exit code) and
imports its heavy machinery only inside the handler, so `rl360 --help` stays fast."""

from __future__ import annotations

import argparse
from typing import Any


def add_parsers(sub: Any) -> None:
    _ = (sub, argparse)  # filled in by the launch work (issue 6)
