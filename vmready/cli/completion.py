"""``vmready completion bash|zsh|fish``: shell completion generated from the real parser.

The commands, their verbs, options, option values and arguments are read
from the argparse parser, so the scripts follow the CLI as it changes.
Instance names are completed when the shell asks, by running
``vmready list --format csv -c n`` (with the ``--socket`` of the command
line, if any).
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator

import attrs

from vmready.cli.waiter import AGENT_CONDITION, WAIT_STATUSES

SHELLS = ("bash", "zsh", "fish")

# What a positional argument completes to: the instance names, a file, or a fixed list.
INSTANCE = "instance"
FILE = "file"
NOTHING = "-"
_CONDITIONS = (AGENT_CONDITION, *(f"status={status}" for status in WAIT_STATUSES))


@attrs.frozen
class CommandSpec:
    """One command (or a command's verb) as completion sees it.

    ``path``: the words that name it, the root being ``("vmready",)``;
    ``values``: each option that takes a value, with its choices (empty: any);
    ``files``: the options whose value is a path;
    ``arguments``: each positional argument's completion: INSTANCE, FILE,
    NOTHING, or its words.
    """

    path: tuple[str, ...]
    help: str
    options: tuple[str, ...]
    values: dict[str, tuple[str, ...]]
    files: tuple[str, ...]
    arguments: tuple[str | tuple[str, ...], ...]
    verbs: tuple[tuple[str, str], ...]

    @property
    def key(self) -> str:
        """The words that name it, as one string (``vmready snapshot create``)."""
        return " ".join(self.path)


def _argument(action: argparse.Action) -> str | tuple[str, ...]:
    if action.choices is not None:
        return tuple(str(choice) for choice in action.choices)
    if action.dest == "name":
        return INSTANCE
    if action.dest == "file":
        return FILE
    if action.dest == "condition":
        return _CONDITIONS
    return NOTHING


def command_specs(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("vmready",), help: str = ""
) -> Iterator[CommandSpec]:
    """Every command of ``parser``, the root first, each before its verbs."""
    options: list[str] = []
    values: dict[str, tuple[str, ...]] = {}
    files: list[str] = []
    arguments: list[str | tuple[str, ...]] = []
    verbs: list[tuple[str, str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if not name.startswith("_"):
                    verbs.append((name, helps.get(name, ""), sub))
        elif action.option_strings:
            if action.help == argparse.SUPPRESS:
                continue
            options.extend(action.option_strings)
            if action.nargs != 0:
                choices = tuple(str(c) for c in action.choices) if action.choices else ()
                for option in action.option_strings:
                    values[option] = choices
                if action.metavar == "PATH" or action.dest == "socket":
                    files.extend(action.option_strings)
        elif path[-1] == "launch":
            arguments.append(NOTHING)  # a new name
        else:
            arguments.append(_argument(action))
    yield CommandSpec(
        path,
        help,
        tuple(options),
        values,
        tuple(files),
        tuple(arguments),
        tuple((name, text) for name, text, _ in verbs),
    )
    for name, text, sub in verbs:
        yield from command_specs(sub, (*path, name), text)


_BASH_FUNCTION = r"""
_vmready_instances() {
    command vmready ${1:+--socket "$1"} list --format csv -c n 2>/dev/null | tail -n +2
}

_vmready() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
    local key=vmready socket="" npos=0 skip=0 i w
    for ((i = 1; i < COMP_CWORD; i++)); do
        w=${COMP_WORDS[i]}
        if ((skip)); then
            skip=0
            continue
        fi
        case $w in
        --socket) socket=${COMP_WORDS[i+1]} ;;
        =)
            # COMP_WORDBREAKS split "status=ready": the parts are one argument.
            skip=1
            continue
            ;;
        esac
        if [[ $w == -* ]]; then
            [[ " ${_vmready_values[$key]} " == *" $w "* ]] && skip=1
            continue
        fi
        if [[ -n ${_vmready_verbs[$key]} && " ${_vmready_verbs[$key]} " == *" $w "* ]]; then
            key="$key $w"
        else
            ((npos++))
        fi
    done
    COMPREPLY=()
    local -a kinds=(${_vmready_arguments[$key]})
    if [[ $cur == = || $prev == = ]]; then
        # After "word=" (split by COMP_WORDBREAKS): complete what follows the "=".
        local before=${COMP_WORDS[COMP_CWORD-1]} word
        if [[ $cur == = ]]; then
            cur=""
        else
            before=${COMP_WORDS[COMP_CWORD-2]}
        fi
        for word in ${kinds[npos-1]//,/ }; do
            [[ $word == "$before="* ]] && COMPREPLY+=($(compgen -W "${word#"$before="}" -- "$cur"))
        done
        return 0
    fi
    if [[ $prev == -* && " ${_vmready_values[$key]} " == *" $prev "* ]]; then
        if [[ -n ${_vmready_choices["$key $prev"]} ]]; then
            COMPREPLY=($(compgen -W "${_vmready_choices["$key $prev"]}" -- "$cur"))
        elif [[ " ${_vmready_files[$key]} " == *" $prev "* ]]; then
            COMPREPLY=($(compgen -f -- "$cur"))
        fi
        return 0
    fi
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "${_vmready_options[$key]}" -- "$cur"))
        return 0
    fi
    if [[ -n ${_vmready_verbs[$key]} && $npos -eq 0 ]]; then
        COMPREPLY=($(compgen -W "${_vmready_verbs[$key]}" -- "$cur"))
        return 0
    fi
    case ${kinds[npos]} in
    instance) COMPREPLY=($(compgen -W "$(_vmready_instances "$socket")" -- "$cur")) ;;
    file) COMPREPLY=($(compgen -f -- "$cur")) ;;
    -|"") ;;
    *) COMPREPLY=($(compgen -W "${kinds[npos]//,/ }" -- "$cur")) ;;
    esac
    return 0
}

complete -F _vmready vmready
"""


def _tables(specs: list[CommandSpec]) -> dict[str, dict[str, str]]:
    """The completion tables, by the words naming a command (``vmready stop``)."""
    tables: dict[str, dict[str, str]] = {
        name: {} for name in ("options", "values", "choices", "files", "verbs", "arguments")
    }
    for spec in specs:
        key = spec.key
        tables["options"][key] = " ".join(spec.options)
        tables["values"][key] = " ".join(spec.values)
        for option, choices in spec.values.items():
            if choices:
                tables["choices"][f"{key} {option}"] = " ".join(choices)
        if spec.files:
            tables["files"][key] = " ".join(spec.files)
        if spec.verbs:
            tables["verbs"][key] = " ".join(name for name, _ in spec.verbs)
        kinds = [",".join(kind) if isinstance(kind, tuple) else kind for kind in spec.arguments]
        if kinds:
            tables["arguments"][key] = " ".join(kinds)
    return tables


def _shell_tables(specs: list[CommandSpec], declare: str) -> str:
    """The tables as associative arrays, ``_vmready_options`` …, each set by its pairs."""
    lines = []
    for name, table in _tables(specs).items():
        pairs = " ".join(f"{shlex.quote(k)} {shlex.quote(v)}" for k, v in table.items())
        lines.append(f"{declare} _vmready_{name}")
        lines.append(f"_vmready_{name}=({pairs})")
    return "\n".join(lines) + "\n"


def bash_script(parser: argparse.ArgumentParser) -> str:
    """Bash completion: ``source <(vmready completion bash)``."""
    header = "# bash completion for vmready; generated by: vmready completion bash\n"
    return header + _shell_tables(list(command_specs(parser)), "declare -gA") + _BASH_FUNCTION


_ZSH_FUNCTION = r"""
_vmready_instances() {
    local -a socket
    [[ -n $1 ]] && socket=(--socket "$1")
    command vmready $socket list --format csv -c n 2>/dev/null | tail -n +2
}

_vmready() {
    emulate -L zsh
    local cur=${words[CURRENT]} prev=${words[CURRENT-1]}
    local key=vmready socket="" w
    integer npos=0 skip=0 i
    for ((i = 2; i < CURRENT; i++)); do
        w=${words[i]}
        if ((skip)); then
            skip=0
            continue
        fi
        [[ $w == --socket ]] && socket=${words[i+1]}
        if [[ $w == -* ]]; then
            [[ " ${_vmready_values[$key]} " == *" $w "* ]] && skip=1
            continue
        fi
        if [[ -n ${_vmready_verbs[$key]} && " ${_vmready_verbs[$key]} " == *" $w "* ]]; then
            key="$key $w"
        else
            ((npos++))
        fi
    done
    if [[ $prev == -* && " ${_vmready_values[$key]} " == *" $prev "* ]]; then
        if [[ -n ${_vmready_choices[$key $prev]} ]]; then
            compadd -- ${=_vmready_choices[$key $prev]}
        elif [[ " ${_vmready_files[$key]} " == *" $prev "* ]]; then
            _files
        fi
        return
    fi
    if [[ $cur == -* ]]; then
        compadd -- ${=_vmready_options[$key]}
        return
    fi
    if [[ -n ${_vmready_verbs[$key]} ]] && ((npos == 0)); then
        compadd -- ${=_vmready_verbs[$key]}
        return
    fi
    local -a kinds
    kinds=(${=_vmready_arguments[$key]})
    local kind=${kinds[npos+1]}
    case $kind in
    instance) compadd -- ${(f)"$(_vmready_instances "$socket")"} ;;
    file) _files ;;
    -|"") ;;
    *) compadd -- ${(s:,:)kind} ;;
    esac
}

compdef _vmready vmready
"""


def zsh_script(parser: argparse.ArgumentParser) -> str:
    """Zsh completion: ``source <(vmready completion zsh)`` (after ``compinit``)."""
    header = "#compdef vmready\n# zsh completion for vmready, from: vmready completion zsh\n"
    tables = _shell_tables(list(command_specs(parser)), "typeset -gA")
    return header + tables + _ZSH_FUNCTION


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def fish_script(parser: argparse.ArgumentParser) -> str:
    """Fish completion: ``vmready completion fish | source``."""
    specs = list(command_specs(parser))
    root = specs[0]
    commands = [name for name, _ in root.verbs]
    lines = [
        "# fish completion for vmready; generated by: vmready completion fish",
        "function __vmready_instances",
        "    set -l socket",
        "    set -l words (commandline -opc)",
        "    set -l at (contains -i -- --socket $words)",
        "    and set socket --socket $words[(math $at + 1)]",
        "    type -q vmready; or return",
        "    command vmready $socket list --format csv -c n 2>/dev/null | tail -n +2",
        "end",
        "complete -c vmready -f",
    ]
    no_command = f"not __fish_seen_subcommand_from {' '.join(commands)}"
    for name, text in root.verbs:
        lines.append(
            f"complete -c vmready -n {_fish_quote(no_command)} -a {name} -d {_fish_quote(text)}"
        )
    for spec in specs:
        lines += _fish_spec(spec, no_command)
    return "\n".join(lines) + "\n"


def _fish_spec(spec: CommandSpec, no_command: str) -> list[str]:
    """The fish lines of one command (or verb): its verbs, options and arguments."""
    lines: list[str] = []
    if len(spec.path) == 1:
        condition = no_command
    else:
        condition = " ; and ".join(f"__fish_seen_subcommand_from {word}" for word in spec.path[1:])
        if spec.verbs:
            verbs = " ".join(name for name, _ in spec.verbs)
            condition += f" ; and not __fish_seen_subcommand_from {verbs}"
            for name, text in spec.verbs:
                lines.append(
                    f"complete -c vmready -n {_fish_quote(condition)} -a {name} "
                    f"-d {_fish_quote(text)}"
                )
    for option in spec.options:
        flag = f"-l {option[2:]}" if option.startswith("--") else f"-s {option[1:]}"
        choices = spec.values.get(option)
        takes = ""
        if choices:
            takes = f" -x -a {_fish_quote(' '.join(choices))}"
        elif option in spec.files:
            takes = " -r -F"
        elif choices is not None:
            takes = " -x"
        lines.append(f"complete -c vmready -n {_fish_quote(condition)} {flag}{takes}")
    if INSTANCE in spec.arguments and not spec.verbs:
        lines.append(f"complete -c vmready -n {_fish_quote(condition)} -a '(__vmready_instances)'")
    for kind in spec.arguments:
        if isinstance(kind, tuple):
            lines.append(
                f"complete -c vmready -n {_fish_quote(condition)} -a {_fish_quote(' '.join(kind))}"
            )
        elif kind == FILE:
            lines.append(f"complete -c vmready -n {_fish_quote(condition)} -F")
    return lines


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of ``shell`` (one of SHELLS) for ``parser``."""
    return {"bash": bash_script, "zsh": zsh_script, "fish": fish_script}[shell](parser)
