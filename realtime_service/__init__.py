"""The Realtime edge (``duplex realtime``): the OpenAI Realtime API over WebSocket, in front of
the session service.

Each WebSocket's conversation is a session of the session service; the sessions of one
credential share one ``ConverseMany`` stream per edge process. Where a frame goes:

- ``protocol``: a client's JSON event to a typed command (every bad event an ``error`` in
  OpenAI's shape), and the session object the edge reports. No I/O.
- ``conversation``: the session service's events to Realtime server events (items, responses,
  content parts), per connection. No I/O.
- ``outbound``: what waits to be written to one WebSocket, bounded; audio of a cancelled
  response leaves it unsent.
- ``connection``: the asyncio shell of one WebSocket (reader, pump, writer; resume after a
  dropped stream).
- ``server``: the WebSocket server (path, credentials, connection bounds, probes), the pool of
  ``ConverseMany`` streams, and ``cli`` (``duplex realtime``).
"""
