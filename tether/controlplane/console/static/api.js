// The console's only door to the control plane: the documented JSON API, with the session cookie and,
// on every change, the session's CSRF token.
let csrf = "";

export class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

export function setCsrf(token) { csrf = token || ""; }

// Who decided: an operator's name and how they signed in, else the principal or termination that did.
export function byText(by, operator) { return operator ? `${operator.operator} (${operator.via})` : (by || "?"); }

export async function api(method, path, body) {
  const headers = { "Accept": "application/json" };
  if (method !== "GET") { headers["X-CSRF-Token"] = csrf; headers["Content-Type"] = "application/json"; }
  const resp = await fetch(path, {
    method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!resp.ok) {
    const err = (data && data.error) || {};
    throw new ApiError(resp.status, err.code || "tether.http_error", err.message || `${method} ${path}: HTTP ${resp.status}`);
  }
  return data;
}

// Build DOM from data without ever parsing it as HTML.
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function when(t) {
  if (t === undefined || t === null) return "—";
  return new Date(t * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

export function ago(t) {
  if (!t) return "—";
  const s = Math.round(Date.now() / 1000 - t);
  return s < 0 ? `in ${-s}s` : s < 90 ? `${s}s ago` : s < 5400 ? `${Math.round(s / 60)}m ago` : `${Math.round(s / 3600)}h ago`;
}

export function state(value) { return h("span", { class: `state state-${value}` }, value ?? "—"); }

export function toast(text) {
  const el = document.getElementById("toast");
  el.textContent = text;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { el.textContent = ""; }, 4000);
}

export function replace(el, ...children) { el.replaceChildren(...children.flat().filter((c) => c != null)); }
