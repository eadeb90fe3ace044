"""The Reader of the inventory's typed fields, whose errors name the file, the line and the field
(the YAML itself, with the line of every key and entry, is read by yamlloader.py)."""

from __future__ import annotations

import datetime
import re
import unicodedata
from pathlib import Path
from typing import Any, NoReturn, overload

from orchestrator.config.yamlloader import LineDict, show
from orchestrator.core.errors import UserError

ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Upper bounds that keep every number well inside what docker, ssh and the OS accept (a value past
# them is a typo, not a setting).
MAX_SECONDS = 86400


def _kind_name(value: Any) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    names = {str: "text", list: "a list", dict: "a mapping"}
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)


def _unset(value: Any, kinds: tuple) -> bool:
    """Nothing written for a field: the key alone or `~` (YAML null), or an empty list or mapping
    where a list or mapping goes. An optional field then takes its default, as if the line were
    not there; a required field is an error. A blank string is not this: it is a value, and the
    wrong one (_is_blank)."""
    return value is None or (isinstance(value, (list, dict)) and not value and isinstance(value, kinds))


def _key_name(key: Any) -> str:
    """A key as it goes into a field path: as written, unless quoting shows it better (a blank,
    multi-line or very long key)."""
    text = str(key)
    return text if text.isprintable() and text.strip() == text and 0 < len(text) <= 60 else show(key)


def _is_blank(value: Any) -> bool:
    return isinstance(value, str) and not value.strip()


def _control_char(text: str) -> str | None:
    """The first control character (or lone surrogate) in a one-line field, as U+XXXX."""
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cs"):
            return f"U+{ord(ch):04X}"
    return None


class Reader:
    """Reads typed fields out of one YAML mapping, raising errors that point at file:line field."""

    def __init__(
        self, path: Path, data: Any, where: str, line: int, fix: str = "indent its fields under it"
    ) -> None:
        self.path, self.where, self.line = path, where, line
        self.lines: dict[Any, int] = {}
        if _is_blank(data) and where:
            self.fail(
                self.where, "is empty", f"give its fields, or remove '{self.where.rsplit('.', 1)[-1]}:'", line
            )
        if _unset(data, (dict,)):
            data = LineDict()
        if not isinstance(data, dict):
            self.fail(self.where, f"must be a mapping (key: value lines), not {_kind_name(data)}", fix, line)
        self.data = data
        self.lines = getattr(data, "lines", {})

    def fail(self, fieldname: str, problem: str, fix: str, line: int | None = None) -> NoReturn:
        line = line or self.lines.get(fieldname.rsplit(".", 1)[-1]) or self.line
        subject = f"{fieldname}: " if fieldname else ""
        raise UserError(f"{self.path}:{line}: {subject}{problem}; {fix}")

    def line_of(self, key: Any) -> int:
        return self.lines.get(key) or self.line

    def _field(self, key: Any) -> str:
        return f"{self.where}.{_key_name(key)}" if self.where else _key_name(key)

    def check_keys(self, allowed: tuple[str, ...]) -> None:
        for key in self.data:
            if key not in allowed:
                self.fail(
                    self._field(key),
                    "unknown field",
                    f"use one of: {', '.join(allowed)}",
                    self.lines.get(key),
                )

    def get(
        self,
        key: Any,
        kind: type | tuple,
        default: Any = None,
        required: bool = False,
        fix: str = "give a value",
    ) -> Any:
        """The value of `key`, of one of the types in `kind`. Every field is read here, so an empty
        value means the same everywhere (see _unset); `fix` is the advice for a required field
        left empty."""
        kinds = kind if isinstance(kind, tuple) else (kind,)
        field_, line = self._field(key), self.line_of(key)
        if key not in self.data:
            if required:
                self.fail(field_, "is missing", f"add '{key}:' to {self.where or 'the file'}", self.line)
            return default
        value = self.data[key]
        if _unset(value, kinds):
            if required:
                self.fail(field_, "is empty", fix, line)
            return default
        if _is_blank(value):
            self.fail(field_, "is empty", f"give a value, or remove '{key}:'", line)
        # An int is a valid float field; the caller converts it once its range is checked.
        number = float in kinds and isinstance(value, int)
        if not (isinstance(value, kinds) or number) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            self.fail(
                field_,
                f"must be {names}, got {show(value)}",
                f"write an {names} value" if names[0] in "aeiou" else f"write a {names} value",
                line,
            )
        if isinstance(value, str) and _control_char(value):
            self.fail(
                field_,
                f"contains the control character {_control_char(value)}",
                "remove it (the value is one line of text)",
                line,
            )
        return value

    def given(self, key: str) -> bool:
        """`key` has a value (a field left empty is as good as absent)."""
        return key in self.data and not _unset(self.data[key], (list, dict))

    def items(
        self, key: str, entry: str, required: bool = False, fix: str = ""
    ) -> list[tuple[str, Any, int]]:
        """The entries of list field `key` as (field path, value, line); `entry` says what one
        entry should be, for the error about an entry left empty."""
        values = self.get(key, list, [], required=required, fix=fix)
        lines = getattr(values, "lines", [])
        out = []
        for i, value in enumerate(values):
            where, line = f"{self._field(key)}[{i}]", lines[i] if i < len(lines) else self.line_of(key)
            if _unset(value, (list, dict)) or _is_blank(value):
                self.fail(where, "is empty", f"write {entry} after the '-', or remove that line", line)
            if isinstance(value, str) and _control_char(value):
                self.fail(
                    where,
                    f"contains the control character {_control_char(value)}",
                    "remove it (an entry is one line of text)",
                    line,
                )
            out.append((where, value, line))
        return out

    def sub(self, key: str) -> Reader:
        value = self.data.get(key)
        return Reader(self.path, value, self._field(key), self.line_of(key))

    @overload
    def integer(self, key: str, default: int, low: int, high: int, what: str) -> int: ...
    @overload
    def integer(self, key: str, default: int | None, low: int, high: int, what: str) -> int | None: ...

    def integer(self, key: str, default: int | None, low: int, high: int, what: str) -> int | None:
        value = self.get(key, int, default)
        if value is not None and not low <= value <= high:
            self.fail(
                self._field(key),
                f"{value} is not {what}",
                f"use a number from {low} to {high}",
                self.line_of(key),
            )
        return value

    @overload
    def port(self, key: str, default: int) -> int: ...
    @overload
    def port(self, key: str, default: int | None) -> int | None: ...

    def port(self, key: str, default: int | None) -> int | None:
        return self.integer(key, default, 1, 65535, "a TCP port")

    def seconds(self, key: str, default: float, low: float) -> float:
        value = self.get(key, float, default)
        # nan fails both comparisons; inf and 1e400 fail the upper bound.
        if not (low <= value <= MAX_SECONDS):
            self.fail(
                self._field(key),
                f"{show(value)} is not a number of seconds",
                f"use a number from {low:g} to {MAX_SECONDS}",
                self.line_of(key),
            )
        return float(value)

    def env(self, key: str) -> tuple[tuple[str, str], ...]:
        env = self.sub(key)
        out = []
        for name, value in env.data.items():
            if not isinstance(name, str) or not ENV_KEY_RE.fullmatch(name):
                env.fail(
                    env._field(name),
                    "is not a valid environment variable name",
                    "use letters, digits and underscores, not starting with a digit",
                    env.line_of(name),
                )
            # No default here: a variable with no value may be a value forgotten, and "" is a
            # legitimate value, so the user says which one is meant.
            if value is None:
                env.fail(
                    env._field(name),
                    "is empty",
                    f'write {name}: "" for an empty variable, or remove the line',
                    env.line_of(name),
                )
            # datetime.date: an unquoted 2024-01-01, which reads back as written.
            if not isinstance(value, (str, int, float, datetime.date)):
                env.fail(
                    env._field(name),
                    f"must be a single value, not {_kind_name(value)}",
                    "quote it as a string",
                    env.line_of(name),
                )
            out.append(
                (
                    name,
                    value
                    if isinstance(value, str)
                    else str(value).lower()
                    if isinstance(value, bool)
                    else str(value),
                )
            )
        return tuple(out)

    def path_field(
        self,
        key: Any,
        default: str | None,
        must_exist: bool = False,
        fix: str = "fix the path (relative paths are relative to the inventory file)",
        required: bool = False,
    ) -> str | None:
        value = self.get(key, str, default, required=required, fix=fix)
        if value is None:
            return None
        try:
            expanded = Path(value).expanduser()
        except RuntimeError:  # ~name of a user this machine does not know
            self.fail(
                self._field(key),
                f"{show(value)}: no home directory for {value.split('/')[0]}",
                "write the full path",
                self.line_of(key),
            )
        if not expanded.is_absolute():
            expanded = self.path.parent / expanded
        try:
            exists = not must_exist or expanded.is_file()
        except OSError as exc:  # a name too long, a directory that may not be searched
            self.fail(self._field(key), f"{expanded}: {exc.strerror}", fix, self.line_of(key))
        if not exists:
            self.fail(
                self._field(key),
                f"{expanded} is a directory" if expanded.is_dir() else f"{expanded} does not exist",
                "run 'fab cluster.up' to make the local cluster's" if ".cluster" in expanded.parts else fix,
                self.line_of(key),
            )
        return str(expanded)
