// Sign-in, navigation and the 2-second refresh of the view on screen.
import { api, setCsrf, toast } from "./api.js";
import * as agents from "./agents.js";
import * as approvals from "./approvals.js";
import * as audit from "./audit.js";
import * as records from "./records.js";
import * as terminations from "./terminations.js";

const VIEWS = { agents, approvals, terminations, records, audit: { render: async () => {} } };
const POLL_MS = 2000;
let view = "agents";
let timer = null;

function $(id) { return document.getElementById(id); }

function signedIn(yes, session) {
  $("whoami").textContent = yes && session ? `${session.operator} (${session.roles.join(", ")})` : "";
  $("signin").hidden = yes;
  $("nav").hidden = !yes;
  $("logout").hidden = !yes;
  for (const el of document.querySelectorAll(".view")) el.hidden = !yes || el.id !== `view-${view}`;
}

async function refresh() {
  clearTimeout(timer);
  try {
    await VIEWS[view].render();
    const pending = await approvals.pendingCount();
    const badge = $("approval-count");
    badge.hidden = pending === 0;
    badge.textContent = String(pending);
    badge.setAttribute("aria-label", `${pending} pending`);
  } catch (e) {
    if (e.status === 401) { signedIn(false); return; }
    toast(`${e.code}: ${e.message}`);
  }
  timer = setTimeout(refresh, POLL_MS);
}

let session = null;

function show(name) {
  view = name;
  for (const b of document.querySelectorAll("#nav button")) {
    if (b.dataset.view === name) b.setAttribute("aria-current", "page"); else b.removeAttribute("aria-current");
  }
  signedIn(true, session);
  refresh();
}

async function start() {
  for (const b of document.querySelectorAll("#nav button")) b.addEventListener("click", () => show(b.dataset.view));
  records.bindFilters();
  audit.bind();
  document.addEventListener("tether:open-record", async (e) => { show("records"); await records.open(e.detail); });
  $("signin-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    $("signin-error").textContent = "";
    try {
      session = await api("POST", "/ui/session", { token: $("token").value });
      $("token").value = "";
      setCsrf(session.csrf);
      show("agents");
    } catch (err) {
      $("signin-error").textContent = `${err.code}: ${err.message}`;
    }
  });
  $("logout").addEventListener("click", async () => {
    try { await api("POST", "/ui/logout", {}); } finally { clearTimeout(timer); setCsrf(""); signedIn(false); }
  });
  try {
    session = await api("GET", "/ui/session");
    setCsrf(session.csrf);
    show("agents");
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
