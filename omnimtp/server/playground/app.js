// The omnimtp playground: Talk (/v1/realtime), Speak (/v1/audio/speech) and Clone (/v1/audio/voices), using
// only the server's public API. Audio is 16-bit mono PCM at 24 kHz both ways. `window.playground` keeps what
// each tab last played (the tests read it back).
"use strict";

const RATE = 24000;
const KEY_STORAGE = "omnimtp-api-key";
const $ = (id) => document.getElementById(id);
const playground = { model: null, card: null, played: { talk: [], speak: [] }, lastError: null };
window.playground = playground;

// -- the API key and requests --------------------------------------------------------------------

function apiKey() { return sessionStorage.getItem(KEY_STORAGE); }

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

class ServerError extends Error {}

// The server's own wording of an error body ({"error": {"message"}}), else the status line.
async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON: the status line */ }
  return new ServerError(message);
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: { ...authHeaders(), ...(options.headers || {}) } });
  if (response.status === 401) askForKey();
  if (!response.ok) throw await errorOf(response);
  return response;
}

function showError(where, error) {
  const box = $(`${where}-error`);
  if (error == null) { box.hidden = true; box.textContent = ""; return; }
  const message = error instanceof Error ? error.message : String(error);
  playground.lastError = message;
  box.textContent = message;
  box.hidden = false;
}

function askForKey() {
  $("key-form").hidden = false;
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("key-input").value.trim());
  $("key-form").hidden = true;
  start();
});

// -- audio: PCM16, playback, waveform ---------------------------------------------------------------

let audioContext = null;
function context() {
  if (!audioContext) audioContext = new AudioContext({ sampleRate: RATE });
  if (audioContext.state === "suspended") audioContext.resume();
  return audioContext;
}

// Plays PCM16 chunks back to back as they arrive and keeps every sample it was given.
class Player {
  constructor(tab) {
    this.samples = [];
    this.sources = [];
    this.next = 0;
    playground.played[tab] = this.samples;
  }
  push(int16) {
    if (!int16.length) return;
    for (const value of int16) this.samples.push(value);
    const ctx = context();
    const buffer = ctx.createBuffer(1, int16.length, RATE);
    const channel = buffer.getChannelData(0);
    for (let i = 0; i < int16.length; i++) channel[i] = int16[i] / 32768;
    const source = ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(ctx.destination);
    this.next = Math.max(this.next, ctx.currentTime + 0.05);
    source.start(this.next);
    this.next += buffer.duration;
    this.sources.push(source);
  }
  stop() {
    for (const source of this.sources) { try { source.stop(); } catch (_) { /* already ended */ } }
    this.sources = [];
  }
}

// Splits a byte stream into whole little-endian 16-bit samples, carrying an odd byte to the next chunk.
class PCMReader {
  constructor() { this.rest = new Uint8Array(0); }
  feed(bytes) {
    const all = new Uint8Array(this.rest.length + bytes.length);
    all.set(this.rest);
    all.set(bytes, this.rest.length);
    const whole = all.length - (all.length % 2);
    this.rest = all.slice(whole);
    const view = new DataView(all.buffer, 0, whole);
    const out = new Int16Array(whole / 2);
    for (let i = 0; i < out.length; i++) out[i] = view.getInt16(2 * i, true);
    return out;
  }
}

function base64ToInt16(data) {
  const raw = atob(data);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return new PCMReader().feed(bytes);
}

function int16ToBase64(int16) {
  const bytes = new Uint8Array(int16.buffer, int16.byteOffset, int16.byteLength);
  let raw = "";
  for (let i = 0; i < bytes.length; i += 0x8000) raw += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(raw);
}

function floatToInt16(floats) {
  const out = new Int16Array(floats.length);
  for (let i = 0; i < floats.length; i++) out[i] = Math.max(-32768, Math.min(32767, Math.round(floats[i] * 32767)));
  return out;
}

function wavFile(int16) {
  const header = new DataView(new ArrayBuffer(44));
  const text = (offset, s) => { for (let i = 0; i < s.length; i++) header.setUint8(offset + i, s.charCodeAt(i)); };
  text(0, "RIFF"); header.setUint32(4, 36 + int16.byteLength, true); text(8, "WAVE");
  text(12, "fmt "); header.setUint32(16, 16, true); header.setUint16(20, 1, true); header.setUint16(22, 1, true);
  header.setUint32(24, RATE, true); header.setUint32(28, RATE * 2, true); header.setUint16(32, 2, true);
  header.setUint16(34, 16, true); text(36, "data"); header.setUint32(40, int16.byteLength, true);
  return new Blob([header, int16], { type: "audio/wav" });
}

// The waveform of `samples` (a min/max envelope per pixel column).
function drawWaveform(canvas, samples) {
  const width = canvas.width = canvas.clientWidth || 600;
  const height = canvas.height = 64;
  const g = canvas.getContext("2d");
  g.fillStyle = "#f9fafb"; g.fillRect(0, 0, width, height);
  g.strokeStyle = "#2d5be3"; g.beginPath();
  const perColumn = Math.max(1, Math.floor(samples.length / width));
  for (let x = 0; x < width && x * perColumn < samples.length; x++) {
    let low = 0, high = 0;
    for (let i = x * perColumn; i < Math.min(samples.length, (x + 1) * perColumn); i++) {
      low = Math.min(low, samples[i]); high = Math.max(high, samples[i]);
    }
    g.moveTo(x + 0.5, height / 2 - (high / 32768) * (height / 2));
    g.lineTo(x + 0.5, height / 2 - (low / 32768) * (height / 2) + 1);
  }
  g.stroke();
}

// In-place radix-2 FFT of (re, im), whose length is a power of two.
function fft(re, im) {
  const n = re.length;
  for (let i = 1, j = 0; i < n; i++) {
    let bit = n >> 1;
    for (; j & bit; bit >>= 1) j ^= bit;
    j ^= bit;
    if (i < j) { [re[i], re[j]] = [re[j], re[i]]; [im[i], im[j]] = [im[j], im[i]]; }
  }
  for (let size = 2; size <= n; size <<= 1) {
    const step = -2 * Math.PI / size;
    for (let start = 0; start < n; start += size) {
      for (let k = 0; k < size / 2; k++) {
        const wr = Math.cos(step * k), wi = Math.sin(step * k);
        const a = start + k, b = a + size / 2;
        const tr = re[b] * wr - im[b] * wi, ti = re[b] * wi + im[b] * wr;
        re[b] = re[a] - tr; im[b] = im[a] - ti; re[a] += tr; im[a] += ti;
      }
    }
  }
}

// The spectrogram of `samples`: one Hann-windowed 512-point frame per pixel column, 0–12 kHz bottom to top,
// log magnitude over an 80 dB range below the loudest bin.
function drawSpectrogram(canvas, samples) {
  const size = 512, bins = size / 2;
  const width = canvas.width = canvas.clientWidth || 600;
  const height = canvas.height = 96;
  const columns = Math.min(width, Math.max(1, Math.floor(samples.length / 128)));
  const hop = Math.max(1, Math.floor((samples.length - size) / columns));
  const decibels = [];
  let loudest = -Infinity;
  for (let c = 0; c < columns; c++) {
    const re = new Float64Array(size), im = new Float64Array(size);
    for (let i = 0; i < size; i++) {
      const sample = samples[c * hop + i] || 0;
      re[i] = (sample / 32768) * (0.5 - 0.5 * Math.cos((2 * Math.PI * i) / size));
    }
    fft(re, im);
    const column = new Float64Array(bins);
    for (let k = 0; k < bins; k++) {
      column[k] = 10 * Math.log10(re[k] * re[k] + im[k] * im[k] + 1e-12);
      loudest = Math.max(loudest, column[k]);
    }
    decibels.push(column);
  }
  const g = canvas.getContext("2d");
  const image = g.createImageData(width, height);
  for (let x = 0; x < width; x++) {
    const column = decibels[Math.min(columns - 1, Math.floor((x * columns) / width))];
    for (let y = 0; y < height; y++) {
      const level = Math.max(0, Math.min(1, (column[Math.floor(((height - 1 - y) * bins) / height)] - loudest + 80) / 80));
      const offset = 4 * (y * width + x);
      image.data[offset] = 255 * level; image.data[offset + 1] = 200 * level * level;
      image.data[offset + 2] = 90 + 120 * (1 - level); image.data[offset + 3] = 255;
    }
  }
  g.putImageData(image, 0, 0);
}

function drawReply(reply, samples) {
  drawWaveform(reply.canvas, samples);
  if (samples.length) drawSpectrogram(reply.spectrogram, samples);
}

// A reply's block in a tab's list: its waveform canvas, a line of text and whatever links it gets.
function newReply(tab, title) {
  const block = document.createElement("div");
  block.className = "reply";
  const heading = document.createElement("div");
  heading.className = "muted";
  heading.textContent = title;
  const transcript = document.createElement("p");
  transcript.className = "transcript";
  const canvas = document.createElement("canvas");
  const spectrogram = document.createElement("canvas");
  spectrogram.className = "spectrogram";
  block.append(heading, transcript, canvas, spectrogram);
  $(`${tab}-replies`).prepend(block);
  return { block, transcript, canvas, spectrogram };
}

// -- tabs -------------------------------------------------------------------------------------------

function selectTab(name) {
  for (const button of document.querySelectorAll("#tabs button")) {
    const selected = button.dataset.tab === name;
    button.setAttribute("aria-selected", String(selected));
    $(button.dataset.tab).hidden = !selected;
  }
}
for (const button of document.querySelectorAll("#tabs button")) {
  button.addEventListener("click", () => selectTab(button.dataset.tab));
}

function fillSelect(select, values, selected) {
  select.replaceChildren(...values.map((value) => new Option(value, value, false, value === selected)));
}

// -- start: what the model serves -------------------------------------------------------------------

async function start() {
  $("page-error").hidden = true;
  let models;
  try {
    models = await (await api("/v1/models")).json();
  } catch (error) {
    $("page-error").textContent = error.message;  // "Incorrect or missing API key" beside the key form
    $("page-error").hidden = false;
    return;
  }
  const card = models.data[0];
  playground.model = card.id;
  playground.card = card;
  $("model-name").textContent = `${card.id} (${card.family || "model"})`;
  const hasTalk = (card.endpoints || []).includes("/v1/realtime");
  const isBase = card.task_type === "Base";
  $("tab-talk").hidden = !hasTalk;
  $("tab-speak").hidden = false;
  $("tab-clone").hidden = !isBase;
  fillSelect($("talk-voice"), card.voices || [], (card.voices || [])[0]);
  $("speak-language-label").hidden = !card.languages;
  fillSelect($("speak-language"), card.languages || [], "auto");
  $("speak-instructions-label").hidden = !card.takes_instructions;
  await refreshVoices();
  selectTab(hasTalk ? "talk" : "speak");
  document.body.dataset.ready = "true";
}

async function refreshVoices() {
  const card = playground.card;
  let uploaded = [];
  let own = card.voices || [];
  try {
    const listed = await (await api("/v1/audio/voices")).json();
    own = listed.voices;
    uploaded = listed.uploaded_voices || [];
  } catch (error) {
    showError("speak", error);
  }
  const current = $("speak-voice").value;
  const names = [...own, ...uploaded.map((voice) => voice.name)];
  fillSelect($("speak-voice"), names, names.includes(current) ? current : names[0]);
  // a Base model with no saved voice speaks too (in the server's default voice): Speak stays enabled
  const list = $("clone-voices");
  list.replaceChildren(...uploaded.map((voice) => {
    const item = document.createElement("li");
    item.dataset.voice = voice.name;
    item.append(`${voice.name} (${voice.mode}, ${Number(voice.seconds).toFixed(1)} s)`);
    const speak = document.createElement("button");
    speak.textContent = "Speak with it";
    speak.addEventListener("click", () => { $("speak-voice").value = voice.name; selectTab("speak"); });
    const remove = document.createElement("button");
    remove.textContent = "Delete";
    remove.addEventListener("click", async () => {
      try {
        await api(`/v1/audio/voices/${encodeURIComponent(voice.name)}`, { method: "DELETE" });
        showError("clone", null);
      } catch (error) { showError("clone", error); }
      await refreshVoices();
    });
    item.append(speak, remove);
    return item;
  }));
}

// -- Speak ------------------------------------------------------------------------------------------

const MEDIA = {
  wav: "audio/wav", pcm: "application/octet-stream", flac: "audio/flac", mp3: "audio/mpeg", opus: "audio/ogg",
  aac: "audio/aac",
};
const STREAMED_PCM = new Set(["wav", "pcm"]); // played as the bytes come; the others are decoded whole

$("speak-go").addEventListener("click", async () => {
  showError("speak", null);
  const format = $("speak-format").value;
  const body = { model: playground.model, input: $("speak-text").value, response_format: format };
  if ($("speak-voice").value) body.voice = $("speak-voice").value;
  if (!$("speak-language-label").hidden) body.language = $("speak-language").value;
  const instructions = $("speak-instructions").value.trim();
  if (!$("speak-instructions-label").hidden && instructions) body.instructions = instructions;
  if ($("speak-seed").value !== "") body.seed = Number($("speak-seed").value);
  const button = $("speak-go");
  button.disabled = true;
  const began = performance.now();
  const player = new Player("speak");
  const reply = newReply("speak", `${body.voice || "default voice"} · ${format}`);
  try {
    const response = await api("/v1/audio/speech", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    const parts = [];
    const pcm = new PCMReader();
    let header = format === "wav" ? 44 : 0; // the streamed WAV header (sizes unknown), then PCM
    const reader = response.body.getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      parts.push(value);
      if (!STREAMED_PCM.has(format)) continue; // a compressed file: decoded whole at the end
      let bytes = value;
      if (header > 0) { const skip = Math.min(header, bytes.length); bytes = bytes.subarray(skip); header -= skip; }
      const samples = pcm.feed(bytes);
      if (samples.length && $("speak-latency").dataset.pending !== "no") {
        $("speak-latency").textContent = `${Math.round(performance.now() - began)} ms`;
        $("speak-latency").dataset.pending = "no";
      }
      player.push(samples);
    }
    delete $("speak-latency").dataset.pending;
    const file = new Blob(parts, { type: MEDIA[format] });
    if (!STREAMED_PCM.has(format)) {
      const decoded = await context().decodeAudioData(await file.arrayBuffer());
      $("speak-latency").textContent = `${Math.round(performance.now() - began)} ms (whole file)`;
      player.push(floatToInt16(decoded.getChannelData(0)));
    }
    const link = document.createElement("a");
    link.href = URL.createObjectURL(file);
    link.download = `speech.${format}`;
    link.textContent = `Download (${format}, ${(player.samples.length / RATE).toFixed(2)} s)`;
    reply.block.append(link);
    reply.transcript.textContent = body.input;
    drawReply(reply, player.samples);
    const finish = response.headers.get("X-Finish-Reason");
    if (finish === "no_audio") reply.transcript.textContent += " (the model made no audio)";
  } catch (error) {
    showError("speak", error);
    reply.block.remove();
  } finally {
    button.disabled = false;
  }
});

// -- the microphone ---------------------------------------------------------------------------------

// Calls onSamples(Int16Array) with the microphone's audio at 24 kHz until stop() is called.
async function openMicrophone(onSamples) {
  const stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
  const ctx = context();
  const source = ctx.createMediaStreamSource(stream);
  // ScriptProcessor needs no module file to fetch; 4096 frames is 170 ms at 24 kHz.
  const processor = ctx.createScriptProcessor(4096, 1, 1);
  processor.onaudioprocess = (event) => onSamples(floatToInt16(event.inputBuffer.getChannelData(0)));
  const mute = ctx.createGain();
  mute.gain.value = 0;
  source.connect(processor);
  processor.connect(mute);
  mute.connect(ctx.destination);
  return () => {
    processor.disconnect(); source.disconnect(); mute.disconnect();
    for (const track of stream.getTracks()) track.stop();
  };
}

// -- Talk -------------------------------------------------------------------------------------------

const talk = { socket: null, vad: false, stopMic: null, recording: false, endOfSpeech: null, reply: null, player: null };

function send(event) { talk.socket.send(JSON.stringify(event)); }

function talkStatus(text) { $("talk-status").textContent = text; }

$("talk-connect").addEventListener("click", () => {
  if (talk.socket) { talk.socket.close(); return; }
  showError("talk", null);
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const protocols = ["realtime"];
  if (apiKey()) protocols.push(`openai-insecure-api-key.${apiKey()}`);
  const socket = new WebSocket(`${scheme}://${location.host}/v1/realtime?model=${encodeURIComponent(playground.model)}`,
    protocols);
  talk.socket = socket;
  talkStatus("connecting…");
  socket.onmessage = (message) => onTalkEvent(JSON.parse(message.data));
  socket.onclose = (event) => {
    talk.socket = null;
    if (talk.stopMic) { talk.stopMic(); talk.stopMic = null; }
    talk.recording = false;
    $("talk-connect").textContent = "Connect";
    $("talk-record").disabled = true;
    $("talk-record").classList.remove("recording");
    $("talk-record").textContent = "Talk";
    $("talk-stop").disabled = true;
    talkStatus(event.code === 1000 || event.code === 1005 ? "not connected" : `closed (${event.code} ${event.reason})`);
    if (event.code === 1006 && !event.wasClean) showError("talk", "the connection was refused or lost (is the API key right?)");
  };
});

async function startMicrophone() {
  talk.stopMic = await openMicrophone((samples) => {
    if (talk.socket && (talk.recording || talk.vad)) send({ type: "input_audio_buffer.append", audio: int16ToBase64(samples) });
  });
}

$("talk-record").addEventListener("click", async () => {
  const button = $("talk-record");
  if (talk.vad) return;
  if (!talk.recording) {
    showError("talk", null);
    if (talk.player) { talk.player.stop(); }
    if (!talk.stopMic) {
      try { await startMicrophone(); } catch (error) { showError("talk", `microphone: ${error.message}`); return; }
    }
    send({ type: "input_audio_buffer.clear" });
    talk.recording = true;
    button.textContent = "Send";
    button.classList.add("recording");
    talkStatus("listening…");
  } else {
    talk.recording = false;
    button.textContent = "Talk";
    button.classList.remove("recording");
    talk.endOfSpeech = performance.now();
    send({ type: "input_audio_buffer.commit" });
    send({ type: "response.create" });
    talkStatus("thinking…");
  }
});

$("talk-stop").addEventListener("click", () => { if (talk.socket) send({ type: "response.cancel" }); });

async function onTalkEvent(event) {
  switch (event.type) {
    case "session.created": {
      const detection = event.session.audio && event.session.audio.input && event.session.audio.input.turn_detection;
      talk.vad = Boolean(detection && detection.type === "server_vad");
      $("talk-mode").textContent = talk.vad
        ? "Server voice detection: just speak; the model answers when you pause."
        : "Push to talk: press Talk, speak, then press Send.";
      const voice = $("talk-voice").value;
      if (voice) send({ type: "session.update", session: { type: "realtime", audio: { output: { voice } } } });
      $("talk-connect").textContent = "Disconnect";
      $("talk-record").disabled = talk.vad;
      talkStatus(talk.vad ? "listening…" : "connected");
      if (talk.vad) {
        try { await startMicrophone(); } catch (error) { showError("talk", `microphone: ${error.message}`); }
      }
      break;
    }
    case "input_audio_buffer.speech_started":
      if (talk.player) talk.player.stop();
      talkStatus("hearing you…");
      break;
    case "input_audio_buffer.speech_stopped":
      talk.endOfSpeech = performance.now();
      talkStatus("thinking…");
      break;
    case "response.created":
      talk.player = new Player("talk");
      talk.reply = newReply("talk", "reply");
      $("talk-stop").disabled = false;
      $("talk-latency").textContent = "–";
      break;
    case "response.output_audio.delta":
      if (!talk.player) break;
      if (talk.player.samples.length === 0 && talk.endOfSpeech !== null) {
        $("talk-latency").textContent = `${Math.round(performance.now() - talk.endOfSpeech)} ms`;
      }
      talk.player.push(base64ToInt16(event.delta));
      talkStatus("speaking…");
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      if (talk.reply) talk.reply.transcript.textContent += event.delta;
      break;
    case "response.done": {
      const response = event.response;
      $("talk-stop").disabled = true;
      if (talk.reply && talk.player) drawReply(talk.reply, talk.player.samples);
      if (response.status === "failed" && response.status_details && response.status_details.error) {
        showError("talk", response.status_details.error.message || "the reply failed");
      }
      const reason = response.status_details && response.status_details.reason;
      talkStatus(response.status === "completed" ? (talk.vad ? "listening…" : "connected")
        : `reply ${response.status}${reason ? ` (${reason})` : ""}`);
      document.body.dataset.talkDone = String(Number(document.body.dataset.talkDone || 0) + 1);
      break;
    }
    case "error":
      showError("talk", event.error.message);
      break;
    default:
      break;
  }
}

// -- Clone ------------------------------------------------------------------------------------------

const clone = { recorded: null, stopMic: null };

$("clone-record").addEventListener("click", async () => {
  const button = $("clone-record");
  if (clone.stopMic) {
    clone.stopMic(); clone.stopMic = null;
    button.textContent = "Record"; button.classList.remove("recording");
    const all = Int16Array.from(clone.chunks.flatMap((chunk) => Array.from(chunk)));
    clone.recorded = wavFile(all);
    $("clone-recorded").textContent = `recorded ${(all.length / RATE).toFixed(1)} s (used instead of a file)`;
    return;
  }
  clone.chunks = [];
  try {
    clone.stopMic = await openMicrophone((samples) => clone.chunks.push(samples));
  } catch (error) { showError("clone", `microphone: ${error.message}`); return; }
  button.textContent = "Stop recording"; button.classList.add("recording");
  $("clone-recorded").textContent = "recording…";
});

$("clone-save").addEventListener("click", async () => {
  showError("clone", null);
  const form = new FormData();
  if (playground.model) form.append("model", playground.model);
  form.append("name", $("clone-name").value.trim());
  form.append("consent", $("clone-consent").value);
  const transcript = $("clone-transcript").value.trim();
  if (transcript) form.append("ref_text", transcript);
  const file = clone.recorded || $("clone-file").files[0];
  if (file) form.append("audio_sample", file, file.name || "recording.wav");
  $("clone-save").disabled = true;
  try {
    await api("/v1/audio/voices", { method: "POST", body: form });
    clone.recorded = null;
    $("clone-recorded").textContent = "";
    await refreshVoices();
  } catch (error) {
    showError("clone", error);
  } finally {
    $("clone-save").disabled = false;
  }
});

start();
