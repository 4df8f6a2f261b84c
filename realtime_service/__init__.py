"""The Realtime edge (``duplex realtime``): the OpenAI Realtime API over WebSocket and WebRTC, in
front of the session service.

Each WebSocket's or WebRTC call's conversation is a session of the session service; the sessions
of one credential share one ``ConverseMany`` stream per edge process (``upstream``). Where a frame
goes:

- ``protocol``: a client's JSON event to a typed command (every bad event an ``error`` in
  OpenAI's shape), and the session object the edge reports. No I/O.
- ``conversation``: the session service's events to Realtime server events (items, responses,
  content parts), per connection. No I/O.
- ``outbound``: what waits to be written to one client, bounded; audio of a cancelled response
  leaves it unsent.
- ``connection``: the asyncio shell of one client, a ``ClientSocket`` (reader, pump, writer;
  resume after a dropped stream); ``websocket`` holds a WebSocket as one, ``webrtc`` a call.
- ``server``: the HTTP listener (aiohttp: WebSocket upgrades, the calls' routes of ``calls_api``
  with ``client_secrets`` and ``cors``, the ``page`` at ``/``, the probes, credentials by
  ``bearer``, refusals in ``responses``), and ``cli`` (``duplex realtime``).
"""
