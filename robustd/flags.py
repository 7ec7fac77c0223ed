"""Switches in YAML files: `true` or `false` as YAML writes them, and nothing else.

pydantic's lax booleans take the strings 'yes', 'off', 'true', '1' and the numbers 0 and 1. In a config
that is a trap: `insecure: 'no'` quoted by a templating tool reads as a string, and an operator who
writes a string where a switch goes has usually misread the key. So every boolean key of robustd.yaml
(the core's, the checks', the adapters') and of the rule files is a `Flag`, and a value that is not a
YAML boolean is an error naming the key and the line.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator


def _yaml_boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    kind = {str: "a string", int: "a number", float: "a number"}.get(type(value), type(value).__name__)
    raise ValueError(f"expected a boolean (true or false), not {kind}")


Flag = Annotated[bool, BeforeValidator(_yaml_boolean)]
"""A pydantic field type: a YAML boolean (`true`, `false`; YAML 1.1's unquoted `yes`/`no` parse as those)."""
