// kvserve's chat page. It talks to this server's own OpenAI routes by relative URLs (so it also works behind a
// proxy that mounts kvserve under a path), keeps conversations in localStorage and renders answers as Markdown
// with raw HTML off. The page's Content-Security-Policy lets HTML reach the DOM only through `trusted` below.
import markdownit from "./vendor/markdown-it.esm.min.mjs";

const STORE = {
  conversations: "kvserve.conversations",
  current: "kvserve.current",
  settings: "kvserve.settings",
  apiKey: "kvserve.apiKey",
};
const DEFAULT_SETTINGS = { temperature: 0.7, maxTokens: 512, seed: "" };

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"),
  toggleChats: $("toggle-chats"),
  chats: $("chats"),
  newChat: $("new-chat"),
  list: $("conversations"),
  system: $("system"),
  temperature: $("temperature"),
  maxTokens: $("max-tokens"),
  seed: $("seed"),
  forgetKey: $("forget-key"),
  messages: $("messages"),
  error: $("error"),
  composer: $("composer"),
  message: $("message"),
  send: $("send"),
  stop: $("stop"),
  keyDialog: $("key-dialog"),
  keyForm: $("key-form"),
  keyReason: $("key-reason"),
  keyInput: $("api-key"),
  keyCancel: $("key-cancel"),
};

// --- Markdown, safely ----------------------------------------------------------------------------

// html: false escapes any HTML in the model's text; markdown-it's link check refuses javascript:, vbscript:,
// file: and data: URLs. Images are off: an answer never makes the browser fetch anything.
const md = markdownit({ html: false, linkify: false, typographer: false });
md.disable("image");
// Table alignment comes as inline style attributes, which the CSP (no 'unsafe-inline') refuses: use classes.
md.core.ruler.push("align_classes", (state) => {
  for (const token of state.tokens) {
    const style = token.attrGet("style");
    if (style && /^text-align:(left|center|right)$/.test(style)) {
      token.attrs = token.attrs.filter(([name]) => name !== "style");
      token.attrJoin("class", "align-" + style.slice("text-align:".length));
    }
  }
});
const defaultLinkOpen = md.renderer.rules.link_open || ((tokens, i, options, env, self) => self.renderToken(tokens, i, options));
md.renderer.rules.link_open = (tokens, i, options, env, self) => {
  tokens[i].attrSet("target", "_blank");
  tokens[i].attrSet("rel", "noopener noreferrer nofollow");
  return defaultLinkOpen(tokens, i, options, env, self);
};
// The one way HTML enters the page: markdown-it's output, which escapes every tag of the model's text.
const trusted = window.trustedTypes
  ? window.trustedTypes.createPolicy("kvserve-markdown", { createHTML: (text) => md.render(text) })
  : { createHTML: (text) => md.render(text) };

function renderMarkdown(element, text) {
  element.innerHTML = trusted.createHTML(text);
}

// --- storage -------------------------------------------------------------------------------------

function load(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value ?? fallback;
  } catch {
    return fallback;
  }
}

function save(key, value) {
  try {
    if (value === null) localStorage.removeItem(key);
    else localStorage.setItem(key, JSON.stringify(value));
  } catch (e) {
    showError(`Could not save in this browser's storage (${e.name}); delete some conversations.`);
  }
}

// Whatever another version of the page (or a hand edit) left in storage, keep only well-formed conversations.
const wellFormed = (c) =>
  c && typeof c.id === "string" && Array.isArray(c.messages) &&
  c.messages.every((m) => m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string" &&
    (m.reasoning === undefined || typeof m.reasoning === "string"));
let conversations = load(STORE.conversations, []);
conversations = Array.isArray(conversations) ? conversations.filter(wellFormed) : [];
for (const c of conversations) {
  c.title = String(c.title ?? "Chat");
  c.system = String(c.system ?? "");
  c.updated = Number(c.updated) || 0;
}
let currentId = load(STORE.current, null);
const settings = { ...DEFAULT_SETTINGS, ...load(STORE.settings, {}) };

const saveConversations = () => save(STORE.conversations, conversations);
const current = () => conversations.find((c) => c.id === currentId);

function newConversation() {
  // Not crypto.randomUUID(): browsers offer it only in secure contexts, and kvserve is often plain http on a LAN.
  const id = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
  const conversation = { id, title: "New chat", system: "", messages: [], updated: Date.now() };
  conversations.unshift(conversation);
  currentId = conversation.id;
  save(STORE.current, currentId);
  saveConversations();
  return conversation;
}

// --- talking to the server -----------------------------------------------------------------------

const server = { model: null, maxModelLen: null };
let generation = null; // {controller, stopped} while an answer streams

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = load(STORE.apiKey, null);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

class ApiFailure extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// An error response in words. The server's bodies are OpenAI's {"error": {"message": ...}}.
async function failure(response) {
  let detail = "";
  try {
    detail = (await response.json())?.error?.message ?? "";
  } catch {
    // not JSON: a proxy's page, say
  }
  const retry = response.headers.get("Retry-After");
  const words = {
    400: `The server refused the request (400 Bad Request): ${detail}`,
    401: "The server needs a valid API key (401 Unauthorized).",
    404: `Not found (404): ${detail}`,
    413: "The conversation is too large for the server (413); start a new chat.",
    429: `The server is busy: too many requests are waiting (429).${retry ? ` Try again in ${retry} s.` : ""}`,
    503: `The server is not ready (503): ${detail || "the model is loading or the server is shutting down"}.`,
  }[response.status];
  return new ApiFailure(response.status, words ?? `The server answered ${response.status}: ${detail}`);
}

const unreachable = () =>
  `Cannot reach the server at ${location.host}: is kvserve still running?`;

async function fetchModels() {
  let response;
  try {
    response = await fetch("v1/models", { headers: headers() });
  } catch {
    ui.model.textContent = "server unreachable";
    showError(unreachable());
    return;
  }
  if (response.ok) {
    const card = (await response.json()).data?.[0];
    server.model = card?.id ?? null;
    server.maxModelLen = card?.max_model_len ?? null;
    ui.model.textContent = server.model
      ? `${server.model}${server.maxModelLen ? ` · context ${server.maxModelLen} tokens` : ""}`
      : "no model";
    if (ui.error.dataset.kind === "connection") clearError();
    return;
  }
  const error = await failure(response);
  if (response.status === 401) {
    ui.model.textContent = "API key needed";
    askForKey(load(STORE.apiKey, null) ? "The server refused this API key (401 Unauthorized)." : "This server needs an API key.");
  } else if (response.status === 503) {
    ui.model.textContent = "loading…";
    setTimeout(fetchModels, 3000);
  } else {
    showError(error.message, "connection");
  }
}

// POST a chat request and stream its answer into `answer`, calling `update` after each piece.
async function streamChat(body, answer, update, signal) {
  const started = performance.now();
  let response;
  try {
    response = await fetch("v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiFailure(0, unreachable());
  }
  if (!response.ok) throw await failure(response);

  let first = null;
  let last = null;
  let pieces = 0;
  let usage = null;
  let done = false;
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  const handle = (data) => {
    if (data === "[DONE]") {
      done = true;
      return;
    }
    const event = JSON.parse(data);
    if (event.error) throw new ApiFailure(event.error.code ?? 500, `The server failed mid-answer: ${event.error.message}`);
    if (event.usage) usage = event.usage;
    const choice = event.choices?.[0];
    if (!choice) return;
    // A thinking model's reasoning comes first, apart from the answer (kvserve sends it under both names)
    const reasoning = choice.delta?.reasoning_content ?? choice.delta?.reasoning;
    for (const [piece, field] of [[reasoning, "reasoning"], [choice.delta?.content, "content"]]) {
      if (!piece) continue;
      const now = performance.now();
      first ??= now;
      last = now;
      pieces += 1;
      answer[field] = (answer[field] ?? "") + piece;
    }
    if (choice.finish_reason) answer.finish = choice.finish_reason;
  };
  try {
    for (;;) {
      const { value, done: ended } = await reader.read();
      if (ended) break;
      buffer += value.replaceAll("\r\n", "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
        if (data) handle(data);
      }
      update(stats(started, first, last, pieces, usage));
    }
  } catch (e) {
    answer.stats = stats(started, first, last, pieces, usage);
    if (e.name === "AbortError" || e instanceof ApiFailure) throw e;
    throw new ApiFailure(0, "The connection to the server was lost in the middle of the answer.");
  }
  answer.stats = stats(started, first, last, pieces, usage);
  if (!done) throw new ApiFailure(0, "The connection to the server closed before the answer was complete.");
}

// Time to first token from the request's start; tokens/s over the tokens after the first (decode speed).
function stats(started, first, last, pieces, usage) {
  const tokens = usage?.completion_tokens ?? pieces;
  const s = { ttft: first === null ? null : (first - started) / 1000, tokens, exact: Boolean(usage) };
  if (first !== null && last > first && tokens > 1) s.tokensPerSecond = (tokens - 1) / ((last - first) / 1000);
  return s;
}

function describe(s, finish) {
  if (!s) return "";
  const parts = [];
  if (finish === "stopped") parts.push("stopped");
  if (finish === "length") parts.push("cut at max tokens");
  if (finish === "error") parts.push("interrupted");
  if (s.ttft !== null) parts.push(`first token ${s.ttft.toFixed(2)} s`);
  parts.push(`${s.exact ? "" : "≈"}${s.tokens} tokens`);
  if (s.tokensPerSecond) parts.push(`${s.tokensPerSecond.toFixed(1)} tokens/s`);
  return parts.join(" · ");
}

// --- sending -------------------------------------------------------------------------------------

function requestBody(conversation) {
  const messages = conversation.messages.map(({ role, content }) => ({ role, content }));
  if (conversation.system.trim()) messages.unshift({ role: "system", content: conversation.system });
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (server.model) body.model = server.model;
  const number = (input, parse) => (input.value.trim() === "" ? null : parse(input.value));
  const temperature = number(ui.temperature, Number);
  const maxTokens = number(ui.maxTokens, Number);
  const seed = number(ui.seed, Number);
  // Anything odd goes to the server as typed: its 400 says what is wrong better than a guess here.
  if (temperature !== null) body.temperature = temperature;
  if (maxTokens !== null) body.max_tokens = maxTokens;
  if (seed !== null) body.seed = seed;
  return body;
}

async function send() {
  const text = ui.message.value;
  if (!text.trim() || generation) return;
  clearError();
  const conversation = current() ?? newConversation();
  if (!conversation.messages.length) conversation.title = text.trim().slice(0, 60);
  conversation.messages.push({ role: "user", content: text });
  const body = requestBody(conversation);
  const answer = { role: "assistant", content: "", stats: null, finish: null };
  conversation.messages.push(answer);
  conversation.updated = Date.now();
  ui.message.value = "";
  renderList();
  renderMessages();
  const element = ui.messages.lastElementChild;
  const content = element.querySelector(".content");
  const meta = element.querySelector(".meta");
  let shown = "";
  let shownReasoning = "";
  const update = (s) => {
    if ((answer.reasoning ?? "") !== shownReasoning) {
      shownReasoning = answer.reasoning;
      showReasoning(element, shownReasoning, !answer.content);
      ui.messages.scrollTop = ui.messages.scrollHeight;
    }
    if (answer.content !== shown) {
      // the answer begins: the reasoning folds away (a click opens it again)
      if (!shown && shownReasoning) showReasoning(element, shownReasoning, false);
      shown = answer.content;
      renderMarkdown(content, shown);
      ui.messages.scrollTop = ui.messages.scrollHeight;
    }
    meta.textContent = describe(s, null);
  };

  generation = { controller: new AbortController() };
  setBusy(true);
  try {
    await streamChat(body, answer, update, generation.controller.signal);
  } catch (e) {
    if (e.name === "AbortError") {
      answer.finish = "stopped";
    } else if (!answer.content) {
      // Nothing came back: take the turn back, so that sending again retries it.
      conversation.messages.splice(-2, 2);
      if (!conversation.messages.length) conversation.title = "New chat";
      ui.message.value = text;
      if (e.status === 401) askForKey("The server refused the request: it needs a valid API key (401 Unauthorized).");
      showError(e.message);
    } else {
      answer.finish = "error";
      showError(e.message);
    }
  } finally {
    generation = null;
    setBusy(false);
    saveConversations();
    renderList();
    renderMessages();
    if (!ui.keyDialog.open) ui.message.focus();
  }
}

function stop() {
  generation?.controller.abort();
}

function setBusy(busy) {
  ui.messages.setAttribute("aria-busy", String(busy));
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
  // One answer at a time, into the conversation it belongs to.
  ui.newChat.disabled = busy;
  for (const button of ui.list.querySelectorAll("button")) button.disabled = busy;
  ui.system.disabled = busy;
  if (busy) ui.stop.focus();
}

// --- rendering -----------------------------------------------------------------------------------

function renderList() {
  ui.list.replaceChildren();
  for (const conversation of [...conversations].sort((a, b) => b.updated - a.updated)) {
    const item = document.createElement("li");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = conversation.title;
    if (conversation.id === currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => select(conversation.id));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Delete the chat “${conversation.title}”`);
    remove.title = "Delete";
    remove.addEventListener("click", () => deleteConversation(conversation.id));
    item.append(open, remove);
    ui.list.append(item);
  }
}

function renderMessages() {
  const conversation = current();
  ui.system.value = conversation?.system ?? "";
  ui.messages.replaceChildren();
  for (const message of conversation?.messages ?? []) {
    const article = document.createElement("article");
    article.className = `message ${message.role}`;
    const who = document.createElement("h2");
    who.className = "who";
    who.textContent = message.role === "user" ? "You" : "Assistant";
    const content = document.createElement("div");
    content.className = "content";
    if (message.role === "user") content.textContent = message.content; // shown as typed
    else renderMarkdown(content, message.content);
    const meta = document.createElement("p");
    meta.className = "meta";
    meta.textContent = describe(message.stats, message.finish);
    article.append(who, content, meta);
    if (message.role === "assistant") {
      // the model's reasoning, before its answer: folded, and never sent back (as OpenAI's clients do)
      const reasoning = document.createElement("details");
      reasoning.className = "reasoning";
      reasoning.hidden = true;
      const summary = document.createElement("summary");
      const text = document.createElement("div");
      text.className = "thinking";
      reasoning.append(summary, text);
      content.before(reasoning);
      if (message.reasoning) showReasoning(article, message.reasoning, false);
    }
    ui.messages.append(article);
  }
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

// An answer's reasoning as plain text, open while the model is still thinking.
function showReasoning(article, text, thinking) {
  const reasoning = article.querySelector(".reasoning");
  reasoning.hidden = !text;
  reasoning.querySelector(".thinking").textContent = text;
  reasoning.querySelector("summary").textContent = thinking ? "Reasoning…" : "Reasoning";
  reasoning.open = thinking;
}

function select(id) {
  currentId = id;
  save(STORE.current, id);
  clearError();
  renderList();
  renderMessages();
  ui.chats.classList.remove("open");
  ui.toggleChats.setAttribute("aria-expanded", "false");
  ui.message.focus();
}

function deleteConversation(id) {
  const conversation = conversations.find((c) => c.id === id);
  if (!conversation || !confirm(`Delete the chat “${conversation.title}”?`)) return;
  conversations = conversations.filter((c) => c.id !== id);
  saveConversations();
  if (currentId === id) {
    const next = [...conversations].sort((a, b) => b.updated - a.updated)[0];
    currentId = next ? next.id : null;
    save(STORE.current, currentId);
  }
  renderList();
  renderMessages();
  (ui.list.querySelector("button.open") ?? ui.newChat).focus();
}

function showError(text, kind = "") {
  ui.error.textContent = text;
  ui.error.dataset.kind = kind;
  ui.error.hidden = false;
}

function clearError() {
  ui.error.hidden = true;
  ui.error.textContent = "";
}

// --- the API key ---------------------------------------------------------------------------------

function askForKey(reason) {
  ui.keyReason.textContent = reason;
  ui.keyInput.value = "";
  if (!ui.keyDialog.open) ui.keyDialog.showModal();
  ui.keyInput.focus();
}

ui.keyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const key = ui.keyInput.value.trim();
  if (!key) return;
  save(STORE.apiKey, key);
  ui.keyDialog.close();
  ui.message.focus();
  fetchModels();
});
ui.keyCancel.addEventListener("click", () => ui.keyDialog.close());
ui.forgetKey.addEventListener("click", () => {
  save(STORE.apiKey, null);
  fetchModels();
});

// --- wiring --------------------------------------------------------------------------------------

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
ui.message.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && generation) stop();
});
ui.stop.addEventListener("click", stop);
ui.newChat.addEventListener("click", () => {
  const empty = current();
  if (!empty || empty.messages.length) newConversation();
  renderList();
  renderMessages();
  clearError();
  ui.message.focus();
});
ui.toggleChats.addEventListener("click", () => {
  const open = ui.chats.classList.toggle("open");
  ui.toggleChats.setAttribute("aria-expanded", String(open));
});
ui.system.addEventListener("input", () => {
  const conversation = current() ?? newConversation();
  conversation.system = ui.system.value;
  saveConversations();
});
for (const [input, name] of [[ui.temperature, "temperature"], [ui.maxTokens, "maxTokens"], [ui.seed, "seed"]]) {
  input.value = settings[name];
  input.addEventListener("input", () => {
    settings[name] = input.value;
    save(STORE.settings, settings);
  });
}

if (!current()) currentId = conversations[0]?.id ?? null;
renderList();
renderMessages();
ui.message.focus();
fetchModels();
