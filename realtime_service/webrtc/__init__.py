"""WebRTC on the Realtime edge, in OpenAI's GA shape (``POST /v1/realtime/calls``), built on aiortc
(PyAV's Opus): a call is a second transport for the same conversation as a WebSocket's.

- ``offer``: a browser's SDP offer checked before anything is set up for it. No I/O.
- ``playout``: the model's audio waiting to be played on a call's track, and what was played
  (``output_audio_buffer.*``, truncation where the user was heard). No I/O.
- ``media``: the reply as a track paced in real time; the microphone into the session's format.
- ``call``: the call's ``ClientSocket`` (data channel ``oai-events`` and microphone) and its
  ``Connection`` (reply audio on the track, barge-in by the edge).
- ``calls``: the calls of an edge: set up, bounded, watched (ICE/DTLS timeouts, a vanished
  browser), counted.
- ``ice``: which addresses and UDP ports ICE uses.
"""
