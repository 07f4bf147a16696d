// Reconciliation records: the log's verification, each record's calls (filterable), HAR download.
import { api, byText, h, replace, state, when } from "./api.js";

let current = null;

export async function render() {
  const [records, verification] = await Promise.all([api("GET", "/v1/records"), api("GET", "/v1/audit/records")]);
  const cp = verification.checkpoint;
  const witnesses = cp && cp.witnesses.length
    ? cp.witnesses.map((w) => `${w.name || w.url}: ${w.cosigned ? `cosigned ${w.size}` : "not cosigned yet"}`).join("; ")
    : "no witness configured";
  replace(document.getElementById("records-verify"),
    h("p", {}, "Record log: ", state(verification.valid ? "verified" : "failed"),
      ` (${verification.count} record(s)${verification.problems.length ? `; ${verification.problems.join("; ")}` : ""})`),
    cp ? h("p", { id: "records-checkpoint" }, `Checkpoint: ${cp.origin}, ${cp.size} record(s); witnesses: ${witnesses}`) : null,
    cp ? h("details", {}, h("summary", {}, "Signed checkpoint"), h("pre", { class: "mono" }, cp.note)) : null);
  const list = document.getElementById("records-list");
  if (!records.length) { replace(list, h("p", {}, "No record yet.")); return; }
  replace(list, h("table", { "aria-label": "Records" },
    h("thead", {}, h("tr", {}, ["Record", "Termination", "Subject", "Mode", "Completed", "Calls", "Unaccounted",
      "Verification", "Proved", ""].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, records.slice().reverse().map((r) => {
      const v = verification.records[r.record_id] || { verified: false };
      return h("tr", { "data-record": r.record_id },
        h("td", { class: "mono" }, r.record_id), h("td", { class: "mono" }, r.termination_id), h("td", {}, r.subject),
        h("td", {}, r.mode), h("td", {}, when(r.completed_at)), h("td", {}, String(r.calls.length)),
        h("td", {}, String((r.agents_unaccounted || []).length)),
        h("td", { class: "verification" }, state(v.verified ? "verified" : "failed")),
        h("td", { class: "proved" }, v.proved ? "in the checkpoint" : "not yet"),
        h("td", {}, h("button", { type: "button", onclick: () => show(r, v) }, "Open")));
    }))));
  if (current) {
    const fresh = records.find((r) => r.record_id === current.record_id);
    if (fresh && fresh.hash !== current.hash) show(fresh, verification.records[fresh.record_id]);
  }
}

export async function open(id) {
  const record = await api("GET", `/v1/records/${encodeURIComponent(id)}`);
  const verification = await api("GET", "/v1/audit/records");
  show(record, verification.records[record.record_id]);
}

function show(r, v) {
  current = r;
  document.getElementById("record-detail").hidden = false;
  document.getElementById("record-title").textContent = `Record ${r.record_id}`;
  const har = `/v1/captures/har?termination=${encodeURIComponent(r.termination_id)}`;
  replace(document.getElementById("record-summary"), h("div", { class: "card" }, h("dl", {},
    h("dt", {}, "Verification"), h("dd", {}, state(v && v.verified ? "verified" : "failed"),
      v && v.problems.length ? ` ${v.problems.join("; ")}` : ""),
    h("dt", {}, "Termination"), h("dd", { class: "mono" }, r.termination_id),
    h("dt", {}, "Subject"), h("dd", {}, `${r.subject} (${r.mode}, window ${r.window_s}s)`),
    h("dt", {}, "Requested"), h("dd", {}, `${when(r.requested_at)} by ${byText(r.requested_by, r.operator)}`),
    h("dt", {}, "Completed"), h("dd", {}, when(r.completed_at)),
    h("dt", {}, "Terminated"), h("dd", {}, (r.agents_terminated || []).map((a) => typeof a === "string" ? a : a.agent).join(", ") || "—"),
    h("dt", {}, "Unaccounted"), h("dd", {}, (r.agents_unaccounted || []).map((a) => a.agent).join(", ") || "none"),
    ...overlap(r),
    h("dt", {}, "Hash"), h("dd", { class: "mono" }, r.hash)),
    h("a", { href: har, download: `${r.termination_id}.har`, id: "har-link" }, "Download the HAR of this record's calls")));
  renderCalls();
  document.getElementById("record-detail").scrollIntoView({ block: "start" });
}

// Where terminations overlap a call belongs to one record: say which others this one amends, accounts for, or
// leaves calls to.
function overlap(r) {
  const rows = [];
  if (r.amends) rows.push(h("dt", {}, "Amends"), h("dd", { class: "mono" }, r.amends));
  if ((r.accounts_for || []).length) {
    rows.push(h("dt", {}, "Accounts for"), h("dd", {}, r.accounts_for.map((a) =>
      `${a.record_id} (${a.termination_id}): ${[...a.agents, ...a.call_ids.map((c) => `call ${c}`)].join(", ")}`)
      .join("; ")));
  }
  if ((r.calls_held_by || []).length) {
    rows.push(h("dt", {}, "Calls held by"), h("dd", {}, r.calls_held_by.map((c) =>
      `${c.record_id} (${c.termination_id}): ${c.calls} call(s)`).join("; ")));
  }
  return rows;
}

function renderCalls() {
  if (!current) return;
  const text = document.getElementById("filter-text").value.trim().toLowerCase();
  const resolution = document.getElementById("filter-resolution").value;
  const calls = current.calls.filter((c) => (!resolution || c.resolution === resolution) &&
    (!text || [c.agent, c.capability, c.url, c.call_id, c.method].some((f) => String(f ?? "").toLowerCase().includes(text))));
  replace(document.getElementById("record-calls"),
    h("p", { class: "muted", role: "status" }, `${calls.length} of ${current.calls.length} call(s)`),
    h("table", { "aria-label": "Calls in this record" },
      h("thead", {}, h("tr", {}, ["Started", "Agent", "Capability", "Call", "Resolution", "Status", "Capture"]
        .map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, calls.map((c) => h("tr", { "data-call": c.call_id },
        h("td", {}, when(c.started_at)), h("td", {}, c.agent), h("td", {}, c.capability ?? "—"),
        h("td", { class: "mono" }, `${c.method} ${c.url}`, h("br"), h("span", { class: "muted" }, c.call_id)),
        h("td", { class: "resolution" }, state(c.resolution)), h("td", {}, c.status ?? "—"),
        h("td", { class: "mono" }, c.capture_ref ?? "—"))))));
}

export function bindFilters() {
  document.getElementById("filter-text").addEventListener("input", renderCalls);
  document.getElementById("filter-resolution").addEventListener("change", renderCalls);
  document.getElementById("record-filter").addEventListener("submit", (e) => e.preventDefault());
}
