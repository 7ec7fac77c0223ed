"""The `thresholds:` table of a check's rule file: where its judgements change level, as data.

A check's rules.yaml says what each of its codes means (`codes:`, robustd/codes.py) and, for a code with
levels, where each level starts and what it means there (`thresholds:`): GPU_TEMP_HIGH's margins below the
GPU's own slowdown and shutdown points, DISK_SPACE_LOW's free-space percentages, TEMP_HIGH's meaning at a
sensor's max and crit. The check's config.py declares the table's model (levels are `Level`s, or models
extending it with where the level starts); `load` reads and validates it once per process, and every
problem names the file, the line and the key, as the codes table's do. A limit that is also a config key
(`checks.gpu.temp_critical_margin`, `checks.host.disks[].min_free_percent`) takes its default from here,
and the config still wins where it sets one.
"""

from __future__ import annotations

import functools
from typing import TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from robustd import yamlpos
from robustd.codes import ActionName, SeverityName
from robustd.config import ConfigError, describe

T = TypeVar("T", bound=BaseModel)


class ThresholdError(ConfigError):
    """A `thresholds:` table that cannot be used; each problem reads `file:line: thresholds.key: message`."""


class Strict(BaseModel):
    """The base of every thresholds model: unknown keys are errors, nothing changes after load."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Level(Strict):
    """What one level of a code means: the severity and action its findings carry."""

    severity: SeverityName
    action: ActionName


@functools.cache
def load(path: str, model: type[T]) -> T:
    """The `thresholds:` mapping of the rule file at `path`, validated by `model` (read once per process)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        root, doc, twice = yamlpos.load(text, path)
    except OSError as e:
        raise ThresholdError([f"{path}: cannot read rule file: {e.strerror}"]) from None
    except yaml.YAMLError as e:
        raise ThresholdError([yamlpos.malformed(e, path)]) from None
    if twice:
        raise ThresholdError(twice)
    data = (doc or {}).get("thresholds")
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as e:
        raise ThresholdError(describe(e, ("thresholds",), root, path, model)) from None
