"""The API: where a client's call enters and leaves.

``server`` (``SessionServer``: start, drain, stop), ``servicer`` (``Converse``: one session per
call), ``lanes`` (``ConverseMany``: many sessions on one call), ``calls`` (what both calls do
alike), ``admission`` (credentials and call slots, before any handler runs), ``cli``
(``duplex session``). A client's frame enters at ``servicer``/``lanes`` and is posted to its
session's runner (``session_service.session``).
"""
