// The agent tree: every registered link, its sidecar's state, lease and calls in flight; revoke and terminate.
import { ago, api, byText, h, replace, state, toast } from "./api.js";
import { confirmAction, subtreeList } from "./confirm.js";

function rows(node, depth, out) {
  const sc = node.sidecar;
  const caps = Object.entries(node.caps || {}).map(([c, t]) => `${c}=${typeof t === "object" ? t.tier : t}`).join(", ");
  out.push(h("tr", { "data-agent": node.agent },
    h("td", { class: "tree-name" },
      h("span", { class: "indent", "aria-hidden": "true" }, depth ? "\u2003".repeat(depth - 1) + "└ " : ""),
      h("strong", {}, node.agent)),
    h("td", {}, state(node.status), node.revoked ? h("span", { class: "muted revoked-by" }, ` by ${byText(node.revoked.by, node.revoked.operator)}`) : null),
    h("td", { class: "sidecar-state" }, sc ? state(sc.state) : h("span", { class: "muted" }, "no sidecar")),
    h("td", {}, sc ? [state(sc.lease), " ", h("span", { class: "muted" }, `seen ${ago(sc.last_seen)}`)] : "—"),
    h("td", { class: "inflight" }, sc ? String(sc.inflight) : "—"),
    h("td", { class: "mono" }, caps),
    h("td", { class: "actions" },
      h("button", { type: "button", onclick: () => revoke(node.agent), "aria-label": `Revoke ${node.agent}` }, "Revoke"),
      " ",
      h("button", { type: "button", class: "danger", onclick: () => terminate(node.agent),
                    "aria-label": `Terminate ${node.agent}` }, "Terminate"))));
  for (const child of node.children || []) rows(child, depth + 1, out);
}

export async function render() {
  const data = await api("GET", "/v1/agents");
  const body = document.getElementById("agents-body");
  if (!data.tree.length) { replace(body, h("p", {}, "No agent has registered a chain yet.")); return; }
  const out = [];
  for (const root of data.tree) rows(root, 0, out);
  replace(body, h("table", { "aria-label": "Agent tree" },
    h("thead", {}, h("tr", {}, ["Agent", "Grant", "Sidecar", "Lease", "In flight", "Capabilities", "Actions"]
      .map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, out)));
}

async function revoke(agent) {
  const subtree = await api("GET", `/v1/agents/${encodeURIComponent(agent)}/subtree`);
  confirmAction({
    title: `Revoke ${agent}?`,
    okLabel: `Revoke ${agent}`,
    body: [h("p", {}, `Every link ${agent} holds is revoked; every chain below it dies with it. `,
                 `${subtree.agents.length} agent(s) will be cut off:`), subtreeList(subtree)],
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
