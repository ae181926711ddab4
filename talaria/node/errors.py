"""Errors an instance raises to the gateway; each maps to one HTTP status there."""


class InstanceUnavailable(Exception):
    """No healthy instance can serve the model right now (starting, restarting or overloaded): HTTP 503."""


class InstanceFailed(Exception):
    """The instance died or errored while serving this call; the call is lost, the instance restarts: HTTP 503 / stream error."""


class CallFailed(InstanceFailed):
    """The instance ended this call alone with an error (its grammar, its sampling, a prompt larger than
    the KV pool); the instance and its other calls go on: HTTP 500 / stream error."""
