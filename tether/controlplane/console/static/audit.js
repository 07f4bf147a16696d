// Two audit surface files side by side, and what widened between them (computed by the control plane).
import { api, h, replace } from "./api.js";

async function readFile(input) {
  const file = input.files[0];
  if (!file) throw new Error(`choose a file for "${input.labels[0].textContent}"`);
  return JSON.parse(await file.text());
}

export async function render() { return "Audit"; }

export function bind() {
  document.getElementById("audit-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const out = document.getElementById("audit-result");
    try {
      const [old, fresh] = await Promise.all([readFile(document.getElementById("audit-old")),
                                              readFile(document.getElementById("audit-new"))]);
      const diff = await api("POST", "/v1/audit/diff", { old, new: fresh });
      replace(out,
        h("h3", {}, diff.widened.length ? `${diff.widened.length} widening(s)` : "Nothing widened"),
        diff.widened.length ? h("ul", { "aria-label": "What widened" },
          diff.widened.map((w) => h("li", { class: "widened" }, w))) : null,
        h("div", { class: "side" },
          h("figure", {}, h("figcaption", {}, "Old"), h("pre", {}, JSON.stringify(old, null, 2))),
          h("figure", {}, h("figcaption", {}, "New"), h("pre", {}, JSON.stringify(fresh, null, 2)))));
    } catch (err) {
      replace(out, h("p", { class: "error", role: "alert" }, `${err.code || "error"}: ${err.message}`));
    }
  });
}
