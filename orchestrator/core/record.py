"""The typed parts of a job's record (runs/JOB/job.json, recovery.JobRecord): where it ran when not
over SSH (BackendPlace), where its notifications go (Notify), a detached job's controllers
(Controller), each later resume (Resume), and how a record's JSON is read back field by field (`read`)
and written (`plain`). Each part is frozen: a change is a new value (dataclasses.replace).

The record's format has a version (VERSION, written as "version"); a record without one is the
format written before versions (1): its parts had the same keys, with {} for a part that is absent.
Pure: no I/O."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

VERSION = 2  # job.json's format: "version": 2; none at all: 1 (read and migrated, never written)


@dataclasses.dataclass(frozen=True)
class BackendPlace:
    """Where the job ran when not over SSH: the backend's name (backends/registry.py) and, on Slurm,
    its login host, its working directory there, its Slurm job id and those of its earlier runs."""

    on: str
    login: str | None = None
    workdir: str | None = None
    slurm_id: str | None = None
    earlier: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Notify:
    """Where the job's notifications go (progress/notify.py): a command run for each, a URL each is
    posted to."""

    command: str | None = None
    url: str | None = None
    SPARSE: typing.ClassVar[bool] = True  # written with only what is set, as before versions (plain)


@dataclasses.dataclass(frozen=True)
class ControllerPlace:
    """Where one controller of a detached job ran (backends/ssh/placement.py Place)."""

    host: str
    dir: str
    container: str


@dataclasses.dataclass(frozen=True)
class Controller:
    """A detached job's controllers (backends/ssh/detached.py): the active one's place, its standby's,
    the hosts that may still hold the job's controller key, and what this machine did with the run:
    when it fetched it and from which host's controller, or when a `fab attach` took it over."""

    host: str
    dir: str
    container: str
    standby: ControllerPlace | None = None
    keys: tuple[str, ...] = ()
    fetched: float | None = None
    ended_on: str | None = None
    taken_over: float | None = None

    @classmethod
    def at(
        cls, active: ControllerPlace, standby: ControllerPlace | None = None, keys: typing.Iterable[str] = ()
    ) -> Controller:
        return cls(active.host, active.dir, active.container, standby, tuple(sorted(keys)))


@dataclasses.dataclass(frozen=True)
class Resume:
    """One later `fab train --resume/--continue` of the job: when, after which attempt, the state it
    was in, and the options it changed (commandline/cli.py resume_entry)."""

    time: float
    after_attempt: int
    state: str
    changed: dict[str, Any] = dataclasses.field(default_factory=dict)


T = typing.TypeVar("T")


class UnknownKey(ValueError):
    """A key that no field of its part is named (read)."""


def read(cls: type[T], doc: object, where: str) -> T:
    """A dataclass read from its JSON object, each field checked against its type. ValueError naming
    the field (`where`.name) when the object is not one, a key is unknown, a field without a default
    is missing, or a value is of the wrong kind."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where} is {_seen(doc)}, not a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = [k for k in doc if k not in fields]
    if unknown:
        raise UnknownKey(f"unknown key {_join(where, str(unknown[0]))!r}")
    hints = typing.get_type_hints(cls)
    missing = [
        n
        for n, f in fields.items()
        if n not in doc and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{_join(where, missing[0])} is missing")
    return cls(**{k: value(hints[k], v, _join(where, k)) for k, v in doc.items()})


def value(kind: Any, v: object, where: str) -> Any:
    """`v` as a value of type `kind` (the types the record's fields use); ValueError naming `where`."""
    got = _as(kind, v, where)
    if got is _NOT:
        raise ValueError(f"{where} is {_seen(v)}, not {_kind(kind)}")
    return got


_NOT = object()  # _as: `v` is not of that kind (a part inside it that is not raises ValueError)


def _as(kind: Any, v: object, where: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        for arm in (a for a in args if a is not type(None)):
            got = _as(arm, v, where)
            if got is not _NOT:
                return got
    elif kind is Any or (kind in (str, bool) and isinstance(v, kind)):
        return v
    elif (
        kind in (int, float)
        and isinstance(v, (int, float if kind is float else int))
        and not isinstance(v, bool)
    ):
        return kind(v)
    elif origin in (tuple, list) and isinstance(v, list):
        if origin is list or args[-1] is Ellipsis:
            items = [value(args[0], x, f"{where}[{i}]") for i, x in enumerate(v)]
            return items if origin is list else tuple(items)
        if len(v) == len(args):
            return tuple(value(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, v, strict=True)))
    elif origin is dict and isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: value(args[1], x, f"{where}.{k}") for k, x in v.items()}
    elif dataclasses.is_dataclass(kind) and isinstance(v, dict):
        return read(kind, v, where)  # type: ignore[arg-type]
    return _NOT


def plain(obj: Any) -> Any:
    """A record's value as JSON holds it: dataclasses as objects, tuples as lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        sparse = getattr(obj, "SPARSE", False)
        return {
            f.name: plain(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not (sparse and getattr(obj, f.name) is None)
        }
    if isinstance(obj, (list, tuple)):
        return [plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def _kind(kind: Any) -> str:
    """A field's type as a person reads it."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _kind(a) for a in args)
    if origin in (tuple, list) and (origin is list or args[-1] is Ellipsis):
        return f"a list of {_kind(args[0])}"
    if origin is tuple:
        return f"a list of {len(args)} ({', '.join(map(_kind, args))})"
    if origin is dict:
        return "a JSON object"
    names = {str: "text", bool: "true or false", int: "a whole number", float: "a number"}
    return names.get(kind, "a JSON object" if dataclasses.is_dataclass(kind) else str(kind))


def _seen(v: object) -> str:
    shown = repr(v)
    return f"{type(v).__name__} {shown[:60]}{'...' if len(shown) > 60 else ''}"


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
