#!/usr/bin/env node
// A Node client of duplex.v1.DuplexSession/Converse, written from docs/grpc-guide.md and proto/.
//
//   node client.js [TARGET] [IN.wav] [OUT.wav]      (defaults: 127.0.0.1:50051 ../hello.wav reply.wav)
//
// It does three things against a plaintext (local, `duplex up`) stack:
//   1. a conversation: open, stream a 16 kHz mono s16 WAV as 20 ms appends (seq 1, 2, 3...),
//      a second of silence so server turn detection ends the turn, collect the reply's audio
//      until response_done and write it as a WAV;
//   2. a resume: drop that stream, open a new call whose first event is `resume` with the
//      session id, the latest resume token and the last event id, and get `opened` again;
//   3. an error's stable code: an `open` naming the wrong model ends the call with
//      INVALID_ARGUMENT; the `grpc-status-details-bin` trailer is a google.rpc.Status whose
//      `details` hold a google.rpc.ErrorInfo (an Any) with the code in `reason`.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { once } = require('node:events');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const PROTO_DIR = path.join(__dirname, '..', '..', 'proto');
const [TARGET = '127.0.0.1:50051', IN_WAV = path.join(__dirname, '..', 'hello.wav'), OUT_WAV = 'reply.wav'] =
  process.argv.slice(2);

// The service, from the repository's proto/. camelCase field names; enums as strings; `oneofs`
// adds a virtual `event` field naming which event is set, camelCase too ('opened', 'audioDelta').
// uint64 fields (seq, epoch, audio_ms) become JS numbers: exact up to 2^53, which a conversation
// never reaches.
const packageDefinition = protoLoader.loadSync('duplex/v1/session.proto', {
  includeDirs: [PROTO_DIR],
  keepCase: false,
  longs: Number,
  enums: String,
  defaults: false,
  oneofs: true,
});
const { DuplexSession } = grpc.loadPackageDefinition(packageDefinition).duplex.v1;

// google.rpc.Status and ErrorInfo (proto/google/rpc/), to decode error details. proto-loader
// only makes services, so these messages are decoded with protobufjs (which proto-loader uses).
const rpcTypes = new protobuf.Root();
rpcTypes.resolvePath = (_origin, target) => path.join(PROTO_DIR, target);
rpcTypes.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
const Status = rpcTypes.lookupType('google.rpc.Status');
const ErrorInfo = rpcTypes.lookupType('google.rpc.ErrorInfo');

const S16_16K_MONO = { encoding: 'AUDIO_ENCODING_PCM_S16LE', sampleRateHz: 16000, channels: 1 };
const CHUNK_BYTES = 640; // 20 ms of 16 kHz mono s16
const MAX_UNACKED_MS = 2000; // the guide: keep at most ~2 s of audio sent but not acknowledged

/** The stable code of a failed call: ErrorInfo.reason from its grpc-status-details-bin trailer. */
function errorInfo(err) {
  const [bin] = err.metadata ? err.metadata.get('grpc-status-details-bin') : [];
  if (!bin) return null; // no details: not a refusal of the service (e.g. CANCELLED, a dropped connection)
  const status = Status.decode(bin); // {code, message, details: [Any]}
  for (const any of status.details) {
    if (any.type_url === 'type.googleapis.com/google.rpc.ErrorInfo') {
      return ErrorInfo.decode(any.value); // {reason, domain: "duplex.v1", metadata: {retryable: "true"?}}
    }
  }
  return null;
}

/** One Converse call: send(event), and next() for the server events, one at a time. */
function converse(client) {
  const call = client.Converse();
  const events = call[Symbol.asyncIterator](); // rejects with the call's status error when it fails
  let n = 0;
  return {
    call,
    async send(event) {
      if (!call.write({ eventId: `ce_${++n}`, ...event })) await once(call, 'drain');
    },
    async next() {
      const { value, done } = await events.next();
      return done ? null : value;
    },
  };
}

/** Reads a 16 kHz mono s16 WAV file; returns its PCM bytes. */
function readWav(file) {
  const buf = fs.readFileSync(file);
  if (buf.toString('ascii', 0, 4) !== 'RIFF' || buf.toString('ascii', 8, 12) !== 'WAVE') throw new Error(`${file}: not a WAV file`);
  let fmt = null;
  for (let at = 12; at + 8 <= buf.length; ) {
    const id = buf.toString('ascii', at, at + 4);
    const size = buf.readUInt32LE(at + 4);
    if (id === 'fmt ') fmt = { tag: buf.readUInt16LE(at + 8), channels: buf.readUInt16LE(at + 10), rate: buf.readUInt32LE(at + 12), bits: buf.readUInt16LE(at + 22) };
    if (id === 'data') {
      if (!fmt || fmt.tag !== 1 || fmt.channels !== 1 || fmt.rate !== 16000 || fmt.bits !== 16) throw new Error(`${file}: want 16 kHz mono 16-bit PCM`);
      return buf.subarray(at + 8, at + 8 + size);
    }
    at += 8 + size + (size & 1);
  }
  throw new Error(`${file}: no data chunk`);
}

function writeWav(file, pcm, { sampleRateHz, channels }) {
  const h = Buffer.alloc(44);
  h.write('RIFF', 0); h.writeUInt32LE(36 + pcm.length, 4); h.write('WAVEfmt ', 8);
  h.writeUInt32LE(16, 16); h.writeUInt16LE(1, 20); h.writeUInt16LE(channels, 22);
  h.writeUInt32LE(sampleRateHz, 24); h.writeUInt32LE(sampleRateHz * channels * 2, 28);
  h.writeUInt16LE(channels * 2, 32); h.writeUInt16LE(16, 34); h.write('data', 36); h.writeUInt32LE(pcm.length, 40);
  fs.writeFileSync(file, Buffer.concat([h, pcm]));
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---- 1. a conversation -------------------------------------------------------------------------
async function conversation(client) {
  const s = converse(client);
  await s.send({ open: { model: 'parrot', config: { inputFormat: S16_16K_MONO } } });
  const first = await s.next();
  if (first.event !== 'opened') throw new Error(`expected opened, got ${first.event}`);
  const { sessionId, epoch, resumeToken, config } = first.opened;
  console.log(`opened ${sessionId} epoch=${epoch} model=${first.opened.capabilities.model}`);
  if (config.outputFormat.encoding !== 'AUDIO_ENCODING_PCM_S16LE') throw new Error('this example writes s16 WAV only');

  // Keep what the stream needs for a resume: the latest token and the last event id.
  const state = { sessionId, resumeToken, lastEventId: first.eventId, acked: 0 };

  // The sender: the file then 1 s of silence, 20 ms per append, as fast as acks allow.
  const pcm = Buffer.concat([readWav(IN_WAV), Buffer.alloc(16000 * 2)]);
  const sender = (async () => {
    let seq = 0;
    for (let at = 0; at < pcm.length; at += CHUNK_BYTES) {
      while ((seq - state.acked) * 20 > MAX_UNACKED_MS) await sleep(5);
      await s.send({ append: { seq: ++seq, pcm: pcm.subarray(at, at + CHUNK_BYTES) } });
    }
    console.log(`sent ${(pcm.length / 32000).toFixed(2)} s of audio in ${seq} appends (the last second silence)`);
  })();

  // The reader: server events until the reply is done.
  const reply = [];
  for (;;) {
    const ev = await s.next();
    if (!ev) throw new Error('the stream ended before response_done');
    state.lastEventId = ev.eventId;
    switch (ev.event) {
      case 'inputAck': state.acked = ev.inputAck.seq; break; // the highest seq handed on (this epoch)
      case 'speechStarted': console.log(`speech started at ${ev.speechStarted.audioMs || 0} ms`); break;
      case 'speechStopped': console.log(`speech stopped at ${ev.speechStopped.audioMs} ms`); break;
      case 'committed': console.log(`committed turn ${ev.committed.turnId}`); break;
      case 'responseStarted': state.resumeToken = ev.responseStarted.resumeToken; console.log(`response started ${ev.responseStarted.responseId}`); break;
      case 'audioDelta': reply.push(ev.audioDelta.pcm); break;
      case 'error': console.log(`error event: ${ev.error.code}: ${ev.error.message}`); break; // the session goes on
      case 'responseDone': {
        const done = ev.responseDone;
        state.resumeToken = done.resumeToken;
        console.log(`response done ${done.status} ${done.audioMs} ms`);
        await sender;
        const audio = Buffer.concat(reply);
        writeWav(OUT_WAV, audio, config.outputFormat);
        console.log(`reply: ${OUT_WAV} ${audio.length} bytes ${(audio.length / 2 / config.outputFormat.sampleRateHz).toFixed(2)} s`);
        // No `close`: drop the stream, the session waits for a resume (--detached-grace-s, 30 s).
        s.call.cancel();
        return state;
      }
    }
  }
}

// ---- 2. a resume on a new call -----------------------------------------------------------------
async function resume(client, { sessionId, resumeToken, lastEventId }) {
  const s = converse(client);
  await s.send({ resume: { sessionId, resumeToken, lastEventId } });
  const ev = await s.next();
  if (ev.event !== 'opened') throw new Error(`expected opened, got ${ev.event}`);
  const o = ev.opened;
  console.log(`resumed: opened again ${o.sessionId} epoch=${o.epoch} turn_id=${o.turnId} last_response=${o.lastResponse ? o.lastResponse.status : 'none'} (event ${ev.eventId} after ${lastEventId})`);
  if (o.sessionId !== sessionId) throw new Error('resumed a different session');
  await s.send({ close: {} });
  for (let e; (e = await s.next()); ) if (e.event === 'closed') console.log(`closed: ${e.closed.reason}`);
}

// ---- 3. an error's stable code -----------------------------------------------------------------
async function wrongModel(client) {
  const s = converse(client);
  await s.send({ open: { model: 'no-such-model', config: { inputFormat: S16_16K_MONO } } });
  try {
    while (await s.next());
    throw new Error('an open of the wrong model was accepted');
  } catch (err) {
    if (err.code === undefined) throw err; // not a gRPC status
    const info = errorInfo(err);
    console.log(`refused: ${grpc.status[err.code]} reason=${info && info.reason} domain=${info && info.domain} retryable=${(info && info.metadata.retryable) || 'false'}`);
  }
}

async function main() {
  const client = new DuplexSession(TARGET, grpc.credentials.createInsecure()); // TLS: grpc.credentials.createSsl(ca)
  try {
    const state = await conversation(client);
    await resume(client, state);
    await wrongModel(client);
  } finally {
    client.close();
  }
}

main().catch((err) => {
  const info = err.metadata ? errorInfo(err) : null;
  console.error(`failed: ${err.message}${info ? ` (reason=${info.reason})` : ''}`);
  process.exit(1);
});
