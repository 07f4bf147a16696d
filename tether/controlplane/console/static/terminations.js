// Terminations and where each stands in the protocol: requested -> draining|aborting -> reconciling -> terminated.
import { api, h, replace, state, when } from "./api.js";

function steps(t) {
  const path = ["requested", t.mode === "abort" ? "aborting" : "draining", "reconciling", "terminated"];
  const at = Object.fromEntries((t.history || []).map((s) => [s.state, s.at]));
  const current = path.indexOf(t.state);
  return h("ol", { class: "steps", "aria-label": `Progress: ${t.state}` }, path.map((s, i) =>
    h("li", { class: i < current || t.state === "terminated" ? "done" : i === current ? "current" : "",
              "aria-current": i === current ? "step" : null, title: at[s] ? when(at[s]) : "not yet" }, s)));
}

export async function render() {
  const docs = await api("GET", "/v1/terminations");
  docs.sort((a, b) => b.requested_at - a.requested_at);
  const body = document.getElementById("terminations-body");
  if (!docs.length) { replace(body, h("p", {}, "No termination yet.")); return; }
  replace(body, h("table", { "aria-label": "Terminations" },
    h("thead", {}, h("tr", {}, ["Termination", "Subject", "Mode", "Window", "State", "Progress", "Agents", "Record"]
      .map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, docs.map((t) => h("tr", { "data-termination": t.id },
      h("td", { class: "mono" }, t.id, h("br"), h("span", { class: "muted" }, when(t.requested_at))),
      h("td", {}, t.subject),
      h("td", {}, t.mode),
      h("td", {}, `${t.window_s}s`),
      h("td", { class: "termination-state" }, state(t.state)),
      h("td", {}, steps(t)),
      h("td", {}, (t.agents || []).join(", ")),
      h("td", {}, t.record_id
        ? h("button", { type: "button", onclick: () => openRecord(t.record_id) }, "Open record")
        : h("span", { class: "muted" }, "pending")),
    )))));
}

function openRecord(id) {
  document.dispatchEvent(new CustomEvent("tether:open-record", { detail: id }));
}
