"""Typed task options for fabfile.py: `fab --help TASK` shows INT or NUMBER for a numeric option, and
a value that is not one stops with a message naming the option, never a traceback.

Invoke types an option by its default's type, so an option whose default is None ("take the
inventory's") shows as STRING, and a bad value for an INT option (`fab cluster.up --nodes x`)
raised ValueError from inside its parser. Here a task says its numeric options' kinds itself:

    @task(kinds={"epochs": int, "grace": float}, help={...})
"""

from __future__ import annotations

import functools
from typing import Any

from invoke import Task as _Task
from invoke import task as _task
from invoke.exceptions import ParseError
from invoke.parser import Argument, ParserContext

NUMERIC = {int: "a whole number", float: "a number"}


class Option(Argument):
    """An option whose bad value is a ParseError naming it (invoke prints those as one line)."""

    def set_value(self, value: Any, cast: bool = True) -> None:
        if cast and self.kind in NUMERIC and not isinstance(value, self.kind):
            try:
                value = self.kind(value)
            except (TypeError, ValueError):
                flag = "--" + (self.name or "").replace("_", "-")
                raise ParseError(f"{flag} {value!r}: give {NUMERIC[self.kind]}") from None
        super().set_value(value, cast=cast)


class Task(_Task):
    """A task whose numeric options are typed by `kinds`, not by their defaults."""

    def __init__(self, *args: Any, kinds: dict[str, type] | None = None, **kwargs: Any) -> None:
        self.kinds = dict(kinds or {})
        super().__init__(*args, **kwargs)

    def arg_opts(self, name: str, default: str, taken_names: set[str]) -> dict[str, Any]:
        opts = super().arg_opts(name, default, taken_names)
        if name in self.kinds:
            opts["kind"] = self.kinds[name]
        return opts

    def get_arguments(self, ignore_unknown_help: bool | None = None) -> list[Argument]:
        unknown = set(self.kinds) - set(self.argspec(self.body).parameters)
        if unknown:
            raise ValueError(f"kinds given for options {self.name} does not have: {sorted(unknown)}")
        return [
            Option(
                names=a.names,
                kind=a.kind,
                default=a.default,
                help=a.help,
                positional=a.positional,
                optional=a.optional,
                incrementable=a.incrementable,
                attr_name=a.attr_name,
            )
            for a in super().get_arguments(ignore_unknown_help)
        ]


task = functools.partial(_task, klass=Task)


def _help_for(original: Any) -> Any:
    """ParserContext.help_for, with a float option read as --grace=NUMBER. Invoke names only str and
    int options' values and shows any other kind as a flag without one; its collection is rebuilt by
    the loader (Collection.from_module), so a subclass of either never reaches `fab --help`."""

    @functools.wraps(original)
    def help_for(self: ParserContext, flag: str) -> tuple[str, str]:
        arg = self.flags.get(flag)
        if not isinstance(arg, Option) or arg.kind is not float:
            return original(self, flag)
        arg.kind = int
        try:
            names, text = original(self, flag)
        finally:
            arg.kind = float
        return names.replace("=INT", "=NUMBER").replace(" INT", " NUMBER"), text

    return help_for


if not hasattr(ParserContext.help_for, "__wrapped__"):
    ParserContext.help_for = _help_for(ParserContext.help_for)  # type: ignore[method-assign]
