// Held calls: the exact request, whole (redacted as captures are), where the agent sits, approve or deny.
// Nothing pending is ever out of sight: a count per agent (held calls and filed requests apart), a filter by
// agent, and pages to the end.
import { ago, api, ApiError, byText, h, replace, state, toast } from "./api.js";

export const PAGE = 20;
const view = { page: 0, agent: null };

function requestText(req) {
  const lines = [`${req.method} ${req.url}`, ...req.headers.map(([k, v]) => `${k}: ${v}`), ""];
  lines.push(req.body_encoding === "base64" ? `[binary body, base64]\n${req.body}` : req.body);
  return lines.join("\n");
}

const ORIGIN = {
  held: ["held call", "Its sidecar run reports this call held: it leaves only if approved."],
  filed: ["filed request", "No sidecar run reports holding this call: filed with the agent's key (or its sidecar's "
    + "next heartbeat has not come yet)."],
};

function origin(a) {
  const [label, title] = ORIGIN[a.origin] || [];
  return label ? h("span", { class: `origin origin-${a.origin}`, title }, label) : null;
}

function card(a) {
  const req = a.request;
  const pending = a.status === "pending";
  const size = req ? `${req.body_size} bytes${req.body_truncated ? `, first ${req.body.length} shown` : ", shown whole"}` : "";
  return h("article", { class: "card approval", "data-approval": a.id, "data-origin": a.origin || "", "aria-labelledby": `apr-${a.id}` },
    h("h3", { id: `apr-${a.id}` }, `${a.capability} `, h("span", { class: "muted" }, `from ${a.agent}`), " ", state(a.status), " ",
      origin(a)),
    h("dl", {},
      h("dt", {}, "Approval"), h("dd", { class: "mono" }, a.id),
      h("dt", {}, "Chain"), h("dd", {}, (a.chain || [a.agent]).join(" › ")),
      h("dt", {}, "Call"), h("dd", { class: "mono" }, a.call_id),
      h("dt", {}, "Asked"), h("dd", {}, ago(a.requested_at)),
      h("dt", {}, "May decide"), h("dd", {}, (a.deciders || ["admin"]).join(", ")),
      a.origin ? [h("dt", {}, "Origin"), h("dd", {}, ORIGIN[a.origin][1])] : null,
      a.decided_at ? [h("dt", {}, "Decided"), h("dd", { class: "decided-by" }, `${a.status} by ${byText(a.decided_by, a.operator)}, ${ago(a.decided_at)}`)] : null,
      req ? [h("dt", {}, "Call hash"), h("dd", { class: "mono call-hash" }, req.call_hash),
             h("dt", {}, "Body"), h("dd", { class: "body-size" }, size)] : null),
    req ? h("pre", { class: "request", "aria-label": "The held request" }, requestText(req))
        : h("p", { class: "muted" }, `${a.method} ${a.url} (the sidecar sent no request details)`),
    pending ? h("div", { class: "actions" },
      h("button", { type: "button", class: "primary", onclick: () => decide(a, "approve") }, "Approve this call"), " ",
      h("button", { type: "button", class: "danger", onclick: () => decide(a, "deny") }, "Deny")) : null);
}

async function decide(a, action) {
  try {
    const body = action === "approve" && a.request ? { call_hash: a.request.call_hash } : {};
    const doc = await api("POST", `/v1/approvals/${encodeURIComponent(a.id)}/${action}`, body);
    toast(`${a.id}: ${doc.status}`);
    await render();
  } catch (e) {
    toast(`${e.code}: ${e.message}`);
  }
}

export async function pendingCount() {
  return (await api("GET", "/v1/approvals/summary")).pending;
}

function go(page, agent = view.agent) {
  view.page = page;
  view.agent = agent;
  render().catch((e) => toast(`${e.code}: ${e.message}`));
}

function counts(summary) {
  const agents = Object.entries(summary.agents);
  if (!agents.length) return null;
  return h("table", { class: "pending-counts", "aria-label": "Pending approvals per agent" },
    h("thead", {}, h("tr", {}, h("th", {}, "Agent"), h("th", {}, "Pending"), h("th", {}, "Held calls"),
      h("th", {}, "Filed requests"), h("th", {}, ""))),
    h("tbody", {}, agents.map(([agent, c]) => h("tr", { "data-agent": agent },
      h("td", {}, agent), h("td", { class: "count-pending" }, c.pending), h("td", { class: "count-held" }, c.held),
      h("td", { class: "count-filed" }, c.filed),
      h("td", { class: "actions" }, view.agent === agent
        ? h("button", { type: "button", onclick: () => go(0, null) }, "Show every agent")
        : h("button", { type: "button", onclick: () => go(0, agent), "aria-label": `Show only ${agent}` }, "Show only"))))));
}

function pager(total) {
  const pages = Math.max(1, Math.ceil(total / PAGE));
  const first = total ? view.page * PAGE + 1 : 0;
  const last = Math.min(total, (view.page + 1) * PAGE);
  return h("nav", { class: "pager", "aria-label": "Approval pages" },
    h("button", { type: "button", disabled: view.page === 0, onclick: () => go(view.page - 1) }, "Previous page"), " ",
    h("span", { class: "page-of" }, `${first}–${last} of ${total}${view.agent ? ` from ${view.agent}` : ""} (page ${view.page + 1} of ${pages})`), " ",
    h("button", { type: "button", disabled: view.page + 1 >= pages, onclick: () => go(view.page + 1) }, "Next page"));
}

export async function render() {
  const summary = await api("GET", "/v1/approvals/summary");
  const agent = view.agent ? `&agent=${encodeURIComponent(view.agent)}` : "";
  let resp = await fetchPage(agent);
  if (resp.docs.length === 0 && view.page > 0) {  // the page emptied (decisions): back to the last one there is
    view.page = Math.max(0, Math.ceil(resp.total / PAGE) - 1);
    resp = await fetchPage(agent);
  }
  const body = document.getElementById("approvals-body");
  const line = summary.pending
    ? `${summary.pending} pending: ${summary.held} held by a sidecar, ${summary.filed} filed without a held call.`
    : "Nothing is waiting for a decision.";
  replace(body, h("p", { class: "pending-summary" }, line), counts(summary), pager(resp.total),
    resp.docs.length ? resp.docs.map(card) : h("p", {}, "No approvals yet."), resp.total > PAGE ? pager(resp.total) : null);
}

async function fetchPage(agent) {
  // api() gives the body only; the page needs the Tether-Total header too.
  const resp = await fetch(`/v1/approvals?offset=${view.page * PAGE}&limit=${PAGE}${agent}`,
    { headers: { Accept: "application/json" }, credentials: "same-origin" });
  const data = await resp.json().catch(() => null);
  if (!resp.ok) {
    const err = (data && data.error) || {};
    throw new ApiError(resp.status, err.code || "tether.http_error", err.message || `GET /v1/approvals: HTTP ${resp.status}`);
  }
  return { docs: data, total: Number(resp.headers.get("Tether-Total") || 0) };
}
