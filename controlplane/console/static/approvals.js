// Held calls: the exact request (redacted as captures are), where the agent sits, approve or deny.
import { ago, api, byText, h, replace, state, toast } from "./api.js";

function requestText(req) {
  const lines = [`${req.method} ${req.url}`, ...req.headers.map(([k, v]) => `${k}: ${v}`), ""];
  lines.push(req.body_encoding === "base64" ? `[binary body, base64]\n${req.body}` : req.body);
  return lines.join("\n");
}

function card(a) {
  const req = a.request;
  const pending = a.status === "pending";
  const size = req ? `${req.body_size} bytes${req.body_truncated ? `, first ${req.body.length} shown` : ""}` : "";
  return h("article", { class: "card approval", "data-approval": a.id, "aria-labelledby": `apr-${a.id}` },
    h("h3", { id: `apr-${a.id}` }, `${a.capability} `, h("span", { class: "muted" }, `from ${a.agent}`), " ", state(a.status)),
    h("dl", {},
      h("dt", {}, "Approval"), h("dd", { class: "mono" }, a.id),
      h("dt", {}, "Chain"), h("dd", {}, (a.chain || [a.agent]).join(" › ")),
      h("dt", {}, "Call"), h("dd", { class: "mono" }, a.call_id),
      h("dt", {}, "Asked"), h("dd", {}, ago(a.requested_at)),
      h("dt", {}, "May decide"), h("dd", {}, (a.deciders || ["admin"]).join(", ")),
      a.decided_at ? [h("dt", {}, "Decided"), h("dd", { class: "decided-by" }, `${a.status} by ${byText(a.decided_by, a.operator)}, ${ago(a.decided_at)}`)] : null,
      req ? [h("dt", {}, "Call hash"), h("dd", { class: "mono call-hash" }, req.call_hash),
             h("dt", {}, "Body"), h("dd", {}, size)] : null),
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
  return (await api("GET", "/v1/approvals?status=pending")).length;
}

export async function render() {
  const docs = await api("GET", "/v1/approvals");
  docs.sort((x, y) => (x.status === "pending" ? 0 : 1) - (y.status === "pending" ? 0 : 1) || y.requested_at - x.requested_at);
  const body = document.getElementById("approvals-body");
  replace(body, docs.length ? docs.slice(0, 50).map(card) : h("p", {}, "No approvals yet."));
}
