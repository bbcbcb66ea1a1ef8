"""Exercise (lesson 02): which rank's error is the root cause of a failed run."""

KNOCK_ON = ("connection reset", "connection closed", "timed out")


def root_cause_rank(errors: dict[int, str]) -> int | None:
    """The lowest rank whose error is not a knock-on error, or None if every error is one.

    A rank raises a knock-on error when a peer fails first: its connection to the peer closes,
    or its wait for the peer times out. If every rank's error is a knock-on, the rank that
    failed first died without raising (a signal, os._exit), so no error here is the cause."""
    own = [rank for rank, message in errors.items()
           if not any(word in message.lower() for word in KNOCK_ON)]
    return min(own) if own else None
