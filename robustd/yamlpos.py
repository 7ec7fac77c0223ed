"""Where in a YAML file a key is: the `file:line` every config and rule-file error starts with.

One helper for the config (robustd/config.py), the code tables (robustd/codes.py), the kernel-log
rules (checks/kernel/rules.py) and the triage rules (robustd/triage/rules.py).
"""

from __future__ import annotations

from typing import Any

import yaml


def where(root: yaml.Node | None, loc: tuple[Any, ...], source: str) -> str:
    """`source:line` of the deepest node on `loc` that exists (the key itself for a key that is there;
    the value's line for a scalar at the end of `loc`). `root` is `yaml.compose`'s node tree."""
    line = 1
    node = root
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    line = k.start_mark.line + 1
                    node = v
                    break
            else:
                break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    else:
        if node is not None and not isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            line = node.start_mark.line + 1
    return f"{source}:{line}"


def malformed(err: yaml.YAMLError, source: str) -> str:
    """`source:line: malformed YAML: <problem>` for a file yaml could not parse."""
    mark = getattr(err, "problem_mark", None)
    at = f"{source}:{mark.line + 1}" if mark else source
    return f"{at}: malformed YAML: {getattr(err, 'problem', None) or err}"
