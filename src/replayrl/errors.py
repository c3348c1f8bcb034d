"""The one exception type a user can cause.

Errors a user can fix (bad config, missing checkpoint, unreachable store, malformed data)
raise `ReplayRLError` with the fix in the message; the CLI prints it on one line without a
traceback and exits non-zero. Bugs raise whatever they raise.
"""


class ReplayRLError(Exception):
    """A problem the user can fix; the message says what is wrong and how to fix it."""


class StaleOwnerError(ReplayRLError):
    """This process's lease on a lineage was taken over by a newer owner (a higher fencing
    epoch): it must stop without writing anything more to that lineage."""
