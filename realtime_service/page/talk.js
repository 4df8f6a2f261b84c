// The edge's page: a WebRTC call written to OpenAI's WebRTC guide (getUserMedia, an
// RTCPeerConnection, the data channel "oai-events", the SDP offer POSTed to /v1/realtime/calls),
// against this edge: the base URL is the page's own origin.
"use strict";

const $ = (id) => document.getElementById(id);

// What the page has seen, for a person (shown) and for a test (read through the DevTools).
const talk = { pc: null, dc: null, mic: null, events: [], callId: null, error: null, peak: 0 };
window.duplexTalk = talk;

function status(text) {
  $("status").textContent = text;
}

function addEvent(event) {
  talk.events.push(event);
  const li = document.createElement("li");
  li.textContent = event.type + (event.response_id ? `  ${event.response_id}` : "");
  $("events").prepend(li);
  if ($("events").childElementCount > 300) $("events").lastElementChild.remove();
}

function line(role, text) {
  const p = document.createElement("p");
  p.className = role;
  p.textContent = `${role}: ${text}`;
  $("transcript").append(p);
  return p;
}

const replies = new Map();  // response id -> its line in the conversation

function onEvent(event) {
  addEvent(event);
  switch (event.type) {
    case "input_audio_buffer.speech_started":
      status("listening to you");
      break;
    case "input_audio_buffer.committed":
      line("user", "(spoke)");
      break;
    case "response.created":
      replies.set(event.response.id, line("assistant", "…"));
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta": {
      const p = replies.get(event.response_id);
      if (p) p.textContent = p.textContent.replace(/…$/, "") + event.delta;
      break;
    }
    case "output_audio_buffer.started":
      status("the model speaks");
      break;
    case "output_audio_buffer.stopped":
      status("your turn");
      break;
    case "output_audio_buffer.cleared":
      status("interrupted");
      break;
    case "conversation.item.truncated": {
      line("assistant", `(cut off after ${(event.audio_end_ms / 1000).toFixed(1)} s)`);
      break;
    }
    case "response.done": {
      const p = replies.get(event.response.id);
      if (p && p.textContent.endsWith("…")) p.textContent = `assistant: (${event.response.status})`;
      break;
    }
    case "error":
      line("error", `${event.error.code}: ${event.error.message}`);
      break;
  }
}

// The reply's loudness, for the meter (the remote stream is attached to <audio> too: WebAudio
// hears a remote WebRTC stream only once a media element plays it).
function meter(stream) {
  const ctx = new AudioContext();
  const analyser = ctx.createAnalyser();
  analyser.fftSize = 1024;
  ctx.createMediaStreamSource(stream).connect(analyser);
  const samples = new Float32Array(analyser.fftSize);
  const bar = $("level").firstElementChild;
  setInterval(() => {
    analyser.getFloatTimeDomainData(samples);
    let sum = 0;
    for (const v of samples) sum += v * v;
    const rms = Math.sqrt(sum / samples.length);
    talk.peak = Math.max(talk.peak, rms);
    bar.style.width = `${Math.min(100, rms * 400)}%`;
  }, 50);
}

async function start() {
  $("start").disabled = true;
  talk.error = null;
  try {
    status("asking for the microphone");
    const pc = new RTCPeerConnection();
    talk.pc = pc;
    const audio = $("remote");
    pc.ontrack = (e) => {
      audio.srcObject = e.streams[0];
      meter(e.streams[0]);
    };
    pc.onconnectionstatechange = () => {
      if (pc.connectionState === "failed" || pc.connectionState === "closed") stop("call ended");
    };
    talk.mic = await navigator.mediaDevices.getUserMedia({ audio: true });
    pc.addTrack(talk.mic.getTracks()[0]);

    const dc = pc.createDataChannel("oai-events");
    talk.dc = dc;
    dc.onmessage = (e) => onEvent(JSON.parse(e.data));
    dc.onclose = () => stop("call ended");

    status("calling");
    const offer = await pc.createOffer();
    await pc.setLocalDescription(offer);
    const headers = { "Content-Type": "application/sdp" };
    const key = $("key").value.trim();
    if (key) headers.Authorization = `Bearer ${key}`;
    const model = $("model").value.trim();
    const url = "/v1/realtime/calls" + (model ? `?model=${encodeURIComponent(model)}` : "");
    const response = await fetch(url, { method: "POST", body: offer.sdp, headers });
    if (response.status !== 201) {
      const body = await response.json().catch(() => ({}));
      throw new Error(body.error ? `${body.error.code}: ${body.error.message}` : `HTTP ${response.status}`);
    }
    talk.callId = (response.headers.get("Location") || "").split("/").pop();
    await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
    $("stop").disabled = false;
    status("connected: talk");
  } catch (err) {
    talk.error = String(err.message || err);
    line("error", talk.error);
    stop("failed");
  }
}

function stop(why) {
  const { pc, mic } = talk;
  talk.pc = talk.dc = talk.mic = null;  // first: closing fires the handlers that call stop again
  if (pc) pc.close();
  if (mic) mic.getTracks().forEach((t) => t.stop());
  $("start").disabled = false;
  $("stop").disabled = true;
  if (pc || why === "failed") status(why || "idle");
}

$("start").addEventListener("click", start);
$("stop").addEventListener("click", () => stop("hung up"));
