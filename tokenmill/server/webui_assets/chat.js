// The chat playground: conversations kept in this browser (localStorage), answers streamed from
// /v1/chat/completions (server-sent events), rendered by markdown.js. Model text only ever reaches
// the page through renderMarkdown (escaped first) or textContent.

import { apiFetch, askForApiKey, errorMessage } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const STORE = "tokenmill.chat.v1";
const SETTINGS = "tokenmill.chat.settings.v1";
const $ = (id) => document.getElementById(id);

// ------------------------------------------------------------------------------------------------
// state: { conversations: [{id, title, updated, messages: [{role, content, reasoning, toolCalls, meta}]}], currentId }

function loadState() {
  try {
    const state = JSON.parse(localStorage.getItem(STORE) || "null");
    if (state && Array.isArray(state.conversations)) return state;
  } catch {
    /* a damaged store starts afresh */
  }
  return { conversations: [], currentId: null };
}

const state = loadState();
let streaming = null; // {controller, message} while an answer streams

function saveState() {
  localStorage.setItem(STORE, JSON.stringify(state));
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

function current() {
  let conversation = state.conversations.find((c) => c.id === state.currentId);
  if (!conversation) {
    conversation = { id: newId(), title: "New chat", updated: Date.now(), messages: [] };
    state.conversations.unshift(conversation);
    state.currentId = conversation.id;
  }
  return conversation;
}

// ------------------------------------------------------------------------------------------------
// settings

const SETTING_FIELDS = {
  model: "set-model", system: "set-system", temperature: "set-temperature", topP: "set-top-p",
  maxTokens: "set-max-tokens", seed: "set-seed", tier: "set-tier", constraint: "set-constraint",
  constraintText: "set-constraint-text", tools: "set-tools", extra: "set-extra",
};

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}") || {};
  } catch {
    saved = {};
  }
  for (const [name, id] of Object.entries(SETTING_FIELDS)) {
    if (saved[name] === undefined) continue;
    const field = $(id);
    if (field.tagName === "SELECT" && ![...field.options].some((o) => o.value === saved[name])) {
      field.append(new Option(saved[name], saved[name]));
    }
    field.value = saved[name];
  }
  $("constraint-box").hidden = $("set-constraint").value === "none";
}

function saveSettings() {
  const values = {};
  for (const [name, id] of Object.entries(SETTING_FIELDS)) values[name] = $(id).value;
  localStorage.setItem(SETTINGS, JSON.stringify(values));
  $("constraint-box").hidden = values.constraint === "none";
}

function parseJsonField(id, label, kind) {
  const text = $(id).value.trim();
  if (!text) return null;
  let value;
  try {
    value = JSON.parse(text);
  } catch (error) {
    throw new Error(`${label} is not valid JSON: ${error.message}`);
  }
  if (kind === "array" ? !Array.isArray(value) : value === null || typeof value !== "object" || Array.isArray(value)) {
    throw new Error(`${label} must be a JSON ${kind}`);
  }
  return value;
}

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? null : Number(text);
}

/** The request body for the conversation's messages up to the answer being written. */
function requestBody(messages) {
  const body = { messages: [], stream: true, stream_options: { include_usage: true } };
  const model = $("set-model").value;
  if (model) body.model = model;
  const system = $("set-system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  for (const m of messages) {
    if (m.role === "assistant" && m.error && !m.content && !(m.toolCalls || []).length) continue; // a failed turn
    const message = { role: m.role, content: m.content };
    if (m.toolCalls && m.toolCalls.length) message.tool_calls = m.toolCalls;
    body.messages.push(message);
  }
  const numbers = { temperature: "set-temperature", top_p: "set-top-p", max_tokens: "set-max-tokens", seed: "set-seed" };
  for (const [name, id] of Object.entries(numbers)) {
    const value = numberField(id);
    if (value !== null) body[name] = value;
  }
  const tier = $("set-tier").value;
  if (tier) body.service_tier = tier;
  const constraint = $("set-constraint").value;
  if (constraint === "json_schema") {
    const schema = parseJsonField("set-constraint-text", "The JSON schema", "object") || {};
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
  } else if (constraint === "regex") {
    const pattern = $("set-constraint-text").value;
    if (!pattern) throw new Error("Constrained output by regular expression needs a pattern");
    body.guided_regex = pattern;
  }
  const tools = parseJsonField("set-tools", "Tools", "array");
  if (tools && tools.length) body.tools = tools;
  Object.assign(body, parseJsonField("set-extra", "Extra request fields", "object") || {});
  return body;
}

async function loadModels() {
  const select = $("set-model");
  const response = await apiFetch("/v1/models");
  if (response.status === 401) {
    await askForApiKey("This server needs an API key to list its models.");
    return loadModels();
  }
  if (!response.ok) {
    showBanner(await errorMessage(response));
    return;
  }
  const wanted = JSON.parse(localStorage.getItem(SETTINGS) || "{}").model;
  select.replaceChildren(...(await response.json()).data.map((card) => new Option(card.id, card.id)));
  if (wanted && [...select.options].some((o) => o.value === wanted)) select.value = wanted;
  const metrics = await apiFetch("/metrics.json");
  if (metrics.ok) {
    const tiers = (await metrics.json()).service_tiers || [];
    const tierSelect = $("set-tier");
    for (const tier of tiers) {
      if (![...tierSelect.options].some((o) => o.value === tier)) tierSelect.append(new Option(tier, tier));
    }
    loadSettings();
  }
  await showEngineMode();
}

/** Say in the settings when the server runs in deterministic mode (GET /server_info). */
async function showEngineMode() {
  const response = await apiFetch("/server_info");
  if (!response.ok) return;
  const info = await response.json();
  const note = $("engine-mode");
  note.hidden = !info.deterministic;
  if (info.deterministic) {
    note.textContent =
      "Deterministic mode: the same request gives the same answer, whatever else the server runs " +
      `(unseeded requests sample with seed ${info.random_seed}).`;
    $("set-seed").placeholder = `${info.random_seed} (server seed)`;
  }
}

// ------------------------------------------------------------------------------------------------
// rendering

function showBanner(text) {
  $("banner").textContent = text;
  $("banner").hidden = !text;
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conversation of state.conversations) {
    const item = document.createElement("li");
    item.textContent = conversation.title;
    item.dataset.id = conversation.id;
    if (conversation.id === state.currentId) item.classList.add("active");
    item.addEventListener("click", () => {
      if (streaming) return;
      state.currentId = conversation.id;
      saveState();
      renderAll();
    });
    list.append(item);
  }
  $("chat-title").textContent = current().title;
}

function metaText(meta) {
  if (!meta) return "";
  const parts = [];
  if (meta.ttftMs !== undefined) parts.push(`TTFT ${Math.round(meta.ttftMs)} ms`);
  if (meta.tokensPerSecond !== undefined) parts.push(`${meta.tokensPerSecond.toFixed(1)} tok/s`);
  if (meta.completionTokens !== undefined) parts.push(`${meta.completionTokens} tokens`);
  if (meta.promptTokens !== undefined) parts.push(`${meta.cachedTokens ?? 0}/${meta.promptTokens} prompt tokens cached`);
  if (meta.tier) parts.push(`tier ${meta.tier}`);
  if (meta.finishReason) parts.push(`finish: ${meta.finishReason}`);
  if (meta.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function renderToolCalls(container, toolCalls) {
  for (const call of toolCalls || []) {
    const box = document.createElement("div");
    box.className = "tool-call";
    const name = document.createElement("div");
    name.className = "tool-name";
    name.textContent = `tool call: ${call.function?.name ?? "?"}`;
    const args = document.createElement("pre");
    args.textContent = call.function?.arguments ?? "";
    box.append(name, args);
    container.append(box);
  }
}

/** Fill a message element's body (markdown), thinking block, tool calls, error and numbers. */
function fillMessage(element, message) {
  const reasoning = element.querySelector(".reasoning");
  if (message.reasoning) {
    reasoning.hidden = false;
    reasoning.querySelector(".reasoning-body").textContent = message.reasoning;
  } else {
    reasoning.hidden = true;
  }
  const body = element.querySelector(".body");
  if (message.role === "assistant") body.innerHTML = renderMarkdown(message.content || "");
  else body.textContent = message.content;
  const calls = element.querySelector(".tool-calls");
  calls.replaceChildren();
  renderToolCalls(calls, message.toolCalls);
  const error = element.querySelector(".message-error");
  error.textContent = message.error || "";
  error.hidden = !message.error;
  element.querySelector(".meta").textContent = metaText(message.meta);
}

function messageElement(message, index) {
  const element = document.createElement("article");
  element.className = `message ${message.role} ${message.error ? "failed" : "done"}`;
  element.dataset.index = index;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role === "user" ? "You" : "Assistant";
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const reasoningBody = document.createElement("div");
  reasoningBody.className = "reasoning-body";
  reasoning.append(summary, reasoningBody);
  const body = document.createElement("div");
  body.className = "body";
  const calls = document.createElement("div");
  calls.className = "tool-calls";
  const error = document.createElement("div");
  error.className = "message-error error";
  const meta = document.createElement("div");
  meta.className = "meta";
  element.append(role, reasoning, body, calls, error, meta);
  if (message.role === "user") {
    const edit = document.createElement("button");
    edit.className = "edit link";
    edit.textContent = "Edit";
    edit.addEventListener("click", () => startEdit(element, index));
    role.append(" ", edit);
  }
  fillMessage(element, message);
  return element;
}

function renderMessages() {
  const container = $("messages");
  container.replaceChildren(...current().messages.map(messageElement));
  container.scrollTop = container.scrollHeight;
}

function renderAll() {
  renderSidebar();
  renderMessages();
  updateButtons();
}

function updateButtons() {
  $("stop").hidden = !streaming;
  $("send").disabled = !!streaming;
  const messages = current().messages;
  $("regenerate").disabled = !!streaming || !messages.some((m) => m.role === "user");
}

function startEdit(element, index) {
  if (streaming) return;
  const message = current().messages[index];
  const box = document.createElement("textarea");
  box.className = "edit-box";
  box.value = message.content;
  const save = document.createElement("button");
  save.className = "primary";
  save.textContent = "Send edited";
  const cancel = document.createElement("button");
  cancel.textContent = "Cancel";
  const body = element.querySelector(".body");
  body.replaceChildren(box, save, cancel);
  cancel.addEventListener("click", renderMessages);
  save.addEventListener("click", () => {
    const conversation = current();
    conversation.messages = conversation.messages.slice(0, index);
    conversation.messages.push({ role: "user", content: box.value });
    saveState();
    renderMessages();
    answer();
  });
  box.focus();
}

// ------------------------------------------------------------------------------------------------
// streaming an answer

/** Yield the parsed JSON of each `data:` event of a server-sent-event body; "[DONE]" ends it. */
async function* serverEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") {
        yield "[DONE]";
        return;
      }
      yield JSON.parse(data);
    }
  }
}

function mergeToolCallDeltas(message, deltas) {
  message.toolCalls = message.toolCalls || [];
  for (const delta of deltas) {
    const index = delta.index ?? message.toolCalls.length;
    const call = (message.toolCalls[index] ||= { id: delta.id, type: "function", function: { name: "", arguments: "" } });
    if (delta.id) call.id = delta.id;
    if (delta.function?.name) call.function.name += delta.function.name;
    if (delta.function?.arguments) call.function.arguments += delta.function.arguments;
  }
}

async function answer() {
  const conversation = current();
  showBanner("");
  let body;
  try {
    body = requestBody(conversation.messages);
  } catch (error) {
    showBanner(error.message);
    return;
  }
  const message = { role: "assistant", content: "", meta: {} };
  conversation.messages.push(message);
  conversation.updated = Date.now();
  const element = messageElement(message, conversation.messages.length - 1);
  element.classList.replace("done", "streaming");
  $("messages").append(element);
  const controller = new AbortController();
  streaming = { controller, message };
  updateButtons();
  const started = performance.now();
  let firstToken = null;
  let finished = false;
  let lastSave = 0;
  const refresh = () => {
    fillMessage(element, message);
    $("messages").scrollTop = $("messages").scrollHeight;
    if (performance.now() - lastSave > 500) {
      saveState();
      lastSave = performance.now();
    }
  };
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      message.error = await errorMessage(response);
      if (response.status === 401) {
        conversation.messages.pop();
        streaming = null;
        element.remove();
        await askForApiKey("This server needs an API key to answer.");
        return answer();
      }
    } else {
      for await (const event of serverEvents(response)) {
        if (event === "[DONE]") {
          finished = true;
          break;
        }
        if (event.error) {
          message.error = `The server stopped the answer: ${event.error.message || JSON.stringify(event.error)}`;
          finished = true;
          break;
        }
        if (event.service_tier) message.meta.tier = event.service_tier;
        if (event.model) message.meta.model = event.model;
        const choice = (event.choices || [])[0];
        if (choice) {
          const delta = choice.delta || {};
          const text = delta.content || "";
          const reasoning = delta.reasoning_content || "";
          if ((text || reasoning || delta.tool_calls) && firstToken === null) {
            firstToken = performance.now();
            message.meta.ttftMs = firstToken - started;
          }
          message.content += text;
          if (reasoning) message.reasoning = (message.reasoning || "") + reasoning;
          if (delta.tool_calls) mergeToolCallDeltas(message, delta.tool_calls);
          if (choice.finish_reason) message.meta.finishReason = choice.finish_reason;
        }
        if (event.usage) {
          message.meta.promptTokens = event.usage.prompt_tokens;
          message.meta.completionTokens = event.usage.completion_tokens;
          message.meta.cachedTokens = event.usage.prompt_tokens_details?.cached_tokens ?? 0;
        }
        refresh();
      }
      if (!finished) message.error = "The connection to the server was lost before the answer finished.";
    }
  } catch (error) {
    if (error.name === "AbortError") message.meta.stopped = true;
    else if (error instanceof TypeError) message.error = "The connection to the server was lost before the answer finished.";
    else message.error = `The answer could not be read: ${error.message}`;
  }
  const ended = performance.now();
  if (firstToken !== null && message.meta.completionTokens && ended > firstToken && message.meta.completionTokens > 1) {
    message.meta.tokensPerSecond = (message.meta.completionTokens - 1) / ((ended - firstToken) / 1000);
  }
  if (conversation.title === "New chat") {
    const firstUser = conversation.messages.find((m) => m.role === "user");
    if (firstUser) conversation.title = firstUser.content.slice(0, 48) || "New chat";
  }
  streaming = null;
  element.classList.remove("streaming");
  element.classList.add(message.error ? "failed" : "done");
  fillMessage(element, message);
  saveState();
  renderSidebar();
  updateButtons();
}

function send(text) {
  if (streaming || !text.trim()) return;
  current().messages.push({ role: "user", content: text });
  saveState();
  renderMessages();
  answer();
}

function regenerate() {
  if (streaming) return;
  const conversation = current();
  while (conversation.messages.length && conversation.messages.at(-1).role === "assistant") conversation.messages.pop();
  if (!conversation.messages.length) return;
  saveState();
  renderMessages();
  answer();
}

// ------------------------------------------------------------------------------------------------
// conversations

function newChat() {
  if (streaming) return;
  const conversation = current();
  if (conversation.messages.length) state.currentId = null;
  current();
  saveState();
  renderAll();
  $("prompt").focus();
}

function renameChat() {
  const conversation = current();
  const title = window.prompt("Rename this conversation", conversation.title);
  if (title && title.trim()) {
    conversation.title = title.trim();
    saveState();
    renderSidebar();
  }
}

function deleteChat() {
  if (streaming) return;
  const conversation = current();
  if (conversation.messages.length && !window.confirm(`Delete "${conversation.title}"?`)) return;
  state.conversations = state.conversations.filter((c) => c.id !== conversation.id);
  state.currentId = state.conversations[0]?.id ?? null;
  saveState();
  renderAll();
}

function exportChat() {
  const conversation = current();
  const blob = new Blob([JSON.stringify(conversation, null, 2)], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `${conversation.title.replace(/[^\w.-]+/g, "_").slice(0, 40) || "chat"}.json`;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

// ------------------------------------------------------------------------------------------------
// wiring

function init() {
  loadSettings();
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => streaming?.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", newChat);
  $("rename-chat").addEventListener("click", renameChat);
  $("delete-chat").addEventListener("click", deleteChat);
  $("export-chat").addEventListener("click", exportChat);
  $("change-key").addEventListener("click", () => askForApiKey("Enter the server's API key.").then(loadModels));
  $("toggle-settings").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
  });
  for (const id of Object.values(SETTING_FIELDS)) $(id).addEventListener("change", saveSettings);
  renderAll();
  loadModels().catch((error) => showBanner(`Could not reach the server: ${error.message}`));
  document.body.dataset.ready = "true";
}

init();
