"""Where in a YAML file a key is: the `file:line` every config and rule-file error starts with.

One helper for the config (robustd/config.py), the code tables (robustd/codes.py), the kernel-log
rules (checks/kernel/rules.py), the check thresholds (checks/common/thresholds.py) and the triage rules
(robustd/triage/rules.py). `load` reads a document once with its node tree and the keys written twice in
it (every one of those files refuses them: YAML keeps the last without a word).
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


# libyaml where PyYAML was built with it (the wheels are): the rule files are thousands of lines, read at
# every start, and the pure-Python parser spent 0.3 s of CPU on them. Same node tree, same marks.
_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load(text: str, source: str) -> tuple[yaml.Node | None, Any, list[str]]:
    """One YAML document read once: its node tree (for `where`), its data (SafeLoader) and its duplicate keys
    (`duplicates`, found before the loader folds merges into the tree). Raises yaml.YAMLError when malformed."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        twice = duplicates(root, source)
        return root, (loader.construct_document(root) if root is not None else None), twice
    finally:
        loader.dispose()


def duplicates(root: yaml.Node | None, source: str) -> list[str]:
    """`source:line: key: duplicate key (...)` for each key written twice in one mapping.

    YAML loaders keep the last one without a word, so an operator who adds `clear_after: 5m` below a
    forgotten `clear_after: 1m` sees the file say one thing and robustd do another. A key that a merge
    (`<<: *defaults`) brings in is no duplicate: overriding those is what merges are for. Each node is walked
    once, so aliases cannot make this slower than the file is long.
    """
    out: list[tuple[int, str]] = []
    seen: set[int] = set()
    todo: list[tuple[tuple[Any, ...], yaml.Node]] = [((), root)] if root is not None else []
    while todo:
        loc, node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    line = k.start_mark.line + 1
                    if (k.tag, k.value) in first:
                        key = ".".join(str(p) for p in (*loc, k.value))
                        out.append((line, f"{source}:{line}: {key}: duplicate key (also at line "
                                          f"{first[k.tag, k.value]}); write it once"))
                    else:
                        first[k.tag, k.value] = line
                todo.append(((*loc, k.value if isinstance(k, yaml.ScalarNode) else "?"), v))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend(((*loc, i), item) for i, item in enumerate(node.value))
    return [problem for _, problem in sorted(out)]


def malformed(err: yaml.YAMLError, source: str) -> str:
    """`source:line: malformed YAML: <problem>` for a file yaml could not parse."""
    mark = getattr(err, "problem_mark", None)
    at = f"{source}:{mark.line + 1}" if mark else source
    return f"{at}: malformed YAML: {getattr(err, 'problem', None) or err}"
