// Sign-in, the page's addresses, and the 2-second refresh of the view on screen.
//
// Every view and every object has its own address: /ui/agents, /ui/agents/AGENT, /ui/approvals/ID,
// /ui/calls?q=..., /ui/calls/CALL_ID, /ui/terminations/ID, /ui/records/ID?resolution=..., /ui/audit,
// /ui/search?q=... The control plane serves this same page at each of them; the page reads its address, so a
// reload stays where it was and any of them can be linked.
import { api, setCsrf, tick, toast } from "./api.js";
import * as agents from "./agents.js";
import * as approvals from "./approvals.js";
import * as audit from "./audit.js";
import * as calls from "./calls.js";
import * as records from "./records.js";
import * as search from "./search.js";
import * as terminations from "./terminations.js";

const VIEWS = { agents, approvals, calls, terminations, records, search, audit };
const TITLES = { agents: "Agents", approvals: "Approvals", calls: "Calls", terminations: "Terminations",
                 records: "Records", search: "Search", audit: "Audit" };
const POLL_MS = 2000;
let timer = null;
let session = null;
let generation = 0;  // a render that a later navigation overtook is dropped

function $(id) { return document.getElementById(id); }

// The address, as a route: {view, id, query}.
export function route(loc = window.location) {
  const parts = loc.pathname.replace(/^\/ui\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  const view = VIEWS[parts[0]] ? parts[0] : "agents";
  return { view, id: parts[1] ?? null, query: new URLSearchParams(loc.search) };
}

function signedIn(yes) {
  $("whoami").textContent = yes && session ? `${session.operator} (${session.roles.join(", ")})` : "";
  $("signin").hidden = yes;
  for (const id of ["nav", "logout", "search-form"]) $(id).hidden = !yes;
  const current = route().view;
  for (const el of document.querySelectorAll(".view")) el.hidden = !yes || el.id !== `view-${current}`;
  if (!yes) document.title = "Sign in · tether console";
}

async function refresh(focus = false) {
  clearTimeout(timer);
  const mine = ++generation;
  const r = route();
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.view === r.view) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  }
  signedIn(true);
  if (r.view === "search" && document.activeElement !== $("search-q")) $("search-q").value = r.query.get("q") || "";
  try {
    const title = await VIEWS[r.view].render(r, () => mine === generation);
    if (mine !== generation) return;
    document.title = `${title || TITLES[r.view]} · tether console`;
    if (focus) $(`${r.view}-title`).focus({ preventScroll: true });
    const pending = await approvals.pendingCount();
    const badge = $("approval-count");
    badge.hidden = pending === 0;
    badge.textContent = String(pending);
    badge.setAttribute("aria-label", `${pending} pending`);
    tick();
  } catch (e) {
    if (e.status === 401) { session = null; signedIn(false); return; }
    toast(`${e.code || "error"}: ${e.message}`);
  }
  if (mine === generation) timer = setTimeout(() => refresh(), POLL_MS);
}

// Go to one of the console's addresses without reloading the page (replace: the same entry, a filter changed).
export function go(path, { replace = false } = {}) {
  if (path === window.location.pathname + window.location.search) { refresh(); return; }
  const before = route();
  history[replace ? "replaceState" : "pushState"](null, "", path);
  const after = route();
  const moved = before.view !== after.view || before.id !== after.id;
  if (moved) window.scrollTo(0, 0);
  refresh(moved);
}

function followLinks() {
  document.addEventListener("click", (e) => {
    const a = e.target.closest && e.target.closest("a[href]");
    if (!a || e.defaultPrevented || e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return;
    if (a.hasAttribute("download") || a.target || a.origin !== window.location.origin) return;
    if (!/^\/ui\/(?!static\/|oidc\/|session|logout)/.test(a.pathname)) return;
    e.preventDefault();
    go(a.pathname + a.search);
  });
  window.addEventListener("popstate", () => refresh(true));
  document.addEventListener("tether:go", (e) => go(e.detail.path, e.detail));
}

async function start() {
  followLinks();
  audit.bind();
  $("search-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const q = $("search-q").value.trim();
    go(`/ui/search${q ? `?q=${encodeURIComponent(q)}` : ""}`);
  });
  $("signin-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    $("signin-error").textContent = "";
    try {
      session = await api("POST", "/ui/session", { token: $("token").value });
      $("token").value = "";
      setCsrf(session.csrf);
      refresh(true);  // where the address says: a link followed before signing in still leads there
    } catch (err) {
      $("signin-error").textContent = `${err.code}: ${err.message}`;
    }
  });
  $("logout").addEventListener("click", async () => {
    try { await api("POST", "/ui/logout", {}); } finally {
      clearTimeout(timer); generation++; session = null; setCsrf(""); signedIn(false);
    }
  });
  try {
    session = await api("GET", "/ui/session");
    setCsrf(session.csrf);
    refresh();
  } catch {
    signedIn(false);
    try {  // single sign-on, when the control plane is configured with a provider
      const sso = await api("GET", "/v1/auth/oidc");
      $("sso-link").textContent = `Sign in with single sign-on (${new URL(sso.issuer).host})`;
      $("sso").hidden = false;
    } catch { /* not configured: the token form alone */ }
  }
}

start();
