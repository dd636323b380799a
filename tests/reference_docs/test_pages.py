"""docs/reference matches the code it documents (kmesh/reference_docs renders its tables)."""

import re
from pathlib import Path

import pytest

import kmesh
from kmesh.reference_docs import pages
from kmesh.reference_docs.__main__ import main
from kmesh.reference_docs.pages import BLOCKS, REFERENCE_DIR, REGENERATE, render, stale_pages

SRC = kmesh.__path__[0]
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


def test_the_pages_are_the_ones_other_pages_link_to():
    expected = {"request.md", "response.md", "serve.md", "connector.md", "metrics.md"}
    assert {p.name for p in PAGES} >= expected | {"store-protocol.md", "cli.md"}


def test_every_block_fills_a_page():
    used = {m["name"] for p in PAGES for m in pages.BLOCK.finditer(p.read_text())}
    assert used == set(BLOCKS)


def test_a_serve_flag_added_without_regenerating_makes_the_page_stale(monkeypatch, tmp_path):
    page = tmp_path / "serve.md"
    page.write_text(_page("serve.md"))
    serve = pages._serve_parser()
    serve.add_argument("--brand-new", help="a flag nobody documented")
    monkeypatch.setattr(pages, "_serve_parser", lambda: serve)
    assert stale_pages(tmp_path) == [page]
    assert "`--brand-new`" in render(page.read_text())


def test_check_names_nothing_when_the_pages_are_current(capsys):
    assert main(["--check"]) == 0
    assert capsys.readouterr().err == ""


def test_an_unknown_block_is_an_error():
    with pytest.raises(ValueError, match="unknown generated block 'nope'"):
        render("<!-- generated: nope -->\n<!-- end generated -->\n")


def test_the_connector_page_lists_every_extra_config_key_the_code_reads():
    source = "".join(p.read_text() for p in (Path(SRC) / "vllm").glob("*.py"))
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
