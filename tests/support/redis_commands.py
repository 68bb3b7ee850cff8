"""Counting the Redis round trips a piece of code makes."""

from __future__ import annotations

import threading


def commands_sent(client) -> list:
    """Every command `client` sends from the calling thread from now on, in order. A
    scheduler's client is shared with its presence thread, whose batches (a DEL before
    a rewrite) come when they come and are not the caller's."""
    sent: list = []
    send, caller = client.execute_command, threading.get_ident()

    def counted(*args, **kwargs):
        if threading.get_ident() == caller:
            sent.append(args[0])
        return send(*args, **kwargs)

    client.execute_command = counted
    return sent
