"""Option tables of argparse parsers, and the list of commands."""

import argparse

from kmesh.reference_docs.options import cli_commands, cli_summary, grouped_options


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kmesh")
    commands = parser.add_subparsers()
    store = commands.add_parser("store", help="the store").add_subparsers()
    serve = store.add_parser("serve", help="serve the store")
    serve.add_argument("--socket", required=True, help="where")
    commands.add_parser("vllm", help="vLLM's command line")
    return parser


def test_options_are_grouped_under_their_titles():
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("engine")
    group.add_argument("--engine", choices=["a", "b"], required=True, help="which")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--quiet", action="store_true", help="less <output>")
    text = grouped_options(parser)
    assert "### Engine\n" in text
    assert "| `--engine` | `a` \\| `b` | required | which |" in text
    assert "| `--port` | integer | `8000` | — |" in text
    assert "| `--quiet` | — | off | less &lt;output> |" in text


def test_the_command_list_leaves_out_mere_groups():
    summary = cli_summary(_parser())
    assert "[`kmesh store serve`](#kmesh-store-serve) | serve the store |" in summary
    assert "`kmesh store`]" not in summary
    assert "[`kmesh vllm`](#kmesh-vllm)" in summary


def test_a_command_with_a_page_of_its_own_links_to_it():
    text = cli_commands(_parser(), {"kmesh store serve": "store.md"})
    assert "### kmesh store serve\n\nServe the store.\n\nIts options: [store.md](store.md)." in text
    assert "### kmesh vllm\n\nvLLM's command line.\n\nNo options." in text
