"""'Did you mean': the command or verb nearest a mistyped one, the instance nearest an unknown."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable, Sequence
from urllib.parse import unquote

from vmready.cli.client import Client
from vmready.cli.errors import CommandError

# Global options that take a value (their value is not the command).
_VALUE_OPTIONS = ("--socket", "--format")
# argparse's words for a value that is none of the choices (a verb, a shell, a format).
_INVALID_CHOICE = re.compile(
    r"invalid choice: '(?P<word>[^']*)' (?P<hint>\(choose from (?P<choices>.*)\))$"
)


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like ``word`` (difflib), or None when none is close."""
    matches = difflib.get_close_matches(word, list(candidates), n=1)
    return matches[0] if matches else None


def command_names(parser: argparse.ArgumentParser) -> list[str]:
    """The commands of the ``vmready`` parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def command_index(argv: Sequence[str]) -> int | None:
    """Where the command word of ``argv`` is, after the options before it (None: nowhere)."""
    index = 0
    while index < len(argv):
        token = argv[index]
        if token in _VALUE_OPTIONS:
            index += 2
        elif token.startswith("-"):
            index += 1
        else:
            return index
    return None


def unknown_command(argv: Sequence[str], commands: Sequence[str]) -> str | None:
    """What to say when the command word of ``argv`` is no command; None when it is one."""
    index = command_index(argv)
    if index is None:
        return None
    word = argv[index]
    if word in commands:
        return None
    match = closest(word, [name for name in commands if not name.startswith("_")])
    hint = f"did you mean '{match}'?" if match else "see 'vmready --help'"
    return f"unknown command '{word}' ({hint})"


def with_choice_suggestion(message: str) -> str:
    """argparse's "invalid choice" ``message``, naming the nearest choice instead if one is near.

    ``cluster remov`` says ``invalid choice: 'remov' (did you mean 'remove'?)``;
    with none near, the message lists the choices, as argparse wrote it.
    """
    found = _INVALID_CHOICE.search(message)
    if found is None:
        return message
    choices = re.findall(r"'([^']*)'", found["choices"])
    match = closest(found["word"], choices)
    if match is None:
        return message
    return message[: found.start("hint")] + f"(did you mean '{match}'?)"


async def with_instance_suggestion(client: Client, name: str | None, message: str) -> str:
    """``message``, with the closest instance name when it says instance ``name`` is unknown.

    The names are fetched once, only then; if that fails, the message stays as it was.
    """
    if not name or f"Instance {name} not found" not in message:
        return message
    try:
        urls = await client.get("/1.0/instances")
    except CommandError:
        return message
    if not isinstance(urls, list):
        return message
    names = [unquote(str(url).rsplit("/", 1)[-1]) for url in urls]
    match = closest(name, [other for other in names if other != name])
    return f"{message} (did you mean '{match}'?)" if match else message
