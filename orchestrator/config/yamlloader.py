"""The inventory's YAML read with the line of every mapping key and list entry (_Loader, load_yaml),
and `show`, the short bounded form of a value that every error message quotes."""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

import yaml

from orchestrator.core.errors import UserError

# How deep lists and mappings may nest: an upper bound well past any inventory (deeper is a mistake,
# and PyYAML would end in a RecursionError).
MAX_DEPTH = 64


class _Loader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping key and list entry, for error messages."""

    depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        # PyYAML composes and constructs recursively: deep enough nesting would end in a
        # RecursionError, with no line to report. An inventory is a few levels deep.
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"lists or mappings nested more than {MAX_DEPTH} deep",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # A scalar that looks like a date, number or bool but is not one (2024-13-45, !!int x,
        # 5000 digits) fails inside PyYAML's constructors with a bare ValueError; it is reported at
        # its line like any other YAML mistake.
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, KeyError, OverflowError):
            what = show(node.value) if isinstance(node, yaml.ScalarNode) else "this value"
            raise yaml.constructor.ConstructorError(
                None, None, f"{what} is not a valid {node.tag.rsplit(':', 1)[-1]}", node.start_mark
            ) from None


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict:
    mapping = LineDict()
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a list or mapping used as a key", key_node.start_mark
            ) from None
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.lines[key] = key_node.start_mark.line + 1
    mapping.line = node.start_mark.line + 1
    return mapping


class LineDict(dict):
    """A mapping as read: `line` is its own line, `lines` the line of each key."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[Any, int] = {}
        self.line = 0


class LineList(list):
    """A list as read: `line` is its own line, `lines` the line of each entry."""

    line = 0
    lines: list[int] = []


def _construct_sequence(loader: _Loader, node: yaml.SequenceNode) -> list:
    seq = LineList(loader.construct_object(child, deep=True) for child in node.value)
    seq.line = node.start_mark.line + 1
    # An entry that is only '-' is a null whose mark is still on the '-' line.
    seq.lines = [child.start_mark.line + 1 for child in node.value]
    return seq


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    value = yaml.SafeLoader.construct_yaml_int(loader, node)
    # Hex and binary literals have no digit limit in Python; no field takes anything this long, and
    # printing it in a message would fail (int max_str_digits).
    if value.bit_length() > 128:
        raise yaml.constructor.ConstructorError(
            None, None, f"{show(node.value)} is too large a number", node.start_mark
        )
    return value


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


class _Repr(reprlib.Repr):
    """reprlib's bounded repr, which also knows the loader's dict and list types: a value in a
    message stays short however big (or alias-multiplied) the YAML value is."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = 60
        self.maxlevel, self.maxlist, self.maxdict = 2, 4, 4

    def repr_LineDict(self, x: dict, level: int) -> str:
        return self.repr_dict(x, level)

    def repr_LineList(self, x: list, level: int) -> str:
        return self.repr_list(x, level)


show = _Repr().repr


def load_yaml(text: str, path: Path) -> Any:
    """The YAML document in `text`, read by _Loader; a YAML mistake is a UserError at its line."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 0
        raise UserError(
            f"{path}:{line}: not valid YAML: {exc.problem}; check the indentation and quoting on that line"
        ) from None
    except yaml.reader.ReaderError as exc:  # raised before any mark exists
        line = text[: exc.position].count("\n") + 1
        raise UserError(
            f"{path}:{line}: not valid YAML: the control character U+{exc.character:04X} is not "
            f"allowed; remove it"
        ) from None
