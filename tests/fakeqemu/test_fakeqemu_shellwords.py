"""Tests for fakeqemu._shellwords: a guestfwd command split as GLib's g_shell_parse_argv splits it.

The error texts are GLib's; the first two were measured through QEMU 7.2
(``Slirp: fork_exec invalid command``), the third follows ``gshell.c``.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from fakeqemu._shellwords import ShellParseError, parse_argv


class ParseArgvTests(SynchronousTestCase):
    """Words, quotes, escapes and comments, with no expansion."""

    def test_wordsAreSplitOnBlanks(self) -> None:
        self.assertEqual(
            parse_argv("socat -  UNIX-CONNECT:/run/api.sock\t"),
            ["socat", "-", "UNIX-CONNECT:/run/api.sock"],
        )

    def test_quotesGroupWords(self) -> None:
        self.assertEqual(
            parse_argv("sh -c 'echo out; echo err >&2'"), ["sh", "-c", "echo out; echo err >&2"]
        )

    def test_doubleQuotesUnescapeOnlyShellSpecials(self) -> None:
        self.assertEqual(parse_argv(r'echo "a\"b\\c\$d\e"'), ["echo", 'a"b\\c$d\\e'])

    def test_singleQuotesKeepBackslashes(self) -> None:
        self.assertEqual(parse_argv(r"echo 'a\b'"), ["echo", "a\\b"])

    def test_backslashEscapesABlankOutsideQuotes(self) -> None:
        self.assertEqual(parse_argv(r"cat /tmp/a\ b"), ["cat", "/tmp/a b"])

    def test_nothingIsExpanded(self) -> None:
        self.assertEqual(parse_argv("echo $HOME ~ *"), ["echo", "$HOME", "~", "*"])

    def test_hashStartsACommentOnlyAtAWordStart(self) -> None:
        self.assertEqual(
            [parse_argv("a #comment"), parse_argv("a#b"), parse_argv("#c\nx")],
            [["a"], ["a#b"], ["x"]],
        )

    def test_unmatchedQuote(self) -> None:
        error = self.assertRaises(ShellParseError, parse_argv, "sh -c 'echo x")
        self.assertEqual(
            str(error),
            "Text ended before matching quote was found for '. "
            "(The text was \u201csh -c 'echo x\u201d)",
        )

    def test_emptyCommand(self) -> None:
        error = self.assertRaises(ShellParseError, parse_argv, "  ")
        self.assertEqual(str(error), "Text was empty (or contained only whitespace)")

    def test_trailingBackslash(self) -> None:
        error = self.assertRaises(ShellParseError, parse_argv, "a \\")
        self.assertEqual(
            str(error),
            "Text ended just after a \u201c\\\u201d character. (The text was \u201ca \\\u201d)",
        )
