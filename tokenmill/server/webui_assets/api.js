// Talking to this server from the pages: the API key (kept for the browser session, or on this
// device when the user ticks "remember"), fetch with the key, and readable error messages.

const KEY_NAME = "tokenmill.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME) || "";
}

export function saveApiKey(key, remember) {
  sessionStorage.removeItem(KEY_NAME);
  localStorage.removeItem(KEY_NAME);
  if (key) (remember ? localStorage : sessionStorage).setItem(KEY_NAME, key);
}

/** fetch() on this origin with the API key, if one is known. */
export function apiFetch(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  return fetch(path, { ...options, headers, credentials: "omit", cache: "no-store" });
}

/** A sentence for a failed response, from the server's OpenAI-style error body when it has one. */
export async function errorMessage(response) {
  let detail = "";
  try {
    const body = await response.json();
    detail = body?.error?.message || body?.detail || "";
    if (typeof detail !== "string") detail = JSON.stringify(detail);
  } catch {
    detail = response.statusText || "";
  }
  const status = response.status;
  if (status === 401) return `The server needs a valid API key (401${detail ? ": " + detail : ""}).`;
  if (status === 429) return `The server is busy (429): ${detail || "too many requests"}. Try again shortly.`;
  if (status >= 500) return `The server failed (${status}): ${detail || "internal error"}.`;
  return `The request was refused (${status}): ${detail || "bad request"}.`;
}

/**
 * Show the page's key dialog (a <dialog id="key-dialog"> with a form holding #key-input and
 * #key-remember) and resolve once the user saved a key; `reason` is shown above the field.
 */
export function askForApiKey(reason) {
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  const remember = document.getElementById("key-remember");
  document.getElementById("key-reason").textContent = reason || "This server needs an API key.";
  input.value = "";
  remember.checked = false;
  return new Promise((resolve) => {
    const form = dialog.querySelector("form");
    const onSubmit = (event) => {
      event.preventDefault();
      if (!input.value.trim()) return;
      saveApiKey(input.value.trim(), remember.checked);
      form.removeEventListener("submit", onSubmit);
      dialog.close();
      resolve();
    };
    form.addEventListener("submit", onSubmit);
    if (!dialog.open) dialog.showModal();
    input.focus();
  });
}
