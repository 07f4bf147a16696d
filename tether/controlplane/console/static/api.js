// The console's only door to the control plane: the documented JSON API, with the session cookie and,
// on every change, the session's CSRF token. And the few DOM helpers every view shares.
let csrf = "";

export class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

export function setCsrf(token) { csrf = token || ""; }

// Who decided: an operator's name and how they signed in, else the principal or termination that did.
export function byText(by, operator) { return operator ? `${operator.operator} (${operator.via})` : (by || "?"); }

async function call(method, path, body) {
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
  return { data, resp };
}

export async function api(method, path, body) { return (await call(method, path, body)).data; }

// A page of a list the API pages: its items and the Tether-Total header (how many match in all).
export async function page(path) {
  const { data, resp } = await call("GET", path);
  return { docs: data, total: Number(resp.headers.get("Tether-Total") || data.length) };
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
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// The console's own addresses: /ui/VIEW[/ID][?query]. Links to them are followed in the page (main.js).
export function href(view, id, query) {
  let path = `/ui/${view}${id !== undefined && id !== null ? `/${encodeURIComponent(id)}` : ""}`;
  const params = new URLSearchParams(Object.entries(query || {}).filter(([, v]) => v !== undefined && v !== null && v !== ""));
  if ([...params].length) path += `?${params}`;
  return path;
}

export function link(view, id, text, attrs = {}) { return h("a", { href: href(view, id), ...attrs }, text ?? id); }

export function agentLink(agent) { return agent ? link("agents", agent, agent, { class: "agent-link" }) : "—"; }

// ISO 8601 in UTC, to the second: what the CLI prints and what a person can paste into --since.
export function when(t) {
  if (t === undefined || t === null) return "—";
  return new Date(t * 1000).toISOString().replace(/\.\d+Z$/, "Z");
}

export function agoText(t, now = Date.now() / 1000) {
  const s = Math.round(now - t);
  const abs = Math.abs(s);
  const span = abs < 90 ? `${abs}s` : abs < 5400 ? `${Math.round(abs / 60)}m` : abs < 172800 ? `${Math.round(abs / 3600)}h`
    : `${Math.round(abs / 86400)}d`;
  return s < 0 ? `in ${span}` : `${span} ago`;
}

// A moment: "3s ago" on screen (kept current by tick()), the exact UTC time in its datetime and title.
export function ago(t) {
  if (!t) return h("span", { class: "muted" }, "—");
  return h("time", { datetime: when(t), title: when(t), "data-at": String(t) }, agoText(t));
}

// A moment written out: the UTC time, then how long ago.
export function at(t) {
  if (!t) return h("span", { class: "muted" }, "—");
  return h("span", { class: "at" }, h("time", { datetime: when(t) }, when(t)), " (", ago(t), ")");
}

export function tick() {
  const now = Date.now() / 1000;
  for (const el of document.querySelectorAll("time[data-at]")) el.textContent = agoText(Number(el.dataset.at), now);
}

export function state(value) { return h("span", { class: `state state-${value}` }, value ?? "—"); }

// A call's resolution with the code that says why (refused, cut, failed), as the record has it.
export function resolution(c) {
  return h("span", { class: "resolution" }, state(c.resolution), c.code ? [" ", h("code", { class: "code" }, c.code)] : null);
}

export function toast(text) {
  const el = document.getElementById("toast");
  el.textContent = text;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { el.textContent = ""; }, 5000);
}

// What a control is, to find it again after its view was drawn anew.
function focusKey(e) { return e.id || e.getAttribute("aria-label") || `${e.tagName}|${e.getAttribute("href") || ""}|${e.textContent}`; }

// Replace an element's content; the control that had the focus keeps it (a refresh never throws a keyboard
// user back to the top of the page).
export function replace(el, ...children) {
  const active = document.activeElement;
  const key = active && active !== document.body && el.contains(active) ? focusKey(active) : null;
  el.replaceChildren(...children.flat(Infinity).filter((c) => c != null));
  if (key !== null) {
    const again = [...el.querySelectorAll(active.tagName)].find((x) => focusKey(x) === key);
    if (again) again.focus({ preventScroll: true });
  }
}

// A table that reads as rows of labelled fields on a narrow screen (console.css): every cell names its column.
// ``rows``: one array of cells per row, or {attrs, cells}.
export function table(label, columns, rows, attrs = {}) {
  return h("div", { class: "table-wrap" }, h("table", { "aria-label": label, class: "rows", ...attrs },
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows.map((row) => {
      const { attrs: rowAttrs = {}, cells } = Array.isArray(row) ? { cells: row } : row;
      return h("tr", rowAttrs, cells.map((cell, i) => {
        const { cls, content } = cell && cell.cell ? { cls: cell.cls, content: cell.cell } : { content: cell };
        return h("td", { "data-label": columns[i] || null, class: cls }, h("div", { class: "cell" }, content));
      }));
    }))));
}

// A cell with a class: table(..., [[cell("mono", text)]]).
export function cell(cls, ...content) { return { cls, cell: content }; }

// Term/definition pairs; pairs whose value is null are left out.
export function dl(pairs, attrs = {}) {
  return h("dl", attrs, pairs.filter((p) => p && p[1] !== null && p[1] !== undefined)
    .map(([k, v, cls]) => [h("dt", {}, k), h("dd", { class: cls }, v)]));
}

// Render only when what a view shows changed: a poll that brings the same data leaves the page (its focus,
// scroll positions, open details) alone.
const shown = new WeakMap();

export function changed(el, data) {
  const key = JSON.stringify(data);
  if (shown.get(el) === key) return false;
  shown.set(el, key);
  return true;
}

export function forget(el) { shown.delete(el); }

// Go to one of the console's addresses in the page (main.js follows it); replace: a filter changed, no new entry.
export function navigate(path, replace = false) {
  document.dispatchEvent(new CustomEvent("tether:go", { detail: { path, replace } }));
}

// Where an object's page sits: its view, then the object.
export function crumbs(view, label, id) {
  return h("p", { class: "crumbs" }, link(view, null, label), " › ", h("code", {}, id));
}

// One object for its page, or null when there is none: the page then says so (and ``note``), in ``body``.
export async function one(body, path, current, trail, note) {
  try {
    return await api("GET", path);
  } catch (e) {
    if (e.status !== 404) throw e;
    if (current() && changed(body, ["missing", path])) {
      replace(body, trail, h("p", { class: "error", role: "alert" }, `${e.code}: ${e.message}`), note ? h("p", { class: "muted" }, note) : null);
    }
    return null;
  }
}
