// The one confirmation dialog: names what an action cuts before anything is sent.
import { h, replace } from "./api.js";

export function confirmAction({ title, body, terminate = false, okLabel = "Confirm", run }) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = title;
  replace(document.getElementById("confirm-body"), body);
  document.getElementById("confirm-terminate").hidden = !terminate;  // revoke takes a reason only
  document.getElementById("confirm-mode").value = "drain";
  document.getElementById("confirm-window").value = "30";
  document.getElementById("confirm-reason").value = "";
  const error = document.getElementById("confirm-error");
  error.textContent = "";
  const ok = document.getElementById("confirm-ok");
  ok.textContent = okLabel;
  const cancel = document.getElementById("confirm-cancel");
  const close = () => { ok.onclick = null; cancel.onclick = null; dialog.close(); };
  cancel.onclick = close;
  ok.onclick = async () => {
    ok.disabled = true;
    try {
      await run({
        mode: document.getElementById("confirm-mode").value,
        window_s: Number(document.getElementById("confirm-window").value),
        reason: document.getElementById("confirm-reason").value,
      });
      close();
    } catch (e) {
      error.textContent = `${e.code || "error"}: ${e.message}`;
    } finally {
      ok.disabled = false;
    }
  };
  dialog.showModal();
}

export function subtreeList(subtree) {
  return h("ul", { "aria-label": "Agents that will be cut" }, subtree.agents.map((a) => h("li", {}, h("code", {}, a))));
}
