"""Traces of agent sessions: generate paper-calibrated ones, convert Mooncake's, summarise any.

The format is the contract in `talaria.contracts.trace` (docs/trace-format.md); `talaria trace`
is the command line over these modules.
"""
