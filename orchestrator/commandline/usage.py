"""Usage errors, for `fab` and `fabtrain` alike: a mistyped task or option is answered with the
nearest spelling, and every command line the parser refuses exits 2 (1 is a failed job or check):

    $ fab trian
    No idea what 'trian' is! Did you mean 'train'?
    $ fab train --epoch 3
    No idea what '--epoch' is! Did you mean '--epochs'?

A job id given bare to a task whose job is an option (`fab stop JOB`, `fab logs JOB`,
`fab metrics JOB`: the job may be left out, and Invoke's positional arguments are required) is
taken as `--job JOB`: the parser's refusal of that word is answered by parsing again with `--job`
before it. Given twice, the second is refused with the suggestion instead.

Invoke's parser raises ParseError, which its Program prints and ends with exit 1. `fab` is
Fabric's own program and loads fabfile.py only after its core options are parsed, so a subclass
of it never runs there: as typed.py does for help, the two parsing steps that follow (parse_tasks,
then parse_cleanup for `--help TASK`) are wrapped on Invoke's Program itself by install(), which
fabfile.py calls; both programs get them.
"""

from __future__ import annotations

import ast
import difflib
import functools
import re
from collections.abc import Callable, Iterable
from typing import Any

from invoke import Exit, ParseError
from invoke.parser import ParserContext
from invoke.program import Program

from orchestrator.core import jobspec

EXIT_USAGE = 2
# Invoke's words for a token that is no task, option or value ("No idea what {!r} is!").
UNKNOWN = re.compile(r"^No idea what (?P<token>'.*'|\".*\") is!$", re.S)


class UsageError(ParseError, Exit):
    """A ParseError that Program.run ends with EXIT_USAGE: it prints the text of a ParseError and
    exits with the code of an Exit (one without a message, so the text is printed once)."""

    def __init__(self, message: str, context: ParserContext | None = None) -> None:
        Exception.__init__(self, message)  # ParseError's own __init__ would reach Exit's with the text
        self.context = context
        self.message = None
        self._code = EXIT_USAGE


def closest(token: str, choices: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(token, sorted(set(choices)), n=1)
    return found[0] if found else None


def hint(token: str, tasks: Iterable[str], context: ParserContext | None, core: ParserContext | None) -> str:
    """' Did you mean X?' for an unknown token ('' when nothing is close): an option of the task
    being parsed (or a core option) for a flag, else a task; a word given to a task that takes
    --job is taken for the job it names."""
    if token.startswith("-"):
        near = closest(token, [*flags(core), *flags(context)])
    else:
        near = closest(token, tasks)
        takes_job = context is not None and context.name and "--job" in context.flags
        if near is None and takes_job and jobspec.valid_job_id(token):
            near = f"--job {token}"
    return f" Did you mean {near!r}?" if near else ""


def flags(context: ParserContext | None) -> list[str]:
    """Every spelling of the context's options: names, aliases, --no-X."""
    if context is None:
        return []
    return [*context.flags, *context.flags.aliases, *context.inverse_flags]


def explained(error: ParseError, program: Program) -> UsageError:
    """The parser's error as a UsageError, with the nearest spelling of an unknown token."""
    text = str(error)
    m = UNKNOWN.match(text)
    if m:
        parser = getattr(program, "parser", None)  # parse_tasks sets it before it parses
        tasks = list(parser.contexts) if parser is not None else []
        text += hint(ast.literal_eval(m["token"]), tasks, error.context, program.initial_context)
    return UsageError(text, error.context)


def job_given_bare(error: ParseError, argv: list[str], tasks: Iterable[str]) -> list[str] | None:
    """argv with `--job` put before the word the parser refused, when that word is a job id (and
    no mistyped task: `fab stop trian`) given to a task that takes --job and was not given one;
    else None."""
    m = UNKNOWN.match(str(error))
    context = error.context
    if not m or context is None or not context.name or "--job" not in context.flags:
        return None
    token = ast.literal_eval(m["token"])
    if not jobspec.valid_job_id(token) or closest(token, tasks) is not None:
        return None
    names = {context.name, *context.aliases}
    starts = [i for i, word in enumerate(argv) if word in names]
    if not starts:
        return None
    rest = argv[starts[-1] + 1 :]
    if token not in rest or any(w == "--job" or w.startswith("--job=") for w in rest):
        return None
    at = starts[-1] + 1 + rest.index(token)
    return [*argv[:at], "--job", *argv[at:]]


def _refusing(step: Callable[[Program], None]) -> Callable[[Program], None]:
    @functools.wraps(step)
    def wrapped(self: Program) -> None:
        for _ in range(8):  # one retry per job given bare (one per task on the line)
            try:
                return step(self)
            except UsageError:
                raise
            except ParseError as exc:
                core, parser = getattr(self, "core", None), getattr(self, "parser", None)
                tasks = list(parser.contexts) if parser is not None else []
                argv = job_given_bare(exc, list(core.unparsed), tasks) if core is not None else None
                if core is None or argv is None:
                    raise explained(exc, self) from None
                core.unparsed = argv
        raise UsageError("too many job ids given bare")

    return wrapped


def install() -> None:
    """Invoke's Program (Fabric's too) refuses a command line with exit 2 and a suggestion."""
    for name in ("parse_tasks", "parse_cleanup"):
        step: Any = getattr(Program, name)
        if not hasattr(step, "__wrapped__"):
            setattr(Program, name, _refusing(step))
