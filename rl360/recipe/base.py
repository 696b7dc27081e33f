"""The recipe's building blocks: the base of every section (unknown keys refused, keyword
only) and the bounded number types its fields use.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Niceness = Annotated[int, Meta(ge=-20, le=19)]  # Linux scheduling niceness
Prob = Annotated[float, Meta(gt=0.0, le=1.0)]
T = TypeVar("T", bound=msgspec.Struct)


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The base of every recipe section: unknown keys are refused, fields are keyword-only."""
