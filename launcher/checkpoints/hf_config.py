"""Reading a Hugging Face config.json field by field: each value's type checked, and every
refusal one line naming the file, the field and its value (HFImportError).

A field may be nested: "rope_parameters.rope_theta" reads `rope_theta` inside
`rope_parameters`. null counts as absent, as transformers writes `"head_dim": null`.
"""

from __future__ import annotations

import math
from pathlib import Path

from loomtrain.launcher.checkpoints.safetensors_source import WeightSourceError


class HFImportError(WeightSourceError):
    pass


def refuse(where: Path, field: str, value, why: str):
    raise HFImportError(f"{where}: {field}={value!r}: {why}")


def off(value) -> bool:
    return value in (None, False, 0, "", [], {})


REQUIRED = object()


class Missing(KeyError):
    """A field the architecture needs is not in config.json."""


def get(c: dict, field: str, default):
    section, _, key = field.rpartition(".")
    value = ((c.get(section) or {}) if section else c).get(key)  # a section's type is checked first
    if value is None:
        if default is REQUIRED:
            raise Missing(field)
        return default
    return value


def int_field(c: dict, where: Path, field: str, default=REQUIRED) -> int | None:
    """A positive integer (a size or a count); a string, float or bool is refused by name."""
    value = get(c, field, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        refuse(where, field, value, "expected a positive integer")
    return value


def float_field(c: dict, where: Path, field: str, default: float) -> float:
    value = get(c, field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        refuse(where, field, value, "expected a finite number")
    return float(value)


def bool_field(c: dict, where: Path, field: str, default: bool) -> bool:
    value = get(c, field, default)
    if value not in (True, False):  # 0 and 1 pass too, as some hand-written configs have them
        refuse(where, field, value, "expected true or false")
    return bool(value)


def str_field(c: dict, where: Path, field: str, default: str) -> str:
    value = get(c, field, default)
    if not isinstance(value, str):
        refuse(where, field, value, "expected a string")
    return value


def str_list(c: dict, where: Path, field: str) -> list[str]:
    value = get(c, field, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        refuse(where, field, value, "expected a list of strings")
    return value


def dict_field(c: dict, where: Path, field: str) -> dict:
    value = get(c, field, {})
    if not isinstance(value, dict):
        refuse(where, field, value, "expected a JSON object")
    return value
