"""Which config fields identify a run: its checkpoint resumes only under the same values.

A component marks such a field where it declares it::

    group_size: int = Field(default=8, json_schema_extra=IDENTITY)

``identity_fields(RunConfig)`` lists the dotted keys of the marked fields
(a marked section, e.g. ``parallel``, counts as one key).
``labrl.harness.pipeline.resume.derived_identity`` adds the keys that are
resolved rather than written (the model shape, the tokenizer, the dtype), and
``run_identity`` compares both on resume.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

IDENTITY: dict[str, Any] = {"identity": True}


def is_identity_field(info: FieldInfo) -> bool:
    extra = info.json_schema_extra
    return isinstance(extra, dict) and extra.get("identity") is True


def identity_fields(model: type[BaseModel], prefix: str = "") -> tuple[str, ...]:
    """Dotted keys of the fields of ``model`` marked ``IDENTITY``, nested sections walked."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        key = prefix + name
        if is_identity_field(info):
            out.append(key)
        elif isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out.extend(identity_fields(info.annotation, key + "."))
    return tuple(out)
