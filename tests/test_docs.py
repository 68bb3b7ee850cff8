"""The user docs stay true to the repository: every relative link and anchor in the
Markdown files resolves, and README's connector example and settings table name only
settings the schema has."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, get_args

from tiercache.config import TierCacheConfig, build_config

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MARKDOWN = [README, *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("benchmarks/**/*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped,
    spaces made hyphens, a repeated heading numbered from -1."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            repeat = seen.get(slug, 0)
            seen[slug] = repeat + 1
            anchors.add(slug if repeat == 0 else f"{slug}-{repeat}")
    return anchors


def test_heading_anchors_follow_github():
    text = "# A title\n## S3 runs (issue 18)\n```\n# not a heading\n```\n## `cpu`\n## A title\n"
    assert heading_anchors(text) == {"a-title", "s3-runs-issue-18", "cpu", "a-title-1"}


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in MARKDOWN:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_connector_example_is_a_valid_config():
    example = re.search(r"--kv-transfer-config '(\{.*?\})'", README.read_text(), re.S)
    assert example, "README.md has no --kv-transfer-config example"
    transfer = json.loads(example.group(1))
    assert transfer["kv_connector_module_path"] == "tiercache.connector"
    config = build_config(transfer["kv_connector_extra_config"], environ={})
    assert config.s3 is not None and config.s3.capacity is not None


def _is_setting(dotted: str) -> bool:
    """Whether `dotted` (such as `s3.capacity`) names a field of the schema."""
    model: Any = TierCacheConfig
    for part in dotted.split("."):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return False
        sections = [
            arg for arg in (field.annotation, *get_args(field.annotation)) if hasattr(arg, "model_fields")
        ]
        model = sections[0] if sections else None
    return True


def test_readme_settings_table_names_schema_fields():
    section = README.read_text().split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    first_cells = re.findall(r"^\| ([^|]+) \|", section, re.M)
    keys = [key for cell in first_cells for key in re.findall(r"`([\w.]+)`", cell)]
    assert "namespace" in keys and "integrity_key" in keys
    unknown = [key for key in keys if not _is_setting(key)]
    assert not unknown, f"README's settings table names settings the schema lacks: {unknown}"
