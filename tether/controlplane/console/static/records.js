// Reconciliation records: the log's verification and checkpoint, and each record's page (/ui/records/ID) with
// its calls, filterable (?q=...&resolution=..., so a filtered view can be linked), each call linking to its
// own page, and the record's HAR.
import { agentLink, api, at, byText, cell, changed, crumbs, dl, forget, h, href, link, navigate, one, replace, state, table, when }
  from "./api.js";
import { callsTable, RESOLUTIONS } from "./calls.js";

function verificationBlock(verification) {
  const cp = verification.checkpoint;
  const witnesses = cp && cp.witnesses.length
    ? cp.witnesses.map((w) => `${w.name || w.url}: ${w.cosigned ? `cosigned ${w.size}` : "not cosigned yet"}`).join("; ")
    : "no witness configured";
  return h("div", { id: "records-verify", role: "status" },
    h("p", {}, "Record log: ", state(verification.valid ? "verified" : "failed"),
      ` (${verification.count} record(s)${verification.problems.length ? `; ${verification.problems.join("; ")}` : ""})`),
    cp ? h("p", { id: "records-checkpoint" }, `Checkpoint: ${cp.origin}, ${cp.size} record(s); witnesses: ${witnesses}`) : null,
    cp ? h("details", {}, h("summary", {}, "Signed checkpoint"), h("pre", { class: "mono" }, cp.note)) : null);
}

export async function render(r, current) {
  if (r.id) return renderRecord(r, current);
  const [records, verification] = await Promise.all([api("GET", "/v1/records"), api("GET", "/v1/audit/records")]);
  if (!current()) return null;
  const body = document.getElementById("records-body");
  delete body.dataset.record;  // a record's page is made again when it is opened again
  if (!changed(body, [records.map((x) => x.hash), verification])) return "Records";
  replace(body, verificationBlock(verification),
    records.length ? table("Records", ["Record", "Termination", "Subject", "Mode", "Completed", "Calls", "Unaccounted",
      "Verification", "Proved"], records.slice().reverse().map((rec) => {
      const v = verification.records[rec.record_id] || { verified: false };
      return { attrs: { "data-record": rec.record_id }, cells: [
        cell("mono", link("records", rec.record_id, rec.record_id, { class: "record-link" })),
        cell("mono", link("terminations", rec.termination_id, rec.termination_id)), agentLink(rec.subject),
        rec.mode, cell("nowrap", when(rec.completed_at)), String(rec.calls.length),
        String((rec.agents_unaccounted || []).length),
        cell("verification", state(v.verified ? "verified" : "failed")),
        cell("proved", v.proved ? "in the checkpoint" : "not yet")] };
    })) : h("p", {}, "No record yet."));
  return "Records";
}

// Where terminations overlap a call belongs to one record: say which others this one amends, accounts for, or
// leaves calls to.
function overlap(r) {
  return [
    ["Amends", r.amends ? link("records", r.amends, r.amends) : null],
    ["Accounts for", (r.accounts_for || []).length ? r.accounts_for.map((a, i) => [i ? "; " : "", link("records", a.record_id, a.record_id),
      ` (${a.termination_id}): ${[...a.agents, ...a.call_ids.map((c) => `call ${c}`)].join(", ")}`]) : null],
    ["Calls held by", (r.calls_held_by || []).length ? r.calls_held_by.map((c, i) => [i ? "; " : "", link("records", c.record_id, c.record_id),
      ` (${c.termination_id}): ${c.calls} call(s)`]) : null],
  ];
}

function summary(rec, v) {
  const har = `/v1/captures/har?termination=${encodeURIComponent(rec.termination_id)}`;
  const names = (list) => (list || []).map((a) => typeof a === "string" ? a : a.agent);
  return h("div", { class: "card" }, dl([
    ["Verification", [state(v && v.verified ? "verified" : "failed"), v && v.problems.length ? ` ${v.problems.join("; ")}` : "",
      v && v.proved ? " (in the checkpoint)" : ""]],
    ["Termination", link("terminations", rec.termination_id, rec.termination_id, { class: "mono" })],
    ["Subject", [agentLink(rec.subject), ` (${rec.mode}, window ${rec.window_s}s)`]],
    ["Reason", rec.reason || null],
    ["Requested", [byText(rec.requested_by, rec.operator), " at ", at(rec.requested_at)]],
    ["Completed", at(rec.completed_at)],
    ["Terminated", names(rec.agents_terminated).length ? names(rec.agents_terminated).flatMap((a, i) => [i ? ", " : "", agentLink(a)]) : "—"],
    ["Unaccounted", (rec.agents_unaccounted || []).length ? rec.agents_unaccounted.map((a, i) => [i ? "; " : "", agentLink(a.agent),
      ` (last seen ${when(a.last_seen)}, ${a.calls_in_flight_last_known ?? "?"} in flight)`]) : "none"],
    ...overlap(rec),
    ["Hash", rec.hash, "mono"],
  ]), h("a", { href: har, download: `${rec.termination_id}.har`, id: "har-link" }, "Download the HAR of this record's calls"));
}

function filterForm(r) {
  const q = h("input", { id: "filter-text", type: "search", value: r.query.get("q") || "", placeholder: "agent, capability, URL, call id, code" });
  const res = h("select", { id: "filter-resolution" }, h("option", { value: "" }, "any"),
    RESOLUTIONS.map((v) => h("option", { value: v, selected: r.query.get("resolution") === v }, v)));
  const apply = () => navigate(href("records", r.id, { q: q.value.trim(), resolution: res.value }), true);
  q.addEventListener("input", apply);
  res.addEventListener("change", apply);
  return h("form", { id: "record-filter", class: "filters", "aria-label": "Filter calls", onsubmit: (e) => e.preventDefault() },
    h("label", { for: "filter-text" }, "Filter"), q, h("label", { for: "filter-resolution" }, "Resolution"), res);
}

async function renderRecord(r, current) {
  const body = document.getElementById("records-body");
  const [rec, verification] = await Promise.all([
    one(body, `/v1/records/${encodeURIComponent(r.id)}`, current, crumbs("records", "Records", r.id)), api("GET", "/v1/audit/records")]);
  if (!rec) { delete body.dataset.record; return `${r.id} · Records`; }
  if (!current()) return null;
  if (body.dataset.record !== rec.record_id) {  // the skeleton once per record: typing in the filter is never interrupted
    body.dataset.record = rec.record_id;
    forget(body);
    replace(body, crumbs("records", "Records", rec.record_id),
      h("h3", { id: "record-title" }, `Record ${rec.record_id}`), h("div", { id: "record-summary" }),
      h("h3", {}, "Calls"), filterForm(r), h("div", { id: "record-calls" }));
  }
  const v = verification.records[rec.record_id];
  const summaryEl = document.getElementById("record-summary");
  if (changed(summaryEl, [rec.hash, v])) replace(summaryEl, summary(rec, v));
  const text = (r.query.get("q") || "").toLowerCase();
  const wanted = r.query.get("resolution") || "";
  for (const [id, value] of [["filter-text", r.query.get("q") || ""], ["filter-resolution", wanted]]) {
    const input = document.getElementById(id);
    if (document.activeElement !== input) input.value = value;
  }
  const calls = rec.calls.filter((c) => (!wanted || c.resolution === wanted) &&
    (!text || [c.agent, c.capability, c.url, c.call_id, c.method, c.code].some((f) => String(f ?? "").toLowerCase().includes(text))));
  const callsEl = document.getElementById("record-calls");
  if (changed(callsEl, [rec.hash, text, wanted])) {
    replace(callsEl, h("p", { class: "muted", role: "status" }, `${calls.length} of ${rec.calls.length} call(s)`),
      callsTable("Calls in this record", calls));
  }
  return `${rec.record_id} · Records`;
}
