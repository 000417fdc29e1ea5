"""The flat environment names of ShardFlow 0.1 (`SHARDFLOW_<FLAT>`: `SHARDFLOW_REDIS_URL`, `SHARDFLOW_GPU_MEMORY`),
read below the nested `SHARDFLOW_<GROUP>__<FIELD>` ones (schemas/settings.py `Settings`, whose fields' validation
aliases are the old names)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

ENV_PREFIX = "SHARDFLOW_"


def flat_names(settings: type[BaseSettings]) -> Iterator[tuple[str, str, str]]:
    """(group, field, flat name) of every setting: the name SHARDFLOW_<FLAT> sets (the 0.1 name)."""
    for group, info in settings.model_fields.items():
        model: type[BaseModel] = info.annotation  # type: ignore[assignment]
        for name, field in model.model_fields.items():
            yield group, name, field.validation_alias if isinstance(field.validation_alias, str) else name


def _flat_value(field: FieldInfo, raw: str) -> Any:
    """An environment string as the field takes it: lists as JSON, the rest as pydantic parses strings."""
    return json.loads(raw) if str(field.annotation).startswith("list") else raw


class FlatEnv(PydanticBaseSettingsSource):
    """The flat SHARDFLOW_<FLAT> names of ShardFlow 0.1 (`flat_names`), below the nested ones."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the environment whole

    def __call__(self) -> dict[str, Any]:
        env = {k.upper(): v for k, v in os.environ.items()}
        out: dict[str, dict[str, Any]] = {}
        for group, name, flat in flat_names(self.settings_cls):
            raw = env.get(f"{ENV_PREFIX}{flat.upper()}")
            if raw is not None:
                field = self.settings_cls.model_fields[group].annotation.model_fields[name]  # type: ignore[union-attr]
                out.setdefault(group, {})[name] = _flat_value(field, raw)
        return out
