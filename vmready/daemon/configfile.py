"""The daemon's config file: any ``twistd vmready`` option by its long name, in YAML.

    # /etc/vmready/vmready.yaml
    data-dir: /var/lib/vmready
    hypervisor: qemu
    agent-poll-safety: 120

The file is ``--config FILE``, else ``$VMREADY_CONFIG``, else
``/etc/vmready/vmready.yaml`` when it exists (``--config ''``: no file).  An
option given on the command line wins over the file.  Values are checked as
the command line's are; what the file itself gets wrong (YAML that does not
parse, a key that is no option, a list where a value goes) is refused in one
line naming the file, the line and the key.  PyYAML is a dependency already
(the CLI's ``--format yaml``); a YAML file is what LXD and Incus operators know.
"""

from __future__ import annotations

import difflib
import getopt
import os
from collections.abc import Collection, Mapping

import attrs
import yaml
from twisted.python import usage

DEFAULT_PATH = "/etc/vmready/vmready.yaml"
CONFIG_VARIABLE = "VMREADY_CONFIG"
# Options that only make sense on the command line.
COMMAND_LINE_ONLY = frozenset({"config"})


class ConfigFileError(Exception):
    """What is wrong with the file, in one line that names it."""


@attrs.frozen
class Setting:
    """One option as the file sets it: a parameter's text, or a flag's truth."""

    value: str | bool
    line: int


def config_path(given: str | None, environ: Mapping[str, str]) -> str | None:
    """The file to read: ``--config``, ``$VMREADY_CONFIG``, the default if present; or none."""
    if given is not None:
        return given or None
    explicit = environ.get(CONFIG_VARIABLE)
    if explicit:
        return explicit
    return DEFAULT_PATH if os.path.exists(DEFAULT_PATH) else None


def read_settings(
    path: str, parameters: Collection[str], flags: Collection[str]
) -> dict[str, Setting]:
    """The options the file at ``path`` sets; ConfigFileError for anything wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigFileError(f"config file {path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"config file {path}: not UTF-8 text ({e.reason})") from None
    return parse_settings(text, path, parameters, flags)


def parse_settings(
    text: str, path: str, parameters: Collection[str], flags: Collection[str]
) -> dict[str, Setting]:
    """The options ``text`` (read from ``path``) sets, by long name."""
    loader: yaml.SafeLoader | None = None
    try:
        # Its reader refuses characters YAML does not allow (NUL…) at once.
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        if node is None:  # an empty file, or only comments
            return {}
        if not isinstance(node, yaml.MappingNode):
            raise _error(path, node, "expected a mapping of option names to values")
        settings: dict[str, Setting] = {}
        for key_node, value_node in node.value:
            key = _option_name(path, key_node, parameters, flags)
            if key in settings:
                first = settings[key].line
                raise _error(path, key_node, f"{key} is set twice (first on line {first})")
            _check_tags(path, key, value_node)
            try:
                value = loader.construct_object(value_node, deep=True)
            except (ValueError, OverflowError) as e:
                # A scalar its tag cannot be: 2001-13-45, ``!!float x``, a 5,000-digit integer.
                raise _error(path, value_node, f"{key}: not a value YAML can read ({e})") from None
            settings[key] = Setting(
                _value(path, key_node, key, value, is_flag=key in flags),
                key_node.start_mark.line + 1,
            )
        return settings
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(e.problem or e.context or "not YAML").split())
        raise ConfigFileError(f"config file {path}{where}: not valid YAML: {problem}") from None
    except yaml.YAMLError as e:
        problem = " ".join(str(e).split())
        raise ConfigFileError(f"config file {path}: not valid YAML: {problem}") from None
    except RecursionError:
        # PyYAML composes and constructs recursively: [[[[… past Python's stack.
        raise ConfigFileError(f"config file {path}: not valid YAML: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


# The tags an option's value may carry: YAML's plain kinds. Others (``!!timestamp``,
# ``!!binary``, ``!!set``…) are no option's value, and PyYAML's own constructors of
# some raise what they should not (``!!timestamp 2001-9``: an AttributeError).
_PLAIN_TAGS = frozenset(
    f"tag:yaml.org,2002:{kind}" for kind in ("str", "int", "float", "bool", "null", "seq", "map")
)


def _check_tags(path: str, key: str, node: yaml.Node) -> None:
    """ConfigFileError if ``node`` or anything in it is of a kind no option takes."""
    if node.tag not in _PLAIN_TAGS:
        kind = node.tag.removeprefix("tag:yaml.org,2002:")
        raise _error(path, node, f"{key}: a {kind} is not a value of any option")
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_tags(path, key, item)
    elif isinstance(node, yaml.MappingNode):
        for item_key, item_value in node.value:
            _check_tags(path, key, item_key)
            _check_tags(path, key, item_value)


def _option_name(
    path: str, node: yaml.Node, parameters: Collection[str], flags: Collection[str]
) -> str:
    """The option a key names, or ConfigFileError saying which ones there are."""
    if not isinstance(node, yaml.ScalarNode) or node.tag != "tag:yaml.org,2002:str":
        raise _error(path, node, "a key must be an option's long name")
    key = str(node.value)
    known = [*parameters, *flags]
    if key in COMMAND_LINE_ONLY:
        raise _error(path, node, f"{key} can be given on the command line only")
    if key not in known:
        guess = difflib.get_close_matches(key.lstrip("-").replace("_", "-"), known, n=1)
        hint = f" (did you mean {guess[0]}?)" if guess else ""
        raise _error(path, node, f"unknown key {key!r}{hint}")
    return key


def _value(path: str, node: yaml.Node, key: str, value: object, is_flag: bool) -> str | bool:
    """A value as the option takes it: a flag's true/false, a parameter's text."""
    if is_flag:
        if isinstance(value, bool):
            return value
        raise _error(path, node, f"{key} is a flag: true or false, not {_kind(value)}")
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise _error(path, node, f"{key} takes a string or a number, not {_kind(value)}")


def _kind(value: object) -> str:
    """How YAML's value reads to someone who wrote it."""
    if value is None:
        return "nothing (an empty value)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a YAML boolean; quote it for text)"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, str):
        return f"text {value!r}"
    return f"{type(value).__name__} {value!r}"


def _error(path: str, node: yaml.Node, problem: str) -> ConfigFileError:
    """ConfigFileError for ``node``'s line."""
    return ConfigFileError(f"config file {path}, line {node.start_mark.line + 1}: {problem}")


def file_problem(path: str, settings: Mapping[str, Setting], key: str, problem: str) -> str:
    """A check's complaint about a value the file set, pointed at its line."""
    return f"config file {path}, line {settings[key].line}: {key}: {problem}"


def option_names(options: usage.Options) -> tuple[list[str], list[str]]:
    """The long names of ``options``' parameters and of its flags."""
    parameters = [str(option[0]) for option in getattr(options, "optParameters", [])]
    flags = [str(option[0]) for option in getattr(options, "optFlags", [])]
    return parameters, flags


def given_on_command_line(options: usage.Options, arguments: list[str]) -> dict[str, str]:
    """The options ``arguments`` give, by long name (a flag's value: ''); the last one wins."""
    try:
        parsed, _rest = getopt.getopt(arguments, options.shortOpt, options.longOpt)
    except getopt.GetoptError as e:
        raise usage.UsageError(str(e)) from None
    given = {}
    for option, value in parsed:
        name = option.lstrip("-")
        synonyms = options.synonyms
        given[synonyms.get(name) or synonyms.get(name.replace("-", "_"), name)] = value
    return given


def as_arguments(settings: Mapping[str, Setting], given: Collection[str]) -> list[str]:
    """The file's settings as command-line arguments, less those the command line gives."""
    return [
        f"--{key}={setting.value}" if isinstance(setting.value, str) else f"--{key}"
        for key, setting in settings.items()
        if key not in given and setting.value is not False
    ]
