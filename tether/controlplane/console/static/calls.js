// Calls: search over every call the sidecars reported (GET /v1/calls), and one call's page with its captured
// request and response, redacted as captured (GET /v1/calls/{id}).
import { agentLink, at, byText, cell, changed, crumbs, dl, forget, h, href, link, navigate, one, page, replace, resolution, state,
  table, when } from "./api.js";

export const PAGE = 50;
export const RESOLUTIONS = ["completed", "refused", "failed_not_sent", "cancelled_not_sent", "unknown", "cancelled"];

// The calls of a record, an agent or a search, each linking to its own page.
export function callsTable(label, calls, attrs = {}) {
  return table(label, ["Started", "Agent", "Capability", "Call", "Resolution", "Status"], calls.map((c) => ({
    attrs: { "data-call": c.call_id }, cells: [
      cell("nowrap", when(c.started_at)), agentLink(c.agent), cell("mono", c.capability ?? "—"),
      cell("mono call", `${c.method ?? ""} ${c.url ?? ""}`, h("br"), link("calls", c.call_id, c.call_id, { class: "call-link" })),
      cell("resolution-cell", resolution(c)), c.status ?? "—"] })), attrs);
}

export async function render(r, current) {
  return r.id ? renderCall(r.id, current) : renderList(r, current);
}

// -- the search ----------------------------------------------------------------------------------------------
function filterForm(query) {
  const q = h("input", { id: "calls-q", type: "search", name: "q", value: query.get("q") || "",
                         placeholder: "words: agent, call id, capability, URL, code, termination" });
  const agent = h("input", { id: "calls-agent", type: "text", name: "agent", value: query.get("agent") || "", placeholder: "any" });
  const res = h("select", { id: "calls-resolution", name: "resolution" }, h("option", { value: "" }, "any"),
    RESOLUTIONS.map((v) => h("option", { value: v, selected: query.get("resolution") === v }, v)));
  let pending = null;
  const apply = () => {
    clearTimeout(pending);
    pending = setTimeout(() => navigate(href("calls", null, { q: q.value.trim(), agent: agent.value.trim(), resolution: res.value }), true), 250);
  };
  q.addEventListener("input", apply);
  agent.addEventListener("input", apply);
  res.addEventListener("change", apply);
  return h("form", { class: "filters", id: "calls-filter", "aria-label": "Search calls", role: "search",
                     onsubmit: (e) => { e.preventDefault(); apply(); } },
    h("label", { for: "calls-q" }, "Search"), q, h("label", { for: "calls-agent" }, "Agent"), agent,
    h("label", { for: "calls-resolution" }, "Resolution"), res);
}

function pager(r, total, pageNo) {
  const pages = Math.max(1, Math.ceil(total / PAGE));
  const to = (n) => href("calls", null, { q: r.query.get("q"), agent: r.query.get("agent"), resolution: r.query.get("resolution"),
                                          page: n ? n + 1 : null });
  return h("nav", { class: "pager", "aria-label": "Call pages" },
    pageNo > 0 ? h("a", { href: to(pageNo - 1) }, "Previous page") : null,
    h("span", { class: "page-of" }, total ? `${pageNo * PAGE + 1}–${Math.min(total, (pageNo + 1) * PAGE)} of ${total} (page ${pageNo + 1} of ${pages})` : "0 calls"),
    pageNo + 1 < pages ? h("a", { href: to(pageNo + 1) }, "Next page") : null);
}

async function renderList(r, current) {
  const body = document.getElementById("calls-body");
  if (!body.querySelector("#calls-filter")) {  // the form is made once: typing in it is never interrupted
    forget(body);
    replace(body, h("p", { class: "muted" }, "Every call the sidecars reported, newest first. Each word must match."),
      filterForm(r.query), h("div", { id: "calls-results", "aria-live": "polite" }));
  }
  for (const [id, key] of [["calls-q", "q"], ["calls-agent", "agent"], ["calls-resolution", "resolution"]]) {
    const input = document.getElementById(id);  // the address leads (a link, back, forward), but not over typing
    if (document.activeElement !== input) input.value = r.query.get(key) || "";
  }
  const pageNo = Math.max(0, Number(r.query.get("page") || 1) - 1);
  const params = new URLSearchParams({ offset: String(pageNo * PAGE), limit: String(PAGE) });
  for (const k of ["q", "agent", "resolution"]) if (r.query.get(k)) params.set(k, r.query.get(k));
  const found = await page(`/v1/calls?${params}`);
  if (!current()) return null;
  const results = document.getElementById("calls-results");
  if (changed(results, [params.toString(), found])) {
    replace(results, pager(r, found.total, pageNo),
      found.docs.length ? callsTable("Calls", found.docs) : h("p", {}, "No call matches."));
  }
  return r.query.get("q") ? `${r.query.get("q")} · Calls` : "Calls";
}

// -- one call ------------------------------------------------------------------------------------------------
function headerLines(headers) { return (headers || []).map((x) => `${x.name}: ${x.value}`); }

function bodyText(part, size) {
  if (!part || part.text === undefined || part.text === null || part.text === "") {
    return size > 0 ? `[${size} bytes, not captured as text]` : "";
  }
  const cut = part._truncated ? `\n[cut: first ${part.text.length} of ${part._truncated} characters; the HAR has all of it]` : "";
  return part.encoding === "base64" ? `[binary body, base64]\n${part.text}${cut}` : `${part.text}${cut}`;
}

function exchange(entry) {
  const req = entry.request;
  const resp = entry.response;
  const reqText = [`${req.method} ${req.url} ${req.httpVersion || ""}`.trim(), ...headerLines(req.headers), "",
    bodyText(req.postData, req.bodySize)].join("\n");
  const cut = resp.status === 0;
  const respText = cut ? `no response: ${resp._error || entry.comment || "none came back"}`
    : [`${resp.httpVersion || ""} ${resp.status} ${resp.statusText || ""}`.trim(), ...headerLines(resp.headers), "",
      bodyText(resp.content, resp.bodySize)].join("\n");
  return h("div", { class: "exchange" },
    h("figure", { class: "side-part" }, h("figcaption", {}, h("strong", {}, "Request"), " (as captured, redacted)"),
      h("pre", { class: "message", "aria-label": "Captured request" }, reqText)),
    h("figure", { class: "side-part" }, h("figcaption", {}, h("strong", {}, "Response"), cut ? " (none)" : ""),
      h("pre", { class: "message", "aria-label": "Captured response" }, respText)));
}

async function renderCall(id, current) {
  const body = document.getElementById("calls-body");
  const trail = crumbs("calls", "Calls", id);
  const doc = await one(body, `/v1/calls/${encodeURIComponent(id)}`, current, trail,
    "A call held for approval or still in flight is reported when it ends.");
  if (!doc || !current() || !changed(body, doc)) return `${id} · Calls`;
  const c = doc.call;
  const duration = c.started_at && c.ended_at ? `${Math.round((c.ended_at - c.started_at) * 1000)} ms` : null;
  replace(body, trail,
    h("h3", { class: "call-title mono" }, `${c.method ?? ""} ${c.url ?? ""}`),
    h("div", { class: "card" }, dl([
      ["Call", h("code", { class: "call-id" }, c.call_id)],
      ["Agent", agentLink(c.agent)],
      ["Capability", c.capability ? h("code", {}, c.capability) : "—"],
      ["Tier", c.tier ?? null],
      ["Resolution", resolution(c), "call-resolution"],
      ["Status", c.status ?? "—"],
      ["Detail", c.detail ?? null],
      ["Started", at(c.started_at)],
      ["Ended", c.ended_at ? [at(c.ended_at), duration ? `, after ${duration}` : ""] : null],
      ["Run", c.run_id ? h("code", {}, c.run_id) : null],
      ["Termination", c.termination_id ? link("terminations", c.termination_id, c.termination_id) : null],
      ["Re-sends", c.reissue_of ? link("calls", c.reissue_of, c.reissue_of) : null],
      ["Records", doc.records.length ? doc.records.map((x, i) => [i ? ", " : "", h("a", { href: href("records", x.record_id, { q: c.call_id }) }, x.record_id),
        ` (${x.termination_id})`]) : "in no record yet"],
      ["Approvals", doc.approvals.length ? doc.approvals.map((a, i) => [i ? "; " : "", link("approvals", a.id, a.id), " ", state(a.status),
        a.decided_at ? ` by ${byText(a.decided_by, a.operator)} at ${when(a.decided_at)}` : ""]) : null],
      ["Capture", c.capture_ref ? h("code", {}, c.capture_ref) : "—"],
    ])),
    h("h3", {}, "Captured request and response"),
    doc.capture ? [exchange(doc.capture),
      h("p", {}, h("a", { href: `/v1/captures/har?call=${encodeURIComponent(c.call_id)}`, download: `${c.call_id}.har`, id: "call-har" },
        "Download this call's HAR"))]
      : h("p", { class: "muted capture-note" }, doc.capture_note));
  return `${c.call_id} · Calls`;
}
