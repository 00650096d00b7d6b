"""The project's one error base class (here, in the package everything else may import).

Every domain error (bad settings, a missing model, a full KV cache, a failed request...)
derives from :class:`LongSparkError` as well as from the builtin it is a kind of, so the
CLI and the API map errors by type: a ``LongSparkError``'s message is written for users
and is shown as it is; anything else is shown with its type name.
"""

from __future__ import annotations


class LongSparkError(Exception):
    """A failure whose message is written for the user (one line)."""
