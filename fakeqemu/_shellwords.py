"""GLib's ``g_shell_parse_argv``: how libslirp splits a ``guestfwd=…-cmd:COMMAND`` into argv.

libslirp runs the command without a shell: quotes and backslashes group and
escape as in a shell, ``#`` at the start of a word starts a comment, and
nothing is expanded.  This follows GLib's ``gshell.c`` (tokenize, then unquote
each token) and raises with GLib's messages.
"""

from __future__ import annotations


class ShellParseError(ValueError):
    """GLib refused the text; ``str(e)`` is its message."""


def parse_argv(command_line: str) -> list[str]:
    """Split ``command_line`` into words as ``g_shell_parse_argv`` does."""
    return [_unquote(token) for token in _tokenize(command_line)]


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    current: list[str] | None = None
    quote = ""
    escaped_quote = False  # an odd run of backslashes precedes this character
    i = 0
    while i < len(text):
        char = text[i]
        if quote == "\\":
            if char != "\n":
                current = [] if current is None else current
                current += ["\\", char]
            quote = ""
        elif quote == "#":
            while i < len(text) and text[i] != "\n":
                i += 1
            quote = ""
            if i >= len(text):
                break
            char = text[i]
        elif quote:
            if char == quote and not (quote == '"' and escaped_quote):
                quote = ""
            current = [] if current is None else current
            current.append(char)
        elif char in " \t\n":
            # A newline ends a command's word; blanks end a word, if one is under way.
            if char == "\n" or current:
                _delimit(current, tokens)
                current = None
        elif char in "'\"":
            current = [] if current is None else current
            current.append(char)
            quote = char
        elif char == "\\" or (char == "#" and (i == 0 or text[i - 1] in " \n")):
            quote = char
        else:
            current = [] if current is None else current
            current.append(char)
        escaped_quote = not escaped_quote if char == "\\" else False
        i += 1
    _delimit(current, tokens)
    if quote == "\\":
        raise ShellParseError(
            f"Text ended just after a \u201c\\\u201d character. (The text was \u201c{text}\u201d)"
        )
    if quote and quote != "#":
        raise ShellParseError(
            f"Text ended before matching quote was found for {quote}. "
            f"(The text was \u201c{text}\u201d)"
        )
    if not tokens:
        raise ShellParseError("Text was empty (or contained only whitespace)")
    return tokens


def _delimit(current: list[str] | None, tokens: list[str]) -> None:
    if current is not None:
        tokens.append("".join(current))


def _unquote(token: str) -> str:
    result: list[str] = []
    i = 0
    while i < len(token):
        char = token[i]
        if char == "\\":
            # Outside quotes a backslash escapes anything; backslash-newline vanishes.
            if i + 1 < len(token):
                if token[i + 1] != "\n":
                    result.append(token[i + 1])
                i += 2
            else:
                i += 1
        elif char == "'":
            end = token.index("'", i + 1)
            result.append(token[i + 1 : end])
            i = end + 1
        elif char == '"':
            i += 1
            while token[i] != '"':
                if token[i] == "\\" and token[i + 1 : i + 2] in ('"', "\\", "`", "$", "\n"):
                    result.append(token[i + 1])
                    i += 2
                else:
                    result.append(token[i])
                    i += 1
            i += 1
        else:
            result.append(char)
            i += 1
    return "".join(result)
