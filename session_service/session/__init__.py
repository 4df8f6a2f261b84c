"""One session: its state, what its client sends, what its worker answers, failover.

``manager`` (``SessionManager``: open, resume, drain), ``runner`` (``SessionRunner``: one
session's ordered mailbox and deadlines), ``worker_output`` (worker output meets the session:
every epoch/turn comparison, where stale output is fenced), ``outbound`` (the one queue to the
client), ``emitter`` (event numbering), ``ack_window``, ``response``, ``replay`` (the turn's
input, kept so a turn survives its worker), ``settings`` (wire settings), ``lifecycle`` (the
status enums), ``mailbox``. A session ends in ``runner`` (``SessionRunner._close``).
"""
