"""YAML loading that remembers where things are, so a validation error can name the line.

PyYAML builds plain dicts and lists and forgets the source marks. Here mappings and sequences
come back as `LineMap` and `LineList`, which carry their own line and the line of each key or
item; scalars cannot hold attributes, so their container knows their line.
"""

from __future__ import annotations

from collections.abc import Hashable

import yaml

from .errors import ConfigError


class LineMap(dict):
    line: int  # 1-based line where the mapping starts
    key_lines: dict  # key -> 1-based line of the key

    def line_of(self, key) -> int:
        return self.key_lines.get(key, self.line)


class LineList(list):
    line: int
    item_lines: list[int]

    def line_of(self, index: int) -> int:
        return self.item_lines[index]


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


class _LineLoader(yaml.SafeLoader):
    file: str  # for error messages

    def construct_object(self, node: yaml.Node, deep: bool = False):
        # PyYAML's scalar constructors let Python's own errors out, with no line: a date that
        # does not exist (2001-13-45), an int too long for int(), a value that does not fit its
        # explicit tag (`!!int x`, `!!timestamp x`). They become errors at the value's line.
        # Mappings and sequences are built by the constructors below, whose errors are ours.
        try:
            return super().construct_object(node, deep=deep)
        except Exception as err:
            if isinstance(err, yaml.YAMLError) or not isinstance(node, yaml.ScalarNode):
                raise
            shown = node.value if len(node.value) <= 40 else f"{node.value[:40]}..."
            kind = node.tag.rpartition(":")[2]
            why = f": {err}" if isinstance(err, ValueError) else ""  # others say nothing useful
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {shown!r} as a YAML {kind}{why}",
                node.start_mark) from None


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> LineMap:
    loader.flatten_mapping(node)  # resolves `<<` merge keys
    mapping = LineMap()
    mapping.line, mapping.key_lines = _line(node), {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, Hashable):
            raise ConfigError(loader.file, _line(key_node), "a mapping key must be a scalar")
        # PyYAML would let a repeated key silently overwrite the first one.
        if key in mapping:
            raise ConfigError(loader.file, _line(key_node), f"duplicate key {key!r}")
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = _line(key_node)
    return mapping


def _construct_sequence(loader: _LineLoader, node: yaml.SequenceNode) -> LineList:
    items = LineList(loader.construct_object(child, deep=True) for child in node.value)
    items.line, items.item_lines = _line(node), [_line(child) for child in node.value]
    return items


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


def load(text: str, file: str):
    """Parses one YAML document; syntax errors become a ConfigError at their line."""
    loader = None
    try:
        loader = _LineLoader(text)  # it checks the characters of the whole text right away
        loader.file = file
        return loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark else 1
        raise ConfigError(file, line, f"invalid YAML: {err.problem}") from None
    except RecursionError:
        raise ConfigError(file, loader.get_mark().line + 1 if loader else 1,
                          "invalid YAML: nested too deeply") from None
    except yaml.reader.ReaderError as err:
        raise ConfigError(file, text.count("\n", 0, err.position) + 1,
                          f"invalid YAML: unacceptable character #x{err.character:04x}: "
                          f"{err.reason}") from None
    except yaml.YAMLError as err:
        raise ConfigError(file, 1, f"invalid YAML: {err}") from None
    finally:
        if loader is not None:
            loader.dispose()
