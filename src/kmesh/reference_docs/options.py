"""Argparse parsers -> markdown tables of their options, and the list of `kmesh` commands.

NOTE: argparse has no public way to list a parser's options or sub-commands; this module reads
its `_actions`, `_action_groups` and `_choices_actions`, stable since Python 3.2.
"""

import argparse
from collections.abc import Iterator

from kmesh.reference_docs.markdown import anchor, cell, sentence


def options_table(actions: list[argparse.Action]) -> str:
    """A markdown table of parser options: flag, value, default and help."""
    rows = ["| Option | Value | Default | Description |", "| --- | --- | --- | --- |"]
    for action in actions:
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.dest}`"
        rows.append(f"| {flags} | {_value(action)} | {_flag_default(action)} | {_help(action)} |")
    return "\n".join(rows) + "\n"


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "—"
    if action.choices is not None:
        return " \\| ".join(f"`{choice}`" for choice in action.choices)
    if action.metavar is not None:
        return f"`{action.metavar}`"
    kind = getattr(action.type, "__name__", "str")
    return {"int": "integer", "float": "number"}.get(kind, "text")


def _flag_default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0:
        return "off" if not action.default else "on"
    if action.default is None or action.default == argparse.SUPPRESS:
        return "—"
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion (%(default)s, %%)
        text = text % {**vars(action), "prog": ""}
    return cell(text) if text else "—"


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
    ]


def grouped_options(parser: argparse.ArgumentParser) -> str:
    """The parser's options as one table per argument group, each under its title (level 3)."""
    parts = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a in _options(parser)]
        if not actions:
            continue
        title = group.title or "Options"
        parts.append(f"### {title[0].upper()}{title[1:]}\n\n")
        if group.description:
            parts.append(f"{cell(group.description)}\n\n")
        parts.append(options_table(actions) + "\n")
    return "".join(parts).rstrip("\n") + "\n"


def commands(
    parser: argparse.ArgumentParser, prefix: str = "kmesh"
) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(command line, one-line purpose, parser) of every sub-command, depth first."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        purposes = {a.dest: a.help or "" for a in action._choices_actions}
        for name, sub in action.choices.items():
            line = f"{prefix} {name}"
            yield line, purposes.get(name, ""), sub
            yield from commands(sub, line)


def cli_summary(parser: argparse.ArgumentParser) -> str:
    """A table of every command that runs something (not a mere group), with its purpose."""
    rows = ["| Command | Purpose |", "| --- | --- |"]
    for line, purpose, sub in commands(parser):
        if not _groups_only(sub):
            rows.append(f"| [`{line}`](#{anchor(line)}) | {cell(purpose)} |")
    return "\n".join(rows) + "\n"


def cli_commands(parser: argparse.ArgumentParser, pages: dict[str, str]) -> str:
    """Every command that runs something: a level-3 heading, its purpose, and its options
    (`pages`: commands whose options have a page of their own, linked instead)."""
    parts = []
    for line, purpose, sub in commands(parser):
        if _groups_only(sub):
            continue
        parts.append(f"### {line}\n\n{cell(sentence(purpose))}\n\n")
        if line in pages:
            parts.append(f"Its options: [{pages[line]}]({pages[line]}).\n\n")
        elif _options(sub):
            parts.append(options_table(_options(sub)) + "\n")
        else:
            parts.append("No options.\n\n")
    return "".join(parts).rstrip("\n") + "\n"


def _groups_only(parser: argparse.ArgumentParser) -> bool:
    """A command group: sub-commands and no options of its own."""
    has_subcommands = any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
    return has_subcommands and not _options(parser)
