"""The one exception type of rl360.merge: bad input, reported as a single line."""

from __future__ import annotations


class MergeError(Exception):
    """A merge cannot proceed because of its input (recipe, checkpoints, shapes, dtypes).

    The message names the offending recipe key, tensor or file; `rl360 merge` prints it as
    one line and exits with status 2.
    """
