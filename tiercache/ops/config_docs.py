"""docs/configuration.md, generated from the configuration schema (tiercache/config.py).

`tiercache config docs > docs/configuration.md` (or `python -m tiercache.ops.config_docs`)
writes it; tests/test_config_docs.py fails when the committed file differs from what
this prints, so a setting added or reworded in the schema reaches the reference.
"""

from __future__ import annotations

import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel, BeforeValidator, SecretStr
from pydantic.fields import FieldInfo

from tiercache.config import TierCacheConfig, parse_byte_size

HEADER = """\
# Configuration reference

<!-- Generated from tiercache/config.py by `tiercache config docs`; do not edit by hand.
     tests/test_config_docs.py checks that this file is current. -->

Every setting of tiercache, from its schema. The same keys are read from vLLM's
`kv_connector_extra_config`, from a YAML file (`tiercache serve --config`, `tiercache
config check FILE`), and from environment variables, which win: a key's variable is
`TIERCACHE_` followed by its path in capitals with `__` between levels
(`cpu.capacity` is `TIERCACHE_CPU__CAPACITY`; values are read as YAML).

Sizes take bytes or a number with a unit (`512MiB`, `8GiB`, `8GB`). Durations are
seconds. An unknown key, or a value out of range, is refused with an error naming the
key. The settings most deployments set are in the
[README](../README.md#configuration).
"""


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _optional_inner(annotation: Any) -> tuple[Any, bool]:
    """(the type inside `X | None`, whether None was allowed)."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 1 and len(typing.get_args(annotation)) == 2:
            return members[0], True
    return annotation, False


def _is_byte_size(annotation: Any, metadata: list[Any]) -> bool:
    extra = list(metadata)
    if typing.get_origin(annotation) is typing.Annotated:
        extra += list(annotation.__metadata__)
    return any(isinstance(item, BeforeValidator) and item.func is parse_byte_size for item in extra)


def _type_name(field: FieldInfo) -> str:
    annotation, optional = _optional_inner(field.annotation)
    if _is_byte_size(annotation, field.metadata):
        name = "size"
    elif typing.get_origin(annotation) is typing.Annotated:
        name = _plain_type_name(typing.get_args(annotation)[0])
    else:
        name = _plain_type_name(annotation)
    return f"{name} or null" if optional else name


def _plain_type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    if annotation is SecretStr:
        return "string (secret)"
    if annotation is Path:
        return "path"
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _format_size(size: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and _is_byte_size(_optional_inner(field.annotation)[0], field.metadata):
        return f"`{_format_size(value)}`"
    if isinstance(value, Enum):
        value = value.value
    if value == "":
        return '`""`'
    return f"`{value}`"


def _bounds(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        if isinstance(item, Ge):
            parts.append(f"≥ {item.ge}")
        elif isinstance(item, Gt):
            parts.append(f"> {item.gt}")
        elif isinstance(item, Le):
            parts.append(f"≤ {item.le}")
        elif isinstance(item, Lt):
            parts.append(f"< {item.lt}")
        elif isinstance(item, MinLen) and item.min_length > 1:
            parts.append(f"at least {item.min_length} characters")
        elif isinstance(item, MaxLen):
            parts.append(f"at most {item.max_length} characters")
    return ", ".join(parts)


def _cell(text: str) -> str:
    """One table cell: on one line, its pipes escaped, and outside `code` its angle
    brackets too (Markdown would read `<hostname>` as an HTML tag)."""
    pieces = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(
        piece.replace("<", "\\<") if index % 2 == 0 else piece for index, piece in enumerate(pieces)
    )


def _section(title: str, path: str, model: type[BaseModel], about: str) -> list[str]:
    lines = [f"## {title}", ""]
    if about:
        text = _cell(about)
        lines += [text[0].upper() + text[1:] + ".", ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    nested: list[tuple[str, type[BaseModel], FieldInfo]] = []
    for name, field in model.model_fields.items():
        inner, _ = _optional_inner(field.annotation)
        if _is_model(inner):
            nested.append((name, inner, field))
            continue
        description = _cell(field.description or "")
        bounds = _bounds(field)
        if bounds:
            description = f"{description} ({bounds})" if description else bounds
        lines.append(f"| `{path}{name}` | {_type_name(field)} | {_default(field)} | {description} |")
    lines.append("")
    for name, inner, field in nested:
        lines += _section(f"`{path}{name}`", f"{path}{name}.", inner, field.description or "")
    return lines


def render_reference() -> str:
    """The text of docs/configuration.md for the schema as it is now."""
    lines = [HEADER]
    lines += _section("Top level", "", TierCacheConfig, "")
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    print(render_reference(), end="")


if __name__ == "__main__":
    main()
