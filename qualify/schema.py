"""The one JSON Schema validation of qualify (Draft 2020-12, ``contracts/schema/``).

Stricter than the draft in one place: ``"type": "integer"`` accepts only a JSON integer
(a Python ``int``, never ``bool``), not a float with a zero fraction. The draft counts
``2.0`` as an integer, but every stage indexes, ranges and shapes with these fields:
``rounds = 2.0`` passes the draft and crashes ``range()``, a prompt id ``1.0`` crashes an
embedding lookup. TOML and Python's JSON parser both give ``int`` for integer literals, so
only a document that wrote ``2.0`` is refused.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, Final

import jsonschema

from qualify.errors import QualifyError
from qualify.resources import load_schema

__all__ = ["STRICT_VALIDATOR", "definition_validator", "first_error", "validate", "validator"]


def _is_integer(_checker: object, instance: object) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


STRICT_VALIDATOR: Final = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer),
)
"""Draft 2020-12 whose ``integer`` type is a JSON integer only (the module docstring)."""


@functools.cache
def validator(name: str) -> jsonschema.protocols.Validator:
    """The cached :data:`STRICT_VALIDATOR` of ``contracts/schema/<name>.schema.json``.

    Raises:
        QualifyError: the schema file is missing (a broken installation).
    """
    return STRICT_VALIDATOR(load_schema(name))


@functools.cache
def definition_validator(name: str, definition: str) -> jsonschema.protocols.Validator:
    """The cached validator of ``$defs/<definition>`` of schema ``name`` (e.g. one report row).

    Raises:
        QualifyError: the schema file is missing, or has no such definition.
    """
    schema = load_schema(name)
    defs = schema.get("$defs", {})
    if definition not in defs:
        raise QualifyError(f"{name}.schema.json has no $defs/{definition}")
    return STRICT_VALIDATOR({"$ref": f"#/$defs/{definition}", "$defs": defs})


def first_error(obj: Any, name: str, *, definition: str | None = None) -> str | None:
    """``"<field>: <message>"`` of the most relevant violation of schema ``name``, or None.

    The field is the dotted path into ``obj`` (``(top level)`` for the root). With
    ``definition``, ``obj`` is checked against that ``$defs`` entry of the schema only.
    """
    v = validator(name) if definition is None else definition_validator(name, definition)
    err = jsonschema.exceptions.best_match(v.iter_errors(obj))
    if err is None:
        return None
    field = ".".join(str(p) for p in err.absolute_path) or "(top level)"
    return f"{field}: {err.message}{_did_you_mean(err)}"


def _did_you_mean(err: jsonschema.exceptions.ValidationError) -> str:
    """The hint appended to an ``additionalProperties`` violation, ``""`` for any other.

    ``"; 'k': did you mean 'x'?"`` for each unexpected key ``k`` close to an allowed one
    ``x`` (:func:`difflib.get_close_matches`, its default cutoff 0.6).
    """
    if err.validator != "additionalProperties" or not isinstance(err.instance, dict):
        return ""
    allowed = err.schema.get("properties", {}) if isinstance(err.schema, dict) else {}
    if not isinstance(allowed, dict):
        return ""
    hints = []
    for key in err.instance:
        if key in allowed or not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key, list(allowed), n=1)
        if close:
            hints.append(f"{key!r}: did you mean {close[0]!r}?")
    return f"; {'; '.join(hints)}" if hints else ""


def validate(obj: Any, name: str, *, what: str = "document",
             error: type[QualifyError] = QualifyError) -> None:
    """Validate ``obj`` against schema ``name``; raise ``error`` naming ``what`` and the field.

    Args:
        obj: the JSON-compatible value.
        name: schema stem, e.g. ``manifest``, ``contract``, ``outputs``.
        what: the document's name for the message (a path, usually).
        error: the class raised: :class:`~qualify.errors.QualifyError` for a document
            qualify wrote itself (a bug), a user-facing subclass for input.

    Raises:
        QualifyError: (or ``error``) the value violates the schema.
    """
    problem = first_error(obj, name)
    if problem is not None:
        raise error(f"{what}: {problem} (schema {name}.schema.json)")
