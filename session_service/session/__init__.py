"""One session: its state, what its client sends, what its worker answers, failover.

``manager`` (``SessionManager``: open, resume, drain), and ``SessionRunner`` in layers, state at
the bottom: ``state`` (``SessionState``: the session's state and synchronous transitions, no
I/O), ``failover`` (worker binding, replay, restart, recover), ``client_events`` (the client's
events), ``runner`` (the asyncio shell: one session's ordered mailbox, deadlines, dispatch).
Around them: ``worker_output`` (worker output meets the session: every epoch/turn comparison,
where stale output is fenced), ``outbound`` (the one queue to the client), ``emitter`` (event
numbering), ``ack_window``, ``response``, ``replay`` (the turn's input, kept so a turn survives
its worker), ``settings`` (wire settings), ``lifecycle`` (the status enums, ``CloseReason`` and
``DropReason``), ``mailbox``, ``answer_order`` (appends applied in the client stream's reader,
answered in order once written). A session ends in ``SessionState._close`` (the runner's override
also stops its tasks), always with a ``CloseReason``.
"""
