"""All checks of a pipeline document: the schema's and the operator's own (object names)."""

from __future__ import annotations

from typing import Any

from omnifleet_runtime.schema import OmniPipeline
from omnifleet_runtime.validate import Problem, parse_pipeline

from .names import check_names


def check_document(doc: Any) -> tuple[OmniPipeline | None, list[Problem]]:
    """The parsed pipeline (None when invalid) and every problem found."""
    parsed, problems = parse_pipeline(doc)
    if parsed is not None:
        problems = problems + check_names(parsed)
    return (None if problems else parsed), problems
