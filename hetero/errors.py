"""Errors hetero raises on purpose.

Validate at the edges (CLI, `Runtime`, loaders) and raise one of these with a message that names the
argument, what was expected and what came; the CLI turns any `HeteroError` into one line and exit 2.
"""

from __future__ import annotations


class HeteroError(Exception):
    """Base of every error hetero raises deliberately."""


class ConfigError(HeteroError, ValueError):
    """A user-supplied value is wrong: which argument, what was expected, what came."""


class ModelFormatError(HeteroError, ValueError):
    """A model file is missing, truncated, corrupt or of an unsupported architecture."""


class ModelUnavailable(HeteroError):
    """The default model cannot be found or fetched (offline, no cached copy)."""


class MissingExtra(HeteroError, ImportError):
    """An optional part was used without the pip extra that brings its library (`hetero.extras`)."""


class BackendUnavailable(HeteroError):
    """A requested execution backend (e.g. QNN EP with HTP) is not present on this machine."""


class GraphCacheError(HeteroError):
    """A prebuilt-graph cache entry is stale or corrupt, or a graph failed to build."""


class ScheduleError(HeteroError):
    """The scheduler or executor failed (cyclic DAG, a subgraph raised, ...)."""
