"""Background threads of the learner that run torch single-threaded (push thread, Channel-A prefetch).

Their torch work is small (casts, copies, a rope index); a parallel op there would start a second
OpenMP team next to the training thread's, and on a small box two teams oversubscribe the cores.
``torch.set_num_threads`` also sets the default that threads initialising torch later pick up, so
the starter restores its own count once the thread has taken its 1::

    starter: before = get_num_threads(); thread.start() ─► thread: pin_this_thread(), then ready.set()
    starter: ready.wait(deadline) ◄──────────────────────           (its count is 1 from here)
    starter: set_num_threads(before)  the process default again
"""

from __future__ import annotations

import threading

import torch


def pin_this_thread() -> int:
    """On the background thread, first thing: torch single-threaded here. Returns the thread's count."""
    torch.get_num_threads()  # initialise this thread's torch threading now, or its first parallel op
    torch.set_num_threads(1)  # would re-initialise it from the process default the starter restores
    return torch.get_num_threads()


def start_pinned(thread: threading.Thread, ready: threading.Event, timeout_s: float) -> bool:
    """Start ``thread`` (which calls :func:`pin_this_thread`, then sets ``ready``), wait up to ``timeout_s``
    for it, and restore this thread's count as the process default; False if it did not get ready."""
    before = torch.get_num_threads()
    thread.start()
    ok = ready.wait(timeout_s)
    torch.set_num_threads(before)
    return ok
