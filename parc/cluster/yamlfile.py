"""YAML documents with the line of every value, and the checks that quote file:line and key."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from parc.errors import UsageError

_MAX_DEPTH = 32  # deeper than any cluster file; stops recursive YAML anchors
_PLAIN_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


@dataclass(frozen=True)
class Entry:
    """A YAML value: a dict of Entries, a list of Entries or a scalar, with where it was written."""

    value: Any
    file: str
    line: int  # 1-based
    key: str  # dotted path from the document root, e.g. "nodes[1].intra_link"

    def fail(self, message: str) -> UsageError:
        """A UsageError naming this value's file, line and key."""
        return UsageError(f"{self.file}:{self.line}: {self.key or 'document'}: {message}")

    def mapping(self, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Entry]:
        """This value as a mapping with only `allowed` keys and every `required` one."""
        if not isinstance(self.value, dict):
            raise self.fail(f"expected a mapping with keys {', '.join(allowed)}, found {_kind(self.value)}")
        for name, entry in self.value.items():
            if name not in allowed:
                raise entry.fail(f"unknown key (expected one of {', '.join(allowed)})")
        for name in required:
            if name not in self.value:
                raise self.fail(f"missing key '{name}'")
        return self.value

    def items(self) -> dict[str, Entry]:
        """This value as a mapping with any (string) keys."""
        if not isinstance(self.value, dict):
            raise self.fail(f"expected a mapping, found {_kind(self.value)}")
        return self.value

    def list(self) -> list[Entry]:
        if not isinstance(self.value, list):
            raise self.fail(f"expected a list, found {_kind(self.value)}")
        return self.value

    def string(self) -> str:
        if not isinstance(self.value, str) or not self.value.strip():
            raise self.fail(f"expected a non-empty string, found {_kind(self.value)}")
        return self.value.strip()

    def number(self, positive: bool = True) -> float:
        """A number (YAML reads '1e9' as a string: it is accepted); > 0, or >= 0 if not `positive`."""
        value = self.value
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"expected a number, found {_kind(self.value)}")
        if not (value > 0 if positive else value >= 0):
            raise self.fail(f"expected a number {'> 0' if positive else '>= 0'}, found {value}")
        return float(value)

    def boolean(self) -> bool:
        if not isinstance(self.value, bool):
            raise self.fail(f"expected true or false, found {_kind(self.value)}")
        return self.value

    def integer(self, minimum: int = 1, maximum: int = 2**31) -> int:
        value = self.value
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise self.fail(f"expected an integer from {minimum} to {maximum}, found {_kind(value)}")
        return value


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing"
    return repr(value)


def read_yaml(path: str | Path) -> Entry:
    """Parse the YAML file at `path` into Entries; syntax errors name the file and line."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{name}: cannot read the file ({getattr(e, 'strerror', None) or e})") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise UsageError(f"{name}: the file is empty")
        return _convert(loader, node, name, "", 0)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise UsageError(f"{name}{line}: not valid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{name}: not valid YAML: {str(e).splitlines()[0]}") from None
    finally:
        loader.dispose()


def _convert(loader: yaml.SafeLoader, node: yaml.Node, file: str, key: str, depth: int) -> Entry:
    line = node.start_mark.line + 1
    if depth > _MAX_DEPTH:
        raise UsageError(f"{file}:{line}: {key}: nested too deeply")
    if isinstance(node, yaml.MappingNode | yaml.SequenceNode) and node.tag not in _PLAIN_TAGS:
        raise UsageError(f"{file}:{line}: {key or 'document'}: unsupported YAML tag '{node.tag}'")
    if isinstance(node, yaml.MappingNode):
        value: dict[str, Entry] = {}
        for key_node, value_node in node.value:
            name = loader.construct_object(key_node)
            if not isinstance(name, str):
                raise UsageError(f"{file}:{key_node.start_mark.line + 1}: {key or 'document'}: "
                                 f"keys must be strings, found {name!r}")
            path = f"{key}.{name}" if key else name
            if name in value:
                raise UsageError(f"{file}:{key_node.start_mark.line + 1}: {path}: key given twice")
            value[name] = _convert(loader, value_node, file, path, depth + 1)
        return Entry(value, file, line, key)
    if isinstance(node, yaml.SequenceNode):
        items = [_convert(loader, item, file, f"{key}[{i}]", depth + 1) for i, item in enumerate(node.value)]
        return Entry(items, file, line, key)
    return Entry(loader.construct_object(node), file, line, key)
