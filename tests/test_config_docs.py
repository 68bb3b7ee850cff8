"""docs/configuration.md is what the generator prints from the schema now, and every
setting in the schema is described there."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel
from typer.testing import CliRunner

from tiercache.config import TierCacheConfig
from tiercache.ops.cli import app
from tiercache.ops.config_docs import render_reference

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
REGENERATE = "regenerate it: .venv/bin/python -m tiercache.ops.config_docs > docs/configuration.md"


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> dict[str, str | None]:
    """Every setting's dotted path and its description, nested sections walked."""
    leaves: dict[str, str | None] = {}
    for name, field in model.model_fields.items():
        sections = [
            arg
            for arg in (field.annotation, *getattr(field.annotation, "__args__", ()))
            if isinstance(arg, type) and issubclass(arg, BaseModel)
        ]
        if sections:
            leaves |= _leaf_fields(sections[0], f"{prefix}{name}.")
        else:
            leaves[f"{prefix}{name}"] = field.description
    return leaves


def test_committed_reference_is_current():
    assert REFERENCE.read_text() == render_reference(), f"docs/configuration.md is stale; {REGENERATE}"


def test_cli_prints_the_reference():
    result = CliRunner().invoke(app, ["config", "docs"])
    assert result.exit_code == 0, result.output
    assert result.stdout == render_reference()


def test_every_setting_has_a_description_and_a_row():
    reference = render_reference()
    leaves = _leaf_fields(TierCacheConfig)
    assert {"namespace", "cpu.capacity", "disk.path", "s3.bucket", "movers.cost_model"} <= leaves.keys()
    assert [path for path, description in leaves.items() if not description] == []
    rows = {line.split("`")[1] for line in reference.splitlines() if line.startswith("| `")}
    assert rows == leaves.keys()


def test_defaults_and_types_shown_as_a_user_writes_them():
    rows = {line.split("`")[1]: line for line in render_reference().splitlines() if line.startswith("| `")}
    assert "| size | `2GiB` |" in rows["cpu.capacity"]
    assert "| size | `16MiB` |" in rows["s3.pack_bytes"]
    assert "| path | required |" in rows["disk.path"]
    assert "| size or null | unset |" in rows["s3.capacity"]
    assert "`write_through` \\| `write_back`" in rows["movers.policy"]
    assert "(≥ 1, ≤ 256)" in rows["s3.max_concurrency"]
    assert "\\<hostname>" in rows["instance_id"]  # not read as an HTML tag
