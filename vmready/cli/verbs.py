"""Levels of subcommands (``vmready COMMAND``, ``vmready config VERB``…): their parsers on
argparse, and the command that runs the verb a level's parser found."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from vmready.cli.client import Client
from vmready.cli.output import Output

VerbCommand = Callable[[Client, Output, argparse.Namespace], Awaitable[int]]


def by_verb(dest: str, verbs: Mapping[str, VerbCommand]) -> VerbCommand:
    """The command of a level of verbs: it runs the one ``args.<dest>`` names."""

    async def command(client: Client, output: Output, args: argparse.Namespace) -> int:
        return await verbs[getattr(args, dest)](client, output, args)

    return command


class Verbs:
    """One level of subcommands; each takes the options every command shares (``common``)."""

    def __init__(
        self,
        parser: argparse.ArgumentParser,
        dest: str,
        common: argparse.ArgumentParser,
        metavar: str = "VERB",
    ) -> None:
        self._subparsers = parser.add_subparsers(dest=dest, metavar=metavar, required=True)
        self.common = common

    def add(
        self,
        name: str,
        help: str,
        *parents: argparse.ArgumentParser,
        description: str | None = None,
        shared: bool = True,
        **options: Any,
    ) -> argparse.ArgumentParser:
        """A subcommand with the shared options (unless not ``shared``) and ``parents``'.

        ``help`` is also its description unless one is given; ``options`` go to
        argparse (``epilog``, ``usage``, ``formatter_class``).
        """
        parser: argparse.ArgumentParser = self._subparsers.add_parser(
            name,
            help=help,
            description=help if description is None else description,
            parents=[self.common, *parents] if shared else list(parents),
            **options,
        )
        return parser

    def group(self, name: str, help: str, description: str, dest: str, **options: Any) -> Verbs:
        """A subcommand that is a level of verbs itself (``snapshot VERB``); its verbs share."""
        parser = self.add(name, help, description=description, shared=False, **options)
        return Verbs(parser, dest, self.common)

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        """The subcommand ``name``, to add to it."""
        parser: argparse.ArgumentParser = self._subparsers.choices[name]
        return parser
