"""Errors a user can cause. The CLI turns each into one line and exit code 2."""


class KvclusterError(Exception):
    """Base class for errors caused by user input (bad config, bad name, bad file)."""


class ConfigError(KvclusterError):
    """A model, tier or cluster config is missing, malformed or inconsistent."""


class TraceError(KvclusterError):
    """A trace file is missing or malformed; the message names the line."""
