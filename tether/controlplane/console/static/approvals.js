// Held calls: the exact request, whole (redacted as captures are), where the agent sits, approve or deny; and
// who decided, when. Nothing pending is ever out of sight: a count per agent (held calls and filed requests
// apart), a filter by agent, and pages to the end. Each approval has its own page (/ui/approvals/ID).
import { agentLink, api, at, byText, changed, crumbs, dl, h, href, link, navigate, one, page, replace, state, toast } from "./api.js";

export const PAGE = 20;

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

// Who decided and when; an expired one says nobody did.
function decision(a) {
  if (a.decided_at) return [`${a.status} by `, h("strong", {}, byText(a.decided_by, a.operator)), " at ", at(a.decided_at)];
  if (a.status === "expired") return ["nobody decided; it expired at ", at(a.expires_at)];
  return null;
}

function card(a, reload) {
  const req = a.request;
  const pending = a.status === "pending";
  const size = req ? `${req.body_size} bytes${req.body_truncated ? `, first ${req.body.length} shown` : ", shown whole"}` : "";
  return h("article", { class: "card approval", "data-approval": a.id, "data-origin": a.origin || "", "aria-labelledby": `apr-${a.id}` },
    h("h3", { id: `apr-${a.id}` }, h("code", {}, a.capability), " ", h("span", { class: "muted" }, "from "), agentLink(a.agent), " ",
      state(a.status), " ", origin(a)),
    dl([
      ["Approval", link("approvals", a.id, a.id, { class: "mono approval-link" })],
      ["Chain", (a.chain || [a.agent]).flatMap((x, i) => [i ? " › " : "", agentLink(x)])],
      ["Call", link("calls", a.call_id, a.call_id, { class: "mono" })],
      ["Asked", at(a.requested_at)],
      [pending ? "Expires" : null, pending ? at(a.expires_at) : null],
      ["May decide", (a.deciders || ["admin"]).join(", ")],
      ["Origin", a.origin ? ORIGIN[a.origin][1] : null],
      ["Decided", decision(a), "decided-by"],
      ["Call hash", req ? req.call_hash : null, "mono call-hash"],
      ["Body", req ? size : null, "body-size"],
    ].filter((p) => p[0] !== null)),
    req ? h("pre", { class: "request", "aria-label": "The held request" }, requestText(req))
        : h("p", { class: "muted" }, `${a.method} ${a.url} (the sidecar sent no request details)`),
    pending ? h("div", { class: "actions" },
      h("button", { type: "button", class: "primary", onclick: () => decide(a, "approve", reload) }, "Approve this call"),
      h("button", { type: "button", class: "danger", onclick: () => decide(a, "deny", reload) }, "Deny")) : null);
}

async function decide(a, action, reload) {
  try {
    const body = action === "approve" && a.request ? { call_hash: a.request.call_hash } : {};
    const doc = await api("POST", `/v1/approvals/${encodeURIComponent(a.id)}/${action}`, body);
    toast(`${a.id}: ${doc.status}`);
    await reload();
  } catch (e) {
    toast(`${e.code}: ${e.message}`);
  }
}

export async function pendingCount() {
  return (await api("GET", "/v1/approvals/summary")).pending;
}

function to(agent, pageNo) { return href("approvals", null, { agent, page: pageNo ? pageNo + 1 : null }); }

function counts(summary, agent) {
  const agents = Object.entries(summary.agents);
  if (!agents.length) return null;
  return h("table", { class: "pending-counts rows compact", "aria-label": "Pending approvals per agent" },
    h("thead", {}, h("tr", {}, h("th", {}, "Agent"), h("th", {}, "Pending"), h("th", {}, "Held calls"),
      h("th", {}, "Filed requests"), h("th", {}, ""))),
    h("tbody", {}, agents.map(([name, c]) => h("tr", { "data-agent": name },
      h("td", { "data-label": "Agent" }, agentLink(name)), h("td", { class: "count-pending", "data-label": "Pending" }, c.pending),
      h("td", { class: "count-held", "data-label": "Held calls" }, c.held),
      h("td", { class: "count-filed", "data-label": "Filed requests" }, c.filed),
      h("td", { class: "actions" }, agent === name
        ? h("button", { type: "button", onclick: () => navigate(to(null, 0)) }, "Show every agent")
        : h("button", { type: "button", onclick: () => navigate(to(name, 0)), "aria-label": `Show only ${name}` }, "Show only"))))));
}

function pager(total, pageNo, agent) {
  const pages = Math.max(1, Math.ceil(total / PAGE));
  const first = total ? pageNo * PAGE + 1 : 0;
  const last = Math.min(total, (pageNo + 1) * PAGE);
  return h("nav", { class: "pager", "aria-label": "Approval pages" },
    h("button", { type: "button", disabled: pageNo === 0, onclick: () => navigate(to(agent, pageNo - 1)) }, "Previous page"),
    h("span", { class: "page-of" }, `${first}–${last} of ${total}${agent ? ` from ${agent}` : ""} (page ${pageNo + 1} of ${pages})`),
    h("button", { type: "button", disabled: pageNo + 1 >= pages, onclick: () => navigate(to(agent, pageNo + 1)) }, "Next page"));
}

export async function render(r, current) {
  const body = document.getElementById("approvals-body");
  const reload = () => { navigate(window.location.pathname + window.location.search, true); };
  if (r.id) return renderOne(r.id, body, current, reload);
  const agent = r.query.get("agent") || null;
  let pageNo = Math.max(0, Number(r.query.get("page") || 1) - 1);
  const summary = await api("GET", "/v1/approvals/summary");
  const filter = agent ? `&agent=${encodeURIComponent(agent)}` : "";
  let resp = await page(`/v1/approvals?offset=${pageNo * PAGE}&limit=${PAGE}${filter}`);
  if (resp.docs.length === 0 && pageNo > 0) {  // the page emptied (decisions): back to the last one there is
    pageNo = Math.max(0, Math.ceil(resp.total / PAGE) - 1);
    resp = await page(`/v1/approvals?offset=${pageNo * PAGE}&limit=${PAGE}${filter}`);
  }
  if (!current() || !changed(body, [agent, pageNo, summary, resp, Math.floor(Date.now() / 60000)])) return "Approvals";
  const line = summary.pending
    ? `${summary.pending} pending: ${summary.held} held by a sidecar, ${summary.filed} filed without a held call.`
    : "Nothing is waiting for a decision.";
  replace(body,
    h("p", { class: "muted" }, "Held calls wait here for a person, each shown whole. A decision binds to the exact call shown ",
      "(its hash). Requests filed with an agent's key that no sidecar holds are marked ", h("em", {}, "filed"), "."),
    h("p", { class: "pending-summary" }, line), counts(summary, agent), pager(resp.total, pageNo, agent),
    resp.docs.length ? resp.docs.map((a) => card(a, reload)) : h("p", {}, "No approvals yet."),
    resp.total > PAGE ? pager(resp.total, pageNo, agent) : null);
  return agent ? `${agent} · Approvals` : "Approvals";
}

async function renderOne(id, body, current, reload) {
  const trail = crumbs("approvals", "Approvals", id);
  const a = await one(body, `/v1/approvals/${encodeURIComponent(id)}`, current, trail);
  if (a && current() && changed(body, [a, Math.floor(Date.now() / 60000)])) replace(body, trail, card(a, reload));
  return `${id} · Approvals`;
}
