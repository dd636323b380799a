"""The generated parts of the reference pages (docs/reference/*.md), rendered from the code.

A page is hand-written prose around generated blocks, each between two markers:

    <!-- generated: serve-flags -->
    ...
    <!-- end generated -->

The block's name says what fills it (pages.py: BLOCKS): the `kmesh` command line's argparse
parsers (options.py), the pydantic models of the request and response objects, each field's
type, default, bounds and `description` (fields.py), or the Prometheus metrics of kmesh serve and
KMeshConnector (metrics.py). `python -m kmesh.reference_docs` rewrites every block of every
page; `--check` only names the pages that are out of date (exit status 1).
tests/reference_docs/test_pages.py fails on a committed page that differs from what this package
renders, so a flag, field or metric added without regenerating the pages fails the tests.

Why `python -m` and not a `kmesh docs` command: it writes the repository's docs folder, so it is
a tool for a checkout of KMesh, not for users of the installed package; as a command it would
also list itself among the user commands it documents (docs/reference/cli.md).
"""
