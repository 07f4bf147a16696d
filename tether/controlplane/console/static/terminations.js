// Terminations and where each stands in the protocol: requested -> draining|aborting -> reconciling -> terminated.
// Each has its own page (/ui/terminations/ID): who asked, why, who acknowledged, who it still waits for.
import { agentLink, api, at, byText, cell, changed, crumbs, dl, h, link, one, replace, state, table, when } from "./api.js";

function steps(t) {
  const path = ["requested", t.mode === "abort" ? "aborting" : "draining", "reconciling", "terminated"];
  const stamps = Object.fromEntries((t.history || []).map((s) => [s.state, s.at]));
  const current = path.indexOf(t.state);
  return h("ol", { class: "steps", "aria-label": `Progress: ${t.state}` }, path.map((s, i) =>
    h("li", { class: i < current || t.state === "terminated" ? "done" : i === current ? "current" : "",
              "aria-current": i === current ? "step" : null, title: stamps[s] ? when(stamps[s]) : "not yet" }, s)));
}

function agents(list) { return (list || []).flatMap((a, i) => [i ? ", " : "", agentLink(a)]); }

export async function render(r, current) {
  if (r.id) return renderOne(r.id, current);
  const docs = await api("GET", "/v1/terminations");
  if (!current()) return null;
  const body = document.getElementById("terminations-body");
  if (!changed(body, [docs, Math.floor(Date.now() / 60000)])) return "Terminations";
  docs.sort((a, b) => b.requested_at - a.requested_at);
  if (!docs.length) { replace(body, h("p", {}, "No termination yet.")); return "Terminations"; }
  replace(body, table("Terminations", ["Termination", "Subject", "Mode", "Window", "State", "Progress", "Agents", "Record"],
    docs.map((t) => ({ attrs: { "data-termination": t.id }, cells: [
      cell("mono", link("terminations", t.id, t.id), h("br"), h("span", { class: "muted" }, when(t.requested_at))),
      agentLink(t.subject), t.mode, `${t.window_s}s`,
      cell("termination-state", state(t.state)), steps(t), agents(t.agents),
      t.record_id ? link("records", t.record_id, "Open record", { class: "record-link" }) : h("span", { class: "muted" }, "pending"),
    ] }))));
  return "Terminations";
}

async function renderOne(id, current) {
  const body = document.getElementById("terminations-body");
  const trail = crumbs("terminations", "Terminations", id);
  const t = await one(body, `/v1/terminations/${encodeURIComponent(id)}`, current, trail);
  if (!t || !current() || !changed(body, [t, Math.floor(Date.now() / 60000)])) return `${id} · Terminations`;
  replace(body, trail,
    h("h3", {}, "Termination ", h("code", {}, t.id), " ", h("span", { class: "termination-state" }, state(t.state))),
    h("div", { class: "card" },
      steps(t),
      dl([
        ["Subject", agentLink(t.subject)],
        ["Mode", `${t.mode}, window ${t.window_s}s (grace ${t.grace_s ?? "—"}s)`],
        ["Reason", t.reason || "—"],
        ["Requested", [byText(t.requested_by, t.operator), " at ", at(t.requested_at)]],
        ["Deadline", t.deadline ? at(t.deadline) : null],
        ["Completed", t.completed_at ? at(t.completed_at) : null],
        ["Agents", agents(t.agents)],
        ["Acknowledged", t.acknowledged ? (t.acknowledged.length ? agents(t.acknowledged) : "none yet") : null],
        ["Waiting for", t.waiting_for && t.waiting_for.length ? agents(t.waiting_for) : null],
        ["Record", t.record_id ? link("records", t.record_id, t.record_id, { class: "record-link" }) : "not written yet"],
      ])),
    h("h3", {}, "History"),
    table("History", ["State", "At"], (t.history || []).map((s) => [state(s.state), at(s.at)]), { class: "compact" }));
  return `${id} · Terminations`;
}
