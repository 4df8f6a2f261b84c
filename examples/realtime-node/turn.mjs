// One spoken turn with the duplex Realtime edge, through the official `openai` package's own
// Realtime client (OpenAIRealtimeWS, on the `ws` package):
//
//   connect (model, API key) -> session.update (audio/pcm 24 kHz in and out)
//   -> the recording as input_audio_buffer.append, paced like a microphone, then ~2 s of silence
//   -> server VAD ends the turn -> response.output_audio.delta ... response.done
//
// Prints one JSON line (event counts, audio received, the response's status) and exits 0 when
// the response completed; exits 1 on an `error` event or a dropped connection, 2 on a timeout.
//
//   node turn.mjs BASE_URL MODEL AUDIO
//
// Or with environment variables instead of the arguments:
//   REALTIME_BASE_URL  the SDK's base URL (default http://127.0.0.1:8765/v1; ws:// and wss:// do too)
//   REALTIME_MODEL     the model (default parrot)
//   REALTIME_AUDIO     the recording: 24 kHz mono 16-bit PCM, a WAV file or raw
// OPENAI_API_KEY is the API key (any string for a local stack without auth);
// REALTIME_TIMEOUT_MS bounds the whole turn (default 60000).

import { readFileSync } from 'node:fs';
import net from 'node:net';
import OpenAI from 'openai';
import { OpenAIRealtimeWS } from 'openai/realtime/ws';

const RATE = 24000; // audio/pcm: 16-bit little-endian mono at 24 kHz
const CHUNK_MS = 20;
const CHUNK_BYTES = (RATE / 1000) * CHUNK_MS * 2;
const SILENCE_MS = 2000;

const [
  baseArg = process.env.REALTIME_BASE_URL ?? 'http://127.0.0.1:8765/v1',
  model = process.env.REALTIME_MODEL ?? 'parrot',
  audioPath = process.env.REALTIME_AUDIO,
] = process.argv.slice(2);
const apiKey = process.env.OPENAI_API_KEY ?? 'local';
const timeoutMs = Number(process.env.REALTIME_TIMEOUT_MS ?? 60000);
if (!audioPath) {
  console.error('usage: node turn.mjs BASE_URL MODEL AUDIO   (AUDIO: 24 kHz mono 16-bit PCM, WAV or raw)');
  process.exit(64);
}

/** The PCM16 samples of a 24 kHz mono 16-bit WAV file, or the file itself when it is raw PCM. */
function readPcm24k(path) {
  const file = readFileSync(path);
  if (file.toString('ascii', 0, 4) !== 'RIFF' || file.toString('ascii', 8, 12) !== 'WAVE') {
    return file.subarray(0, file.length - (file.length % 2));
  }
  let fmt = null;
  for (let at = 12; at + 8 <= file.length; ) {
    const id = file.toString('ascii', at, at + 4);
    const size = file.readUInt32LE(at + 4);
    const body = file.subarray(at + 8, Math.min(at + 8 + size, file.length));
    if (id === 'fmt ') {
      fmt = { channels: body.readUInt16LE(2), rate: body.readUInt32LE(4), bits: body.readUInt16LE(14) };
    } else if (id === 'data') {
      if (!fmt || fmt.channels !== 1 || fmt.rate !== RATE || fmt.bits !== 16) {
        throw new Error(`${path}: expected 24 kHz mono 16-bit PCM, got ${JSON.stringify(fmt)}`);
      }
      return body;
    }
    at += 8 + size + (size % 2);
  }
  throw new Error(`${path}: no data chunk`);
}

const speech = readPcm24k(audioPath);
const audio = Buffer.concat([speech, Buffer.alloc((RATE / 1000) * SILENCE_MS * 2)]);

// The SDK takes an http(s) base URL and always dials wss:// (TLS). A local edge without TLS is
// plain ws://, so for an http:// or ws:// base URL the socket is opened as plain TCP instead.
const plain = /^(http|ws):/.test(baseArg);
const baseURL = baseArg.replace(/^ws(s?):/, 'http$1:');
const client = new OpenAI({ apiKey, baseURL });
const options = plain ? { createConnection: (opts) => net.connect(opts.port, opts.host) } : {};
const rt = new OpenAIRealtimeWS({ model, options }, client);

const seen = {}; // event type -> how many
let audioBytes = 0;
let sending = null; // the timer of the next append
let streamFrom = 0;
const started = Date.now();

function finish(code, summary, problem) {
  if (process.exitCode !== undefined) return; // finished already
  clearTimeout(timer);
  clearTimeout(sending);
  if (summary) console.log(JSON.stringify(summary));
  if (problem) console.error(problem);
  process.exitCode = code;
  rt.close();
  setTimeout(() => process.exit(code), 2000).unref(); // should the close handshake hang
}

const timer = setTimeout(
  () => finish(2, null, `timeout after ${timeoutMs} ms; events so far: ${JSON.stringify(seen)}`),
  timeoutMs,
);

/** Appends the audio in 20 ms chunks at the pace it plays, as a microphone would. */
function stream(i = 0) {
  const chunk = audio.subarray(i * CHUNK_BYTES, (i + 1) * CHUNK_BYTES);
  if (chunk.length === 0) return;
  if (i === 0) streamFrom = Date.now();
  rt.send({ type: 'input_audio_buffer.append', audio: chunk.toString('base64') });
  const due = streamFrom + (i + 1) * CHUNK_MS;
  sending = setTimeout(() => stream(i + 1), Math.max(0, due - Date.now()));
}

rt.on('error', (err) => finish(1, null, `error: ${err.message}`));
rt.socket.on('close', (code, reason) => finish(1, null, `connection closed: ${code} ${reason}`));

rt.on('event', (event) => {
  seen[event.type] = (seen[event.type] ?? 0) + 1;
});

rt.on('session.created', () => {
  rt.send({
    type: 'session.update',
    session: {
      type: 'realtime',
      audio: {
        input: { format: { type: 'audio/pcm', rate: RATE } },
        output: { format: { type: 'audio/pcm', rate: RATE } },
      },
    },
  });
  stream();
});

rt.on('response.output_audio.delta', (event) => {
  audioBytes += Buffer.from(event.delta, 'base64').length;
});

rt.on('response.done', ({ response }) => {
  const summary = {
    status: response.status,
    response_id: response.id,
    audio_bytes: audioBytes,
    audio_ms: Math.round((audioBytes / 2 / RATE) * 1000),
    sent_ms: Math.round((audio.length / 2 / RATE) * 1000),
    elapsed_ms: Date.now() - started,
    events: seen,
  };
  if (response.status === 'completed') finish(0, summary);
  else finish(1, summary, `response ${response.status}: ${JSON.stringify(response.status_details)}`);
});
