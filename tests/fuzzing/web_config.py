"""Fuzz targets for configuration: the daemon's YAML config file, an instance's config keys.

``twistd vmready`` reads ``/etc/vmready/vmready.yaml`` (``daemon.configfile``);
an operator's ``POST /1.0/instances``, ``PATCH`` and resize hand instance
config keys and values (``domain.config.validate_config``, ``parse_memory``,
``parse_cpus``).  Both must refuse what is wrong in one precise line and
accept only what they document.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

from hypothesis import strategies as st

from tests.fuzzing.target import FuzzTarget
from tests.fuzzing.web_mutations import edited
from vmready.daemon.configfile import (
    COMMAND_LINE_ONLY,
    ConfigFileError,
    Setting,
    as_arguments,
    given_on_command_line,
    option_names,
    parse_settings,
    read_settings,
)
from vmready.daemon.tap import Options
from vmready.domain.config import (
    ACCEL_CHOICES,
    ACCEL_KEY,
    MAX_CPUS,
    MAX_MEMORY_MIB,
    MIN_MEMORY_MIB,
    config_changes,
    parse_cpus,
    parse_memory,
    validate_config,
)
from vmready.domain.model import BadRequest

# -- the daemon's config file ---------------------------------------------------

_PARAMETERS, _FLAGS = option_names(Options())
_KEYS = sorted({*_PARAMETERS, *_FLAGS} - COMMAND_LINE_ONLY)
_YAML_VALUES = [
    "/var/lib/vmready",
    "qemu",
    "120",
    "0.5",
    "-1",
    "1e999",
    ".nan",
    "0x1F",
    "0o17",
    "1_000",
    "2001-12-14",
    "2001-13-45",
    "2001-12-14t21:59:43.10-05:00",
    "yes",
    "no",
    "~",
    "null",
    "true",
    "''",
    '"a\\x00b"',
    '"\\ud800"',
    "!!binary aGVsbG8=",
    "!!binary zz",
    "!!float x",
    "!!int 9x",
    "!!timestamp 2001-99-01",
    "!!python/object:os.system x",
    "&a x",
    "*a",
    "[a, b]",
    "{a: 1}",
    "|\n  two\n  lines",
    "1" * 5000,
    "[" * 60,
    "key: with: colons",
    "unix:/run/vmready/api.sock:mode=660",
]
_YAML_KEYS = [*_KEYS, "config", "data_dir", "--data-dir", "datadir", "? [a]", "<<", "1", "~", ""]


def _yaml_line() -> st.SearchStrategy[str]:
    return st.builds(
        lambda key, value, indent: f"{indent}{key}: {value}",
        st.sampled_from(_YAML_KEYS),
        st.sampled_from(_YAML_VALUES) | st.text(max_size=12),
        st.sampled_from(["", "", "", " ", "  ", "\t", "- "]),
    )


_CONFIG_TEXT = st.lists(
    _yaml_line() | st.sampled_from(["# a comment", "---", "...", "%YAML 1.1", "", "\ufeff"]),
    max_size=8,
).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass"))
CONFIG_FILES = edited(_CONFIG_TEXT)

_CONFIG_DIR = tempfile.mkdtemp(prefix="vmready-fuzz-config-")
_CONFIG_PATH = os.path.join(_CONFIG_DIR, "vmready.yaml")


def check_config_file(data: bytes) -> None:
    """The file's settings, each an option the command line takes as it is; or one precise line."""
    try:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            # Read from the file as the daemon reads it (which says it is not UTF-8).
            with open(_CONFIG_PATH, "wb") as f:
                f.write(data)
            settings = read_settings(_CONFIG_PATH, _PARAMETERS, _FLAGS)
        else:
            settings = parse_settings(text, _CONFIG_PATH, _PARAMETERS, _FLAGS)
    except ConfigFileError as e:
        message = str(e)
        assert message.startswith(f"config file {_CONFIG_PATH}"), message
        assert "\n" not in message and message.strip() != f"config file {_CONFIG_PATH}", message
        return
    lines = data.count(b"\n") + data.count(b"\r") + 1
    for key, setting in settings.items():
        assert key in _KEYS, key
        assert isinstance(setting, Setting) and 1 <= setting.line <= lines, setting
        if key in _FLAGS:
            assert isinstance(setting.value, bool), (key, setting)
        else:
            assert isinstance(setting.value, str), (key, setting)
    # What the file sets reaches the options parser as the command line would give it.
    given = given_on_command_line(Options(), as_arguments(settings, ()))
    expected = {
        key: "" if setting.value is True else setting.value
        for key, setting in settings.items()
        if setting.value is not False
    }
    assert given == expected, (given, expected)


# -- instance config keys and values --------------------------------------------

_CONFIG_KEYS = [
    "limits.memory",
    "limits.cpu",
    "user.x",
    "user.meta-data",
    "cloud-init.user-data",
    "vmready.record",
    "boot.image",
    "boot.kernel",
    "boot.initrd",
    "boot.append",
    ACCEL_KEY,
    "volatile.last_state.ready",
    "limits.memory.swap",
    "user.",
    "user",
    "USER.x",
    "\ud800",
    "user.\ud800",
    "",
]
_MEMORY = [
    "512",
    "2GiB",
    "2 GiB",
    " 256MiB ",
    "16",
    "15",
    "1048576",
    "1048577",
    "1024G",
    "1025G",
    "0",
    "-512",
    "+512",
    "512.5",
    "1e3",
    "512KiB",
    "512 kb",
    "512mib",
    "0x200",
    "5_12",
    "\u0665\u0661\u0662",  # Arabic-Indic 512
    "\uff15\uff11\uff12",  # fullwidth 512
    "512\u2003",
    "9" * 25,
    "0" * 30 + "512",
    "9" * 5000,
    "",
]
_CPUS = ["1", "2", "64", "65", "0", "-1", "+2", "1_0", " 4 ", "\u0664", "4.0", "0x4", "9" * 5000]
# Stands for an integer of more digits than Python writes out (sys.get_int_max_str_digits):
# the input itself must stay printable, as a long run prints it when it fails.
_HUGE = "<a 5000-digit integer>"
_CONFIG_VALUE: st.SearchStrategy[Any] = (
    st.sampled_from(_MEMORY + _CPUS + ["true", "false", "kvm", "tcg", "auto", "/x", "x\ud800"])
    | st.text(max_size=10)
    | st.integers()
    | st.sampled_from([_HUGE, 2**64, -(2**64), True, None, 1.5, [], {}])
)
CONFIG_VALUES = st.dictionaries(
    st.sampled_from(_CONFIG_KEYS) | st.text(max_size=6), _CONFIG_VALUE, max_size=4
)
_MEMORY_TEXT = re.compile(r"\s*[0-9]+\s*(MiB|GiB|MB|GB|M|G)?\s*")
_CPUS_TEXT = re.compile(r"\s*[0-9]+\s*")


def _refused_naming_a_key(error: BadRequest, keys: list[Any]) -> None:
    message = error.message
    assert error.http_status == 400 and "\n" not in message, message
    assert any(
        isinstance(key, str) and (key in message or repr(key) in message) for key in keys
    ), (
        message,
        keys,
    )


def check_config_values(config: dict[Any, Any]) -> None:
    """Valid config becomes strings in documented ranges; anything else a 400 naming its key."""
    config = {key: 10**5000 if value == _HUGE else value for key, value in config.items()}
    setting = {key: value for key, value in config.items() if value is not None}
    try:
        checked = validate_config(setting)
    except BadRequest as e:
        _refused_naming_a_key(e, list(setting))
    else:
        assert set(checked) == set(setting), (checked, setting)
        assert all(isinstance(value, str) for value in checked.values()), checked
        if "limits.memory" in checked:
            raw = setting["limits.memory"]
            assert isinstance(raw, int) or _MEMORY_TEXT.fullmatch(raw), raw
            assert MIN_MEMORY_MIB <= int(checked["limits.memory"]) <= MAX_MEMORY_MIB, checked
        if "limits.cpu" in checked:
            raw = setting["limits.cpu"]
            assert isinstance(raw, int) or _CPUS_TEXT.fullmatch(raw), raw
            assert 1 <= int(checked["limits.cpu"]) <= MAX_CPUS, checked
        assert checked.get(ACCEL_KEY, "auto") in ACCEL_CHOICES, checked
    # PATCH's form of the same: None removes a key.
    try:
        changes = config_changes(config)
    except BadRequest as e:
        _refused_naming_a_key(e, list(config))
    else:
        assert set(changes) == set(config), (changes, config)
    # resize's memory and cpus parameters.
    for value in config.values():
        if isinstance(value, str | int) and not isinstance(value, bool):
            for parse, low, high in ((parse_memory, MIN_MEMORY_MIB, MAX_MEMORY_MIB),):
                try:
                    assert low <= parse(value) <= high, value
                except BadRequest as e:
                    assert "limits.memory" in e.message, e.message
            try:
                assert 1 <= parse_cpus(value) <= MAX_CPUS, value
            except BadRequest as e:
                assert "limits.cpu" in e.message, e.message


TARGETS = [
    FuzzTarget(
        name="config-file",
        description="the daemon's YAML config file (daemon.configfile), read as twistd reads it",
        inputs=CONFIG_FILES,
        check=check_config_file,
    ),
    FuzzTarget(
        name="config-values",
        description="instance config keys and values: validate_config, config_changes, "
        "limits.memory and limits.cpu",
        inputs=CONFIG_VALUES,
        check=check_config_values,
    ),
]
