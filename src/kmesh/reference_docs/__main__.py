"""`python -m kmesh.reference_docs [--check]`: regenerate docs/reference's tables."""

import argparse
import sys

from kmesh.reference_docs.pages import REGENERATE, render, stale_pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=REGENERATE, description="Regenerate the tables of docs/reference from the code."
    )
    parser.add_argument(
        "--check", action="store_true", help="only name the stale pages (exit status 1 if any)"
    )
    args = parser.parse_args(argv)
    stale = stale_pages()
    for page in stale:
        if args.check:
            print(f"{page}: out of date: run {REGENERATE}", file=sys.stderr)
        else:
            page.write_text(render(page.read_text()))
            print(f"regenerated {page}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
