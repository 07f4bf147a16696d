// Search over agents and calls (/ui/search?q=...): agents whose name, jti, link, issuer, status or capabilities
// hold every word; calls the control plane finds (GET /v1/calls?q=); an id of an approval, termination or
// record opens it.
import { agentLink, api, cell, changed, h, href, page, replace, state, table, when } from "./api.js";
import { callsTable } from "./calls.js";

const SHOWN = 20;
const IDS = [[/^apr-/, "approvals", "approval"], [/^term-/, "terminations", "termination"], [/^rec-/, "records", "record"]];

function flatten(tree, out = []) {
  for (const n of tree) { out.push(n); flatten(n.children || [], out); }
  return out;
}

export function agentMatches(node, words) {
  const text = [node.agent, node.jti, node.link, node.issuer, node.status, ...Object.keys(node.caps || {}),
    node.sidecar ? node.sidecar.state : "no sidecar"].join(" ").toLowerCase();
  return words.every((w) => text.includes(w));
}

export async function render(r, current) {
  const body = document.getElementById("search-body");
  const q = (r.query.get("q") || "").trim();
  if (!q) {
    if (changed(body, "")) replace(body, h("p", { class: "muted" }, "Type words in the search box: an agent, a jti (or its start), a capability, a call id, a URL, a code such as tether.aborted."));
    return "Search";
  }
  const words = q.toLowerCase().split(/\s+/);
  const [agents, calls] = await Promise.all([api("GET", "/v1/agents"), page(`/v1/calls?q=${encodeURIComponent(q)}&limit=${SHOWN}`)]);
  if (!current()) return null;
  const found = flatten(agents.tree).filter((n) => agentMatches(n, words));
  if (!changed(body, [q, found.map((n) => [n.agent, n.jti, n.status]), calls])) return `${q} · Search`;
  const ids = IDS.filter(([re]) => re.test(q) && !/\s/.test(q));
  replace(body, h("div", { class: "results" },
    ids.length ? h("p", {}, ids.map(([, view, what]) => h("a", { href: href(view, q), class: "open-id" }, `Open ${what} ${q}`))) : null,
    h("h3", {}, `Agents (${found.length})`),
    found.length ? table("Matching agents", ["Agent", "Grant", "jti", "Expires", "Sidecar"], found.map((n) => ({
      attrs: { "data-agent": n.agent }, cells: [agentLink(n.agent), state(n.status), cell("mono", n.jti), cell("nowrap", when(n.exp)),
        n.sidecar ? state(n.sidecar.state) : h("span", { class: "muted" }, "no sidecar")] })))
      : h("p", { class: "muted" }, "No agent matches."),
    h("h3", {}, `Calls (${calls.total})`),
    calls.docs.length ? callsTable("Matching calls", calls.docs) : h("p", { class: "muted" }, "No call matches."),
    calls.total > calls.docs.length ? h("p", {}, h("a", { href: href("calls", null, { q }) }, `All ${calls.total} matching calls`)) : null));
  return `${q} · Search`;
}
