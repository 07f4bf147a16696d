// The agent tree: every registered link (its jti and expiry), its sidecar's state, lease and calls in flight;
// revoke and terminate, offered only where they would still do something. And one agent's page.
import { agentLink, agoText, api, at, ago, byText, cell, changed, crumbs, dl, h, href, link, page, replace, state, table, toast,
  when }
  from "./api.js";
import { callsTable } from "./calls.js";
import { confirmAction, subtreeList } from "./confirm.js";

const ENDED = ["terminated", "stopped", "superseded"];  // a run that said it will never forward again

function capsText(caps) {
  return Object.entries(caps || {}).map(([c, t]) => {
    if (typeof t !== "object" || t === null) return `${c}=${t}`;
    const budget = [t.calls !== undefined ? `calls=${t.calls}` : null, t.per_minute !== undefined ? `per_minute=${t.per_minute}` : null]
      .filter(Boolean);
    return `${c}=${t.tier}${budget.length ? `,${budget.join(",")}` : ""}`;
  }).join(", ");
}

// Calls in flight as far as the control plane knows: none once the run has ended (what it had in flight was
// resolved before it acknowledged, and the record has it); a lapsed run's last report, said to be that.
function inflight(sc) {
  if (!sc) return h("span", { class: "muted" }, "—");
  if (ENDED.includes(sc.state)) return h("span", { title: `its run ${sc.state}: nothing is in flight` }, "0");
  if (sc.state === "lapsed") return h("span", { title: "no heartbeat within its lease" }, `${sc.inflight} at its last heartbeat`);
  return String(sc.inflight);
}

// The latest termination that covers this link, if any.
function coveredBy(node, terminations) {
  return terminations.filter((t) => (t.links || []).includes(node.link) || (!t.links && (t.agents || []).includes(node.agent)))
    .sort((a, b) => b.requested_at - a.requested_at)[0] || null;
}

// Why a button would do nothing here (null: it would).
function revokeWhyNot(node) {
  const rev = node.revoked;
  if (node.status === "revoked") return `already revoked${rev ? ` by ${rev.termination_id || byText(rev.by, rev.operator)}` : ""}`;
  if (node.status === "expired") return `expired ${when(node.exp)}`;
  return null;
}

function terminateWhyNot(node, term) {
  if (term && term.state !== "terminated") return `being terminated (${term.id}: ${term.state})`;
  if (term) return `terminated by ${term.id}`;
  if (node.status === "expired" && !(node.sidecar && !ENDED.includes(node.sidecar.state) && node.sidecar.lease === "live")) {
    return `expired ${when(node.exp)}, no live sidecar`;
  }
  return null;
}

function actionButton(label, agent, cls, whyNot, run) {
  return h("span", {},
    h("button", { type: "button", class: cls, disabled: Boolean(whyNot), title: whyNot || null,
                  "aria-label": `${label} ${agent}`, onclick: () => run(agent) }, label));
}

function actions(node, term) {
  const noRevoke = revokeWhyNot(node);
  const noTerminate = terminateWhyNot(node, term);
  const done = term && term.state === "terminated" && noRevoke;
  const why = done ? [`Terminated by ${term.id}: nothing is left to revoke or stop.`]
    : [noRevoke && `Revoke: ${noRevoke}.`, noTerminate && `Terminate: ${noTerminate}.`].filter(Boolean);
  return [h("div", { class: "actions" },
      actionButton("Revoke", node.agent, null, noRevoke, revoke),
      actionButton("Terminate", node.agent, "danger", noTerminate, terminate)),
    why.length ? h("span", { class: "why-not" }, why.join(" ")) : null];
}

function grant(node, term) {
  const rev = node.revoked;
  const byTerm = rev && rev.termination_id && term && rev.termination_id === term.id;
  return [state(node.status),
    rev ? h("span", { class: "muted revoked-by" }, " by ", byTerm ? "termination" : byText(rev.by, rev.operator), " ", ago(rev.at)) : null,
    term ? h("div", {}, link("terminations", term.id, term.id), " ", state(term.state)) : null];
}

function linkCell(node) {
  return [h("code", { class: "jti", title: "jti: tether revoke takes it (or a unique prefix of it)" }, node.jti), h("br"),
    h("span", { class: node.exp * 1000 <= Date.now() ? "state-expired" : "muted" }, "expires ", h("time", { datetime: when(node.exp), title: agoText(node.exp) }, when(node.exp)))];
}

function sidecarCell(sc) {
  if (!sc) return h("span", { class: "muted" }, "no sidecar");
  return [h("span", { class: "sidecar-state" }, state(sc.state)), " ", h("span", { class: "lease" }, "lease ", state(sc.lease)),
    h("br"), h("span", { class: "muted" }, "seen ", ago(sc.last_seen))];
}

function rows(node, depth, terms, out) {
  const sc = node.sidecar;
  const term = coveredBy(node, terms);
  out.push({ attrs: { "data-agent": node.agent, "data-jti": node.jti }, cells: [
    cell("tree-name", h("span", { class: "indent", "aria-hidden": "true" }, depth ? "\u2003".repeat(depth - 1) + "└ " : ""),
      h("strong", {}, link("agents", node.agent, node.agent))),
    cell("grant", grant(node, term)),
    cell("link-cell", linkCell(node)),
    cell("sidecar", sidecarCell(sc)),
    cell("inflight", inflight(sc)),
    cell("mono caps", capsText(node.caps)),
    cell("actions-cell", actions(node, term)),
  ] });
  for (const child of node.children || []) rows(child, depth + 1, terms, out);
}

const COLUMNS = ["Agent", "Grant", "Link", "Sidecar", "In flight", "Capabilities", "Actions"];

export async function render(r, current) {
  if (r.id) return renderAgent(r.id, current);
  const [data, terms] = await Promise.all([api("GET", "/v1/agents"), api("GET", "/v1/terminations")]);
  if (!current()) return null;
  const body = document.getElementById("agents-body");
  if (!changed(body, [data, terms, Math.floor(Date.now() / 60000)])) return "Agents";
  if (!data.tree.length) { replace(body, h("p", {}, "No agent has registered a chain yet.")); return "Agents"; }
  const out = [];
  for (const root of data.tree) rows(root, 0, terms, out);
  replace(body,
    h("p", { class: "muted" }, "The delegation tree: each link's jti and expiry, its sidecar's state, lease and calls in flight. ",
      "Refreshed every 2 s. Open an agent for its runs, calls and terminations."),
    table("Agent tree", COLUMNS, out));
  return "Agents";
}

// -- one agent ---------------------------------------------------------------------------------------------
function capsTable(caps) {
  return table("Capabilities", ["Capability", "Tier", "Budget"], Object.entries(caps || {}).map(([c, t]) => {
    const tier = typeof t === "object" && t !== null ? t.tier : t;
    const budget = typeof t === "object" && t !== null
      ? [t.calls !== undefined ? `${t.calls} calls` : null, t.per_minute !== undefined ? `${t.per_minute}/min` : null].filter(Boolean).join(", ")
      : "";
    return [cell("mono", c), tier, budget || "—"];
  }), { class: "compact" });
}

function linkCard(node, term, tree) {
  const parent = tree.find((n) => n.link === node.parent_link);
  return h("article", { class: "card", "data-jti": node.jti, "aria-label": `Link ${node.jti}` },
    h("h3", {}, "Link ", h("code", {}, node.jti), " ", state(node.status)),
    dl([
      ["jti", h("code", { class: "jti" }, node.jti)],
      ["Link hash", h("code", {}, node.link)],
      ["Issued by", node.issuer === "tether:controlplane" ? "the control plane (a root grant)" : agentLink(node.issuer)],
      ["Parent link", parent ? h("code", {}, parent.jti) : null],
      ["Delegation depth left", node.depth ?? null],
      ["Expires", at(node.exp)],
      ["Registered by", node.registered_by ? byText(null, node.registered_by) : null],
      ["Revoked", node.revoked ? [byText(node.revoked.by, node.revoked.operator), " at ", at(node.revoked.at),
        node.revoked.reason ? `: ${node.revoked.reason}` : ""] : null],
      ["Revoked via", node.revoked_via && node.revoked_via !== node.jti ? h("code", {}, node.revoked_via) : null],
      ["Termination", term ? [link("terminations", term.id, term.id), " ", state(term.state)] : null],
    ]),
    capsTable(node.caps),
    actions(node, term));
}

function runsTable(runs) {
  if (!runs.length) return h("p", { class: "muted" }, "No sidecar has run for this agent.");
  return table("Sidecar runs", ["Run", "State", "Lease", "Last seen", "In flight", "Started", "Proxy", "PID"],
    runs.slice().reverse().map((run) => ({ attrs: { "data-run": run.run_id }, cells: [
      cell("mono", run.run_id), state(run.state), state(run.lease), ago(run.last_seen), inflight(run),
      at(run.started_at), cell("mono", run.proxy || "—"), run.pid ?? "—"] })));
}

function flatten(tree, out = []) {
  for (const n of tree) { out.push(n); flatten(n.children || [], out); }
  return out;
}

async function renderAgent(agent, current) {
  const q = encodeURIComponent(agent);
  const [data, terms, calls, summary] = await Promise.all([api("GET", "/v1/agents"), api("GET", "/v1/terminations"),
    page(`/v1/calls?agent=${q}&limit=20`), api("GET", "/v1/approvals/summary")]);
  if (!current()) return null;
  const body = document.getElementById("agents-body");
  const nodes = flatten(data.tree).filter((n) => n.agent === agent);
  if (!changed(body, [agent, nodes, terms, calls, summary.agents[agent], Math.floor(Date.now() / 60000)])) return `${agent} · Agents`;
  const trail = crumbs("agents", "Agents", agent);
  if (!nodes.length) {
    replace(body, trail, h("p", { class: "error", role: "alert" }, `No registered link is held by ${agent}.`));
    return `${agent} · Agents`;
  }
  const covering = terms.filter((t) => (t.agents || []).includes(agent)).sort((a, b) => b.requested_at - a.requested_at);
  const children = [...new Set(nodes.flatMap((n) => (n.children || []).map((c) => c.agent)))];
  const pending = summary.agents[agent];
  const runs = nodes.flatMap((n) => n.runs || []).sort((a, b) => (a.started_at || 0) - (b.started_at || 0));
  replace(body, trail,
    h("h3", { class: "agent-name" }, agent),
    nodes.map((n) => linkCard(n, coveredBy(n, terms), flatten(data.tree))),
    h("h3", {}, "Delegates"),
    children.length ? h("ul", { "aria-label": `Delegates of ${agent}` }, children.map((c) => h("li", {}, agentLink(c))))
      : h("p", { class: "muted" }, "None."),
    h("h3", {}, "Sidecar runs"), runsTable(runs),
    h("h3", {}, "Approvals"),
    h("p", {}, pending ? [`${pending.pending} pending (${pending.held} held, ${pending.filed} filed). `,
      h("a", { href: href("approvals", null, { agent }) }, `Show ${agent}'s approvals`)] : "None pending."),
    h("h3", {}, "Terminations"),
    covering.length ? h("ul", { "aria-label": "Terminations that cover this agent" }, covering.map((t) =>
      h("li", {}, link("terminations", t.id, t.id), " ", state(t.state), ` (${t.mode}, subject ${t.subject}) `, ago(t.requested_at))))
      : h("p", { class: "muted" }, "None."),
    h("h3", {}, "Latest calls"),
    calls.docs.length ? callsTable(`Calls of ${agent}`, calls.docs) : h("p", { class: "muted" }, "No call reported yet."),
    calls.total > calls.docs.length ? h("p", {}, h("a", { href: href("calls", null, { agent }) }, `All ${calls.total} calls of ${agent}`)) : null);
  return `${agent} · Agents`;
}

// -- the actions ---------------------------------------------------------------------------------------------
async function revoke(agent) {
  const subtree = await api("GET", `/v1/agents/${encodeURIComponent(agent)}/subtree`);
  confirmAction({
    title: `Revoke ${agent}?`,
    okLabel: `Revoke ${agent}`,
    body: [h("p", {}, `Every link ${agent} holds is revoked; every chain below it dies with it. `,
                 `${subtree.agents.length} agent(s) will be cut off:`), subtreeList(subtree),
           h("p", { class: "muted" }, "Calls in flight are not stopped: Terminate does that, and writes a record.")],
    run: async ({ reason }) => {
      await api("POST", `/v1/agents/${encodeURIComponent(agent)}/revoke`, { reason: reason || "revoked from the console" });
      toast(`revoked ${agent}`);
    },
  });
}

async function terminate(agent) {
  const subtree = await api("GET", `/v1/agents/${encodeURIComponent(agent)}/subtree`);
  confirmAction({
    title: `Terminate ${agent}?`,
    okLabel: `Terminate ${subtree.agents.length} agent(s)`,
    terminate: true,
    body: [h("p", {}, `Terminating ${agent} revokes and stops its whole subtree, `,
                 `${subtree.agents.length} agent(s):`), subtreeList(subtree)],
    run: async ({ mode, window_s, reason }) => {
      const doc = await api("POST", `/v1/agents/${encodeURIComponent(agent)}/terminate`,
        { mode, window_s, reason: reason || "terminated from the console" });
      toast(`termination ${doc.termination_id} requested`);
    },
  });
}
