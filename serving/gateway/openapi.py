"""The gateway's OpenAPI document: request bodies for routes that parse their own body.

The completion, feedback and admin routes read the raw body themselves (size and time limits, the
JSON policy, errors naming the field), so FastAPI cannot see their models. :func:`body_schema` gives
such a route its ``requestBody`` (``openapi_extra``) and remembers the model; :func:`install`
adds the models those bodies refer to (``$defs``) to the document's components, so the document
(and schema fuzzers reading it) knows what each route accepts.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

REF_TEMPLATE = "#/components/schemas/{model}"

#: Every model a route's body schema names, in the order the routes were declared.
_BODIES: list[type[BaseModel]] = []


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` of a route whose (required) JSON body is ``model``."""
    if model not in _BODIES:
        _BODIES.append(model)
    schema = model.model_json_schema(ref_template=REF_TEMPLATE)
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def optional_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """:func:`body_schema` for a route whose body may be left out (every field has a default)."""
    extra = body_schema(model)
    extra["requestBody"]["required"] = False
    return extra


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` add the body models' definitions to the generated components."""
    generate = app.openapi

    def openapi_with_bodies() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _BODIES:
                components.update(model.model_json_schema(ref_template=REF_TEMPLATE).get("$defs", {}))
        return app.openapi_schema

    app.openapi = openapi_with_bodies  # type: ignore[method-assign]
