"""docs/reference matches the code it documents (kmesh/reference_docs.py renders its tables)."""

import argparse
import re
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from kmesh import reference_docs
from kmesh.reference_docs import (
    BLOCKS,
    REFERENCE_DIR,
    REGENERATE,
    field_table,
    grouped_options,
    render,
    stale_pages,
)

SRC = Path(reference_docs.__file__).parent
PAGES = sorted(REFERENCE_DIR.glob("*.md"))


def _page(name: str) -> str:
    return (REFERENCE_DIR / name).read_text()


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_committed_page_is_what_the_code_renders(page):
    text = page.read_text()
    assert render(text) == text, (
        f"docs/reference/{page.name} is out of date with the code: run `{REGENERATE}` and "
        "commit the result"
    )


def test_the_reference_pages_are_the_ones_other_pages_link_to():
    names = {p.name for p in PAGES}
    expected = {"request.md", "response.md", "serve.md", "connector.md", "metrics.md"}
    assert names >= expected | {"store-protocol.md", "cli.md"}


def test_every_block_fills_a_page():
    used = {m["name"] for p in PAGES for m in reference_docs._BLOCK.finditer(p.read_text())}
    assert used == set(BLOCKS)


def test_a_serve_flag_added_without_regenerating_makes_the_page_stale(monkeypatch, tmp_path):
    page = tmp_path / "serve.md"
    page.write_text(_page("serve.md"))
    serve = reference_docs._serve_parser()
    serve.add_argument("--brand-new", help="a flag nobody documented")
    monkeypatch.setattr(reference_docs, "_serve_parser", lambda: serve)
    assert stale_pages(tmp_path) == [page]
    assert "`--brand-new`" in render(page.read_text())


def test_an_unknown_block_is_an_error():
    with pytest.raises(ValueError, match="unknown generated block 'nope'"):
        render("<!-- generated: nope -->\n<!-- end generated -->\n")


def test_a_field_without_a_description_is_an_error():
    class Body(BaseModel):
        size: int = Field(default=1, ge=1)

    with pytest.raises(ValueError, match=r"Body\.size has no description"):
        field_table(Body, {})


def test_a_field_table_shows_type_bounds_default_and_description():
    class Body(BaseModel):
        name: str = Field(min_length=1, max_length=8, description="Its name.")
        share: float | None = Field(default=0.5, gt=0, le=1, description="A | share <x>.")

    rows = field_table(Body, {}).splitlines()
    assert rows[2] == "| `name` | string, 1 to 8 characters | required | Its name. |"
    assert rows[3] == "| `share` | number, in (0, 1] | `0.5` | A \\| share &lt;x>. |"


def test_options_are_grouped_under_their_titles():
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("Engine")
    group.add_argument("--engine", choices=["a", "b"], required=True, help="which")
    parser.add_argument("--port", type=int, default=8000)
    text = grouped_options(parser)
    assert "### Engine\n" in text
    assert "| `--engine` | `a` \\| `b` | required | which |" in text
    assert "| `--port` | integer | `8000` | — |" in text


def test_the_connector_page_lists_every_extra_config_key_the_code_reads():
    source = "".join(p.read_text() for p in (SRC / "vllm").glob("*.py"))
    read = set(re.findall(r'get_from_extra_config\(\s*"(\w+)"', source))
    read |= set(re.findall(r'extra_count\(\s*\w+,\s*"(\w+)"', source))
    section = _page("connector.md").split("## `kv_connector_extra_config`")[1].split("\n## ")[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert read == documented


def test_the_store_protocol_page_names_every_message():
    from kmesh.store.protocol import REQUEST_OPS, AnyAnswer

    answers = {t.__struct_config__.tag for t in AnyAnswer.__args__}
    named = set(re.findall(r"^\| `(\w+)` +\|", _page("store-protocol.md"), re.M))
    assert set(REQUEST_OPS) | answers <= named
