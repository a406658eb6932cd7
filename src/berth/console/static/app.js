// berth console: plain JavaScript, no build step; its one third-party file is uPlot, the chart
// library, vendored from npm (uPlot.iife.min.js; charts.js draws with it).
// It talks only to the leader that served it: /ui/session, /admin/* and /v1/*, with the
// session cookie the leader set at sign-in. Every state-changing call sends the session's
// CSRF token (X-CSRF-Token), which lives in this page's memory only.
"use strict";

const POLL_MS = 5000;
const DISCONNECTED = "the leader did not answer (disconnected)";
const state = { csrf: null, keyName: "", role: "admin", timers: [], aborts: [], page: null };

// -- DOM helpers (text only: nothing from the API is ever parsed as HTML) ---------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

// What a role may do: a control the signed-in key's role cannot use is hidden (style.css hides
// .needs-operator for a viewer, .needs-admin for a viewer or an operator); the API refuses it
// with 403 either way (berth.admin.roles).
function needs(role, el) {
  el.classList.add(`needs-${role}`);
  return el;
}

function meter(fraction, kind, label) {
  const bar = h("span");
  bar.style.width = `${Math.round(Math.max(0, Math.min(1, fraction)) * 100)}%`;
  return h("div", { class: `meter ${kind}`, role: "meter", "aria-label": label,
    "aria-valuemin": 0, "aria-valuemax": 100,
    "aria-valuenow": Math.round(fraction * 100) }, bar);
}

function facts(pairs) {
  return h("dl", { class: "facts" }, pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
}

function table(headers, rows, caption) {
  return h("div", { class: "table-wrap" }, h("table", {},
    caption ? h("caption", { class: "muted" }, caption) : null,
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", { scope: "col" }, x)))),
    h("tbody", {}, rows)));
}

function statusText(value) {
  return h("span", { class: `status-${value}` }, value);
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

function mib(bytes) {
  return `${Math.round(bytes / 1048576)} MiB`;
}

// Seconds as the API's durations read: "90s", "10m", "2h".
function durationText(seconds) {
  if (seconds >= 3600 && seconds % 3600 === 0) return `${seconds / 3600}h`;
  if (seconds >= 60 && seconds % 60 === 0) return `${seconds / 60}m`;
  return `${seconds}s`;
}

// "512 B", "16.0 KiB", "1.2 GiB"
function bytesText(bytes) {
  let value = bytes;
  for (const unit of ["B", "KiB", "MiB", "GiB"]) {
    if (value < 1024 || unit === "GiB") return unit === "B" ? `${value} B` : `${value.toFixed(1)} ${unit}`;
    value /= 1024;
  }
  return `${value.toFixed(1)} TiB`;
}

function sinceIso(iso) {
  return ago((Date.now() - Date.parse(iso)) / 1000);
}

// -- the API ----------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function setBanner(text) {
  const banner = document.getElementById("banner");
  banner.textContent = text || "";
  banner.hidden = !text;
}

async function call(method, path, body, extra) {
  const headers = { accept: "application/json" };
  if (body !== undefined) headers["content-type"] = "application/json";
  if (method !== "GET" && state.csrf) headers["x-csrf-token"] = state.csrf;
  let response;
  try {
    response = await fetch(path, {
      method, headers, credentials: "same-origin",
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: extra && extra.signal,
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    setBanner("Disconnected from the leader: retrying…");
    throw new ApiError(0, DISCONNECTED);
  }
  setBanner("");
  const shown = document.getElementById("page-error");
  if (shown.textContent === DISCONNECTED) shown.textContent = ""; // it is back
  if (response.status === 401 && !path.startsWith("/ui/session")) {
    showSignIn("Your session has ended: sign in again.");
    throw new ApiError(401, "signed out");
  }
  if (extra && extra.raw) {
    if (!response.ok) throw new ApiError(response.status, await errorText(response));
    return response;
  }
  if (!response.ok) throw new ApiError(response.status, await errorText(response));
  const type = response.headers.get("content-type") || "";
  return type.includes("json") ? response.json() : response.text();
}

// An edit form's save: PATCH `path` with `body`; on success the form (`editor`) is replaced by
// a status line `message` (id `doneId`) that takes the focus, and `refresh` redraws the page;
// a refusal is shown in `errorBox` (a 401 has already sent the page to sign-in).
async function saveEdit(editor, errorBox, path, body, doneId, message, refresh) {
  try {
    await call("PATCH", path, body);
    const saved = h("p", { class: "muted", id: doneId, role: "status", tabindex: -1 }, message);
    editor.replaceChildren(saved);
    saved.focus(); // the form the focus was in is gone
    await refresh();
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) return;
    errorBox.textContent = err.message;
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return `the leader answered ${response.status} ${response.statusText}`;
}

function showError(err) {
  if (err && err.name === "AbortError") return;
  if (err instanceof ApiError && err.status === 401) return;
  document.getElementById("page-error").textContent = err ? err.message : "";
}

function clearError() {
  document.getElementById("page-error").textContent = "";
}

// -- sign-in ----------------------------------------------------------------------------------

function showSignIn(message) {
  stopPage();
  state.csrf = null;
  document.getElementById("app").hidden = true;
  document.getElementById("signin").hidden = false;
  document.getElementById("signin-error").textContent = message || "";
  document.getElementById("signin-key").focus();
}

function showApp(session) {
  state.csrf = session.csrf_token;
  state.keyName = session.key_name;
  state.role = session.role || "admin";
  document.body.dataset.role = state.role;
  document.getElementById("signin").hidden = true;
  document.getElementById("app").hidden = false;
  document.getElementById("who").textContent =
    `signed in as ${session.key_name} (${state.role})`;
  route();
}

async function signIn(event) {
  event.preventDefault();
  const input = document.getElementById("signin-key");
  const errorBox = document.getElementById("signin-error");
  errorBox.textContent = "";
  try {
    const session = await call("POST", "/ui/session", { key: input.value });
    input.value = "";
    showApp(session);
  } catch (err) {
    errorBox.textContent = err.message;
  }
}

async function signOut() {
  stopPage(); // no poll may race the session's end
  try {
    await call("DELETE", "/ui/session");
  } catch (err) {
    showError(err);
  }
  showSignIn("Signed out.");
}

// -- pages ------------------------------------------------------------------------------------

function stopPage() {
  for (const id of state.timers) clearInterval(id);
  for (const ctl of state.aborts) ctl.abort();
  state.timers = [];
  state.aborts = [];
}

function every(ms, fn) {
  const run = () => fn().catch(showError);
  run();
  state.timers.push(setInterval(run, ms));
}

function route() {
  if (!state.csrf) return;
  const asked = (location.hash.replace(/^#\//, "") || "overview").split("/")[0];
  const name = PAGES[asked] ? asked : "overview";
  const page = PAGES[name];
  stopPage();
  clearError();
  for (const link of document.querySelectorAll("nav a")) {
    if (link.dataset.page === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  const main = document.getElementById("main");
  main.replaceChildren();
  state.page = name;
  page(main);
}

// Cluster: a card per node, polled every 5 s from /admin/nodes and /admin/metrics/snapshot;
// each card updated in place (its buttons keep the keyboard's focus), its traffic drawn by
// uPlot; cordon, uncordon and drain from the card.
function clusterPage(main) {
  const cards = h("div", { class: "cards", id: "node-cards" });
  const enrollBox = h("div", { id: "enroll-box" });
  const label = h("input", { id: "enroll-label", required: true, placeholder: "gpu-2" });
  const form = h("form", { class: "inline", onsubmit: async (e) => {
    e.preventDefault();
    try {
      const [issued, info] = await Promise.all([
        call("POST", "/admin/nodes/enroll", { label: label.value }),
        call("GET", "/admin/info"),
      ]);
      enrollBox.replaceChildren(h("div", { class: "card" },
        h("h3", {}, `Enroll ${issued.label}`),
        h("p", {}, "On the new GPU host, run (single use, expires ",
          new Date(issued.expires_at * 1000).toLocaleString(), "):"),
        h("pre", { class: "secret", id: "enroll-command" },
          `berth agent register --uri '${issued.uri}'\nberth agent start`),
        facts([["CA fingerprint", h("code", { id: "ca-fingerprint" }, info.ca_fingerprint)]])));
      label.value = "";
    } catch (err) { showError(err); }
  } }, h("label", {}, "New node label", label), h("button", { type: "submit" }, "Enroll a node"));
  main.append(h("h1", {}, "Cluster"), cards,
    needs("admin", h("section", { "aria-label": "Add a node" },
      h("h2", {}, "Add a node"), form, enrollBox)));

  const shown = new Map(); // node id -> its card
  const refresh = async () => {
    const [nodes, snapshot] = await Promise.all([
      call("GET", "/admin/nodes"), call("GET", "/admin/metrics/snapshot")]);
    const metrics = Object.fromEntries(snapshot.nodes.map((n) => [n.node, n]));
    for (const node of nodes) {
      let card = shown.get(node.id);
      if (!card) {
        card = nodeCard(node, refresh);
        shown.set(node.id, card);
        cards.append(card.element);
      }
      card.update(node, metrics[node.id]);
    }
    for (const [id, card] of shown) {
      if (!nodes.some((n) => n.id === id)) { card.element.remove(); shown.delete(id); }
    }
  };
  every(POLL_MS, refresh);
}

// What a node's maintenance reads as: "cordoned", "draining: 1 of 2 moved", "drained".
function maintenanceText(node) {
  return node.maintenance ? node.maintenance.summary : null;
}

function nodeCard(node, refresh) {
  const title = h("h3", {});
  const body = h("div", {});
  const drainBox = h("div", { class: "drain", "aria-live": "polite" });
  const act = async (button, method, path, body_) => {
    button.disabled = true;
    try { await call(method, path, body_); await refresh(); }
    catch (err) { showError(err); } finally { button.disabled = false; }
  };
  const cordonButton = h("button", { type: "button", class: "secondary" });
  const drainButton = h("button", { type: "button", class: "danger" }, "Drain");
  cordonButton.addEventListener("click", () => {
    const cordoned = cordonButton.dataset.cordoned === "true";
    act(cordonButton, cordoned ? "DELETE" : "POST", `/admin/nodes/${node.id}/cordon`);
  });
  drainButton.addEventListener("click", () => {
    if (!confirm(`Drain node ${node.label}? Its deployments are started elsewhere first, then ` +
      "stopped once their requests finish (at most 5 minutes later).")) return;
    act(drainButton, "POST", `/admin/nodes/${node.id}/drain`, { grace_s: 300 });
  });
  const chart = timeChart(`chart-node-${node.id}`, "requests per heartbeat, last minute",
    [{ label: "requests" }], { height: 90 });
  const element = h("article", { class: "card node", "data-node": node.id,
    "aria-label": `node ${node.label}` }, title, body, drainBox,
  needs("operator", h("div", { class: "actions" }, cordonButton, drainButton)), chart.element);

  function update(current, metrics) {
    const latest = metrics ? metrics.latest : null;
    const deployments = latest ? latest.deployments : [];
    const inFlight = deployments.reduce((sum, d) => sum + d.in_flight, 0);
    const p95s = deployments.map((d) => d.latency_p95_ms).filter((v) => typeof v === "number");
    const gpus = latest ? latest.gpus : [];
    const maintenance = current.maintenance;
    title.replaceChildren(current.label, " ",
      statusText(current.connected ? current.status : "unreachable"),
      ...(maintenance ? [" ", h("span", { class: `maintenance status-${maintenance.state}` },
        maintenanceText(current))] : []));
    body.replaceChildren(facts([
      ["host", current.hostname || "—"],
      ["agent", current.agent_version || "—"],
      ["GPUs", `${current.gpu_count} (${current.vram_total_mb} MiB)`],
      ["data path", h("span", { class: "data-path" }, current.data_path || "—",
        current.data_path_reason ? `: ${current.data_path_reason}` : "")],
      ["in flight", h("span", { class: "in-flight" }, String(inFlight))],
      ["p95", p95s.length ? `${Math.round(Math.max(...p95s))} ms` : "—"],
      ["heartbeat", current.last_heartbeat_at ? `${ago(Date.now() / 1000 - current.last_heartbeat_at)} ago` : "—"],
    ]),
    h("div", { class: "gpus" }, gpus.map((g) => h("div", { class: "gpu" },
      h("span", {}, `GPU ${g.index}`),
      meter((g.util_pct || 0) / 100, "util", `GPU ${g.index} utilisation ${g.util_pct ?? "unknown"}%`),
      meter(g.mem_total_bytes ? g.mem_used_bytes / g.mem_total_bytes : 0, "mem",
        `GPU ${g.index} memory ${mib(g.mem_used_bytes)} of ${mib(g.mem_total_bytes)}`),
      h("span", { class: "gpu-text" }, `${g.name}: ` +
        `${g.util_pct === null ? "utilisation not reported" : `${g.util_pct}% busy`}, ` +
        `${mib(g.mem_used_bytes)} of ${mib(g.mem_total_bytes)}`)))));
    drainBox.replaceChildren(...drainLines(maintenance));
    const cordoned = Boolean(maintenance);
    cordonButton.dataset.cordoned = String(cordoned);
    cordonButton.textContent = cordoned ? "Uncordon" : "Cordon";
    cordonButton.setAttribute("aria-label", `${cordoned ? "Uncordon" : "Cordon"} node ${current.label}`);
    drainButton.setAttribute("aria-label", `Drain node ${current.label}`);
    drainButton.hidden = Boolean(maintenance && maintenance.state === "draining");
    // Requests per heartbeat, summed over the node's deployments: growth of the counters.
    let xs = [];
    let rates = [];
    if (metrics) {
      const columns = Object.values(metrics.series.deployments);
      const totals = metrics.series.at.map((_, i) =>
        columns.reduce((sum, c) => sum + (c.requests_total[i] || 0), 0));
      rates = totals.slice(1).map((v, i) => Math.max(0, v - totals[i]));
      xs = metrics.series.at.slice(1);
    }
    chart.update(xs, [rates]);
  }
  return { element, update };
}

// A drain's lines in a node card: each deployment's step and why.
function drainLines(maintenance) {
  if (!maintenance || maintenance.state === "cordoned") {
    return maintenance ? [h("p", { class: "muted" }, "Nothing new is placed on this node.")] : [];
  }
  const reasons = Object.fromEntries(maintenance.actions.map((a) => [a.deployment_id, a.reason]));
  const rows = maintenance.moves.map((m) => h("li", { "data-move": m.deployment_id },
    h("span", { class: "mono" }, m.deployment_id), `: ${m.step}`,
    m.replacement_id ? ` (replacement ${m.replacement_id})` : "",
    reasons[m.deployment_id] || m.note ? ` — ${reasons[m.deployment_id] || m.note}` : ""));
  return [h("ul", { class: "moves" }, rows)];
}

// Deployments: the list, start, stop, and a log panel that follows.
function deploymentsPage(main) {
  const list = h("div", { id: "deployments" });
  const logs = h("section", { id: "log-panel", "aria-label": "deployment log" });
  const model = h("select", { id: "deploy-model", required: true });
  const node = h("select", { id: "deploy-node" });
  const engine = h("select", { id: "deploy-engine" },
    ["llamacpp", "vllm", "sglang"].map((x) => h("option", { value: x }, x)));
  const form = h("form", { class: "inline", onsubmit: async (e) => {
    e.preventDefault();
    const button = form.querySelector("button");
    button.disabled = true;
    try {
      await call("POST", "/admin/deployments", {
        model: model.value, engine: engine.value, node: node.value || null });
      await refresh();
    } catch (err) { showError(err); } finally { button.disabled = false; }
  } },
  h("label", {}, "Model", model), h("label", {}, "Node", node), h("label", {}, "Engine", engine),
  h("button", { type: "submit" }, "Start"));
  main.append(h("h1", {}, "Deployments"), needs("operator", form), list, logs);

  Promise.all([call("GET", "/admin/models"), call("GET", "/admin/nodes")]).then(([models, nodes]) => {
    model.replaceChildren(...models.map((m) => h("option", { value: m.name }, m.name)));
    node.replaceChildren(h("option", { value: "" }, "where it fits"),
      ...nodes.map((n) => h("option", { value: n.label }, n.label)));
  }).catch(showError);

  async function refresh() {
    // Active ones, and those that ended in the last 10 minutes (as `berth ps`), with why.
    const rows = await call("GET", "/admin/deployments?active=true&ended_within_s=600");
    const ended = (d) => d.state === "stopped" || d.state === "failed";
    list.replaceChildren(rows.length === 0 ? h("p", { class: "muted" }, "No deployments running.") :
      table(["id", "model", "served as", "state", "restarts", "node", "GPUs", "uptime", ""],
        rows.map((d) =>
        h("tr", { "data-deployment": d.id },
          h("td", { class: "mono" }, d.id), h("td", {}, d.model_name),
          h("td", {}, d.served_model_name || d.model_name),
          h("td", {}, statusText(d.state), d.failure_reason ? ` ${d.failure_reason}` : "",
            d.progress ? ` (${d.progress})` : ""),
          h("td", { title: d.last_exit_log || "" }, String(d.restart_count),
            d.last_exit ? ` (last exit: ${d.last_exit})` : ""),
          h("td", {}, d.node_label, d.node_connected ? "" : " (unreachable)"),
          h("td", {}, d.gpus.length ? d.gpus.join(", ") : "—"),
          h("td", {}, sinceIso(d.created_at)),
          h("td", {},
            h("button", { type: "button", class: "secondary", onclick: () => follow(d.id) },
              "Logs"), " ",
            ended(d) ? "" : needs("operator", h("button", { type: "button", class: "danger", onclick: async (ev) => {
              ev.target.disabled = true;
              try { await call("POST", `/admin/deployments/${d.id}/stop`); await refresh(); }
              catch (err) { showError(err); ev.target.disabled = false; }
            } }, "Stop")))))));
  }

  async function follow(id) {
    for (const ctl of state.aborts) ctl.abort();
    state.aborts = [];
    const ctl = new AbortController();
    state.aborts.push(ctl);
    const out = h("pre", { class: "log", id: "log-output", tabindex: 0, "aria-live": "off" });
    logs.replaceChildren(h("h2", {}, `Log of ${id} (following)`), out);
    try {
      const response = await call("GET", `/admin/deployments/${id}/logs?follow=true&tail=200`,
        undefined, { raw: true, signal: ctl.signal });
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        out.append(decoder.decode(value, { stream: true }));
        out.scrollTop = out.scrollHeight;
      }
      out.append("\n— the log ended —\n");
    } catch (err) { showError(err); }
  }

  every(POLL_MS, refresh);
}

// Models: the registry (add a local file or folder, remove), pulls from the Hugging Face
// hub run by the leader (POST /admin/pulls, polled while one runs), and LoRA adapters.
function modelsPage(main) {
  const list = h("div", { id: "models" });
  const adapterList = h("div", { id: "adapters" });
  const pullList = h("div", { id: "pulls", "aria-live": "polite" });
  const name = h("input", { id: "model-name", required: true });
  const path = h("input", { id: "model-path", required: true, placeholder: "/models/x.gguf" });
  const node = h("input", { id: "model-node", placeholder: "optional: node label" });
  const form = h("form", { class: "inline", "aria-label": "Add a model", onsubmit: async (e) => {
    e.preventDefault();
    try {
      await call("POST", "/admin/models", { name: name.value, path: path.value,
        node: node.value || null });
      name.value = ""; path.value = ""; node.value = "";
      await refresh();
    } catch (err) { showError(err); }
  } }, h("label", {}, "Name", name), h("label", {}, "Path on the host", path),
  h("label", {}, "Node", node), h("button", { type: "submit" }, "Add"));

  const repo = h("input", { id: "pull-repo", required: true, placeholder: "org/model" });
  const pullName = h("input", { id: "pull-name", placeholder: "default: the repository" });
  const revision = h("input", { id: "pull-revision", placeholder: "default: main" });
  const pullBase = h("input", { id: "pull-base", placeholder: "adapters: the base model" });
  const pullForm = h("form", { class: "inline", "aria-label": "Pull from the hub",
    onsubmit: async (e) => {
      e.preventDefault();
      try {
        const job = await call("POST", "/admin/pulls", { repo: repo.value.trim(),
          name: pullName.value.trim() || null, revision: revision.value.trim() || null,
          base: pullBase.value.trim() || null });
        seen.set(job.id, job.state);
        repo.value = ""; pullName.value = ""; revision.value = ""; pullBase.value = "";
        clearError();
        await pollPulls();
      } catch (err) { showError(err); }
    } }, h("label", {}, "Hub repository", repo), h("label", {}, "Register as", pullName),
  h("label", {}, "Revision", revision), h("label", {}, "Base (for an adapter)", pullBase),
  h("button", { type: "submit" }, "Pull"));

  const adapterName = h("input", { id: "adapter-name", required: true });
  const adapterBase = h("select", { id: "adapter-base", required: true });
  const adapterPath = h("input", { id: "adapter-path", required: true,
    placeholder: "/adapters/x.gguf or a PEFT folder" });
  const adapterNode = h("input", { id: "adapter-node", placeholder: "optional: node label" });
  const adapterForm = h("form", { class: "inline", "aria-label": "Add an adapter",
    onsubmit: async (e) => {
      e.preventDefault();
      try {
        await call("POST", "/admin/adapters", { name: adapterName.value,
          base: adapterBase.value, path: adapterPath.value, node: adapterNode.value || null });
        adapterName.value = ""; adapterPath.value = ""; adapterNode.value = "";
        await refresh();
      } catch (err) { showError(err); }
    } }, h("label", {}, "Adapter name", adapterName), h("label", {}, "Base model", adapterBase),
  h("label", {}, "Adapter path", adapterPath), h("label", {}, "Adapter node", adapterNode),
  h("button", { type: "submit" }, "Add adapter"));

  main.append(h("h1", {}, "Models and adapters"), needs("operator", form), list,
    h("h2", {}, "Pull from Hugging Face"),
    h("p", { class: "muted" }, "The leader downloads into its models folder, then registers " +
      "the model, or the adapter of an adapter repository."), needs("operator", pullForm), pullList,
    h("h2", {}, "LoRA adapters"), needs("operator", adapterForm), adapterList);

  let labels = {};
  async function refresh() {
    const [models, adapters, nodes] = await Promise.all([call("GET", "/admin/models"),
      call("GET", "/admin/adapters"), call("GET", "/admin/nodes")]);
    labels = Object.fromEntries(nodes.map((n) => [n.id, n.label]));
    const chosen = adapterBase.value;
    adapterBase.replaceChildren(...models.map((m) => h("option", { value: m.name }, m.name)));
    if (models.some((m) => m.name === chosen)) adapterBase.value = chosen;
    list.replaceChildren(models.length === 0 ? h("p", { class: "muted" }, "No models.") :
      table(["name", "path", "source", "size", "on nodes", ""], models.map((m) =>
        h("tr", { "data-model": m.name }, h("td", {}, m.name), h("td", { class: "mono" }, m.path),
          h("td", {}, m.repo_id ? `hub: ${m.repo_id}` : m.source),
          h("td", {}, m.size_bytes ? bytesText(m.size_bytes) : "—"),
          h("td", {}, Object.keys(m.locations || {}).map((id) => labels[id] || id).join(", ") || "—"),
          h("td", {}, needs("operator", h("button", { type: "button", class: "danger",
            "aria-label": `Remove model ${m.name}`, onclick: async () => {
              try { await call("DELETE", `/admin/models/${encodeURIComponent(m.name)}`); await refresh(); }
              catch (err) { showError(err); }
            } }, "Remove")))))));
    adapterList.replaceChildren(adapters.length === 0 ? h("p", { class: "muted" }, "No adapters.") :
      table(["name", "base model", "format", "source", "path", "loaded on", ""], adapters.map((a) =>
        h("tr", { "data-adapter": a.name }, h("td", {}, a.name), h("td", {}, a.base),
          h("td", {}, a.rank ? `${a.format}, rank ${a.rank}` : a.format),
          h("td", {}, a.repo_id ? `hub: ${a.repo_id}` : a.source),
          h("td", { class: "mono" }, Object.entries(a.locations || {}).map(([id, p]) =>
            `${labels[id] || id}: ${p}`).join("\n") || "—"),
          h("td", { class: "loaded" }, a.loaded_on.length === 0 ? "not loaded" :
            a.loaded_on.map((l) => `${l.deployment_id} on ${labels[l.node_id] || l.node_id}`).join(", ")),
          h("td", {}, needs("operator", h("button", { type: "button", class: "danger",
            "aria-label": `Remove adapter ${a.name}`, onclick: async () => {
              try { await call("DELETE", `/admin/adapters/${encodeURIComponent(a.name)}`); await refresh(); }
              catch (err) { showError(err); }
            } }, "Remove")))))));
  }

  // Polled each second while a pull runs (and every 5 s otherwise, for pulls started
  // elsewhere); a pull that reaches "done" refreshes the lists above.
  const finished = new Set(["done", "failed", "cancelled"]);
  const seen = new Map();
  let timer = null;
  async function pollPulls() {
    const jobs = await call("GET", "/admin/pulls");
    let reload = false;
    for (const job of jobs) {
      if (job.state === "done" && seen.has(job.id) && seen.get(job.id) !== "done") reload = true;
      seen.set(job.id, job.state);
    }
    pullList.replaceChildren(jobs.length === 0 ? "" : table(
      ["repository", "name", "state", "progress", ""], jobs.slice().reverse().map(pullRow)));
    if (reload) await refresh();
    const busy = jobs.some((j) => !finished.has(j.state));
    if (timer) clearTimeout(timer);
    timer = setTimeout(() => { if (state.page === "models") pollPulls().catch(showError); },
      busy ? 1000 : POLL_MS);
    state.timers.push(timer);
  }
  function pullRow(job) {
    const total = job.total_bytes;
    const fraction = total ? job.done_bytes / total : (job.state === "done" ? 1 : 0);
    const label = `pull of ${job.repo}: ${total === null ? "listing files" :
      `${bytesText(job.done_bytes)} of ${bytesText(total)}`}`;
    const bar = h("progress", { max: 100, value: Math.round(fraction * 100), "aria-label": label });
    const files = job.files.filter((f) => f.done_bytes < f.size_bytes).map((f) => f.path);
    return h("tr", { "data-pull": job.id, "data-state": job.state },
      h("td", {}, job.repo, job.revision ? `@${job.revision}` : ""), h("td", {}, job.name),
      h("td", { class: "pull-state" }, statusText(job.state), job.kind ? ` (${job.kind})` : "",
        job.error ? h("span", { class: "error-text" }, `: ${job.error}`) : ""),
      h("td", { class: "pull-progress" }, bar, " ",
        total === null ? "—" :
          `${bytesText(job.done_bytes)} of ${bytesText(total)} (${Math.round(fraction * 100)}%)`,
        !finished.has(job.state) && files.length ? h("div", { class: "muted" },
          `now: ${files.join(", ")}`) : ""),
      h("td", {}, needs("operator", h("button", { type: "button", class: finished.has(job.state) ? "secondary" : "danger",
        "aria-label": `${finished.has(job.state) ? "Dismiss" : "Cancel"} pull of ${job.repo}`,
        onclick: async () => {
          try { await call("DELETE", `/admin/pulls/${encodeURIComponent(job.id)}`); await pollPulls(); }
          catch (err) { showError(err); }
        } }, finished.has(job.state) ? "Dismiss" : "Cancel"))));
  }
  refresh().catch(showError);
  pollPulls().catch(showError);
}

// Services and routes, and a dry-run placement (POST /admin/plan).
function servicesPage(main) {
  const services = h("div", { id: "services" });
  const routes = h("div", { id: "routes" });
  const target = h("input", { id: "plan-target", required: true, placeholder: "service or model" });
  const result = h("div", { id: "plan-result" });
  const form = h("form", { class: "inline", onsubmit: async (e) => {
    e.preventDefault();
    try {
      const plan = await call("POST", "/admin/plan", { target: target.value });
      result.replaceChildren(h("div", { class: "card" },
        h("h3", {}, plan.placed ? `Would run on ${plan.node_label}` : "Would not be placed"),
        facts([["model", plan.model], ["engine", plan.engine], ["GPUs", plan.gpus.join(", ") || "—"],
          ["estimate", plan.estimate ? plan.estimate.summary : (plan.estimate_problem || "—")],
          ["refusal", plan.refusal || "—"]]),
        h("ul", {}, plan.reasons.map((r) => h("li", {}, r)))));
    } catch (err) { showError(err); }
  } }, h("label", {}, "Target", target), h("button", { type: "submit" }, "Dry-run placement"));
  const editor = h("section", { id: "service-edit", "aria-label": "edit a service's scaling" });
  main.append(h("h1", {}, "Services and routes"), services, editor, h("h2", {}, "Routes"), routes,
    h("h2", {}, "Where would it go?"), form, result);

  every(POLL_MS, refresh);
  async function refresh() {
    const [list, rts] = await Promise.all([call("GET", "/admin/services"), call("GET", "/admin/routes")]);
    // The scaling controller's decisions come with each service's detail only.
    const svc = await Promise.all(list.map((s) =>
      call("GET", `/admin/services/${encodeURIComponent(s.name)}`)));
    services.replaceChildren(svc.length === 0 ? h("p", { class: "muted" }, "No services.") :
      table(["name", "model", "engine", "node", "ready", "replicas", "scaling", "decision", "routes", ""],
        svc.map((s) => h("tr", { "data-service": s.name },
          h("td", {}, s.name), h("td", {}, s.model), h("td", {}, s.engine),
          h("td", {}, s.node_label || "any"), h("td", {}, String(s.ready)),
          h("td", { class: "replicas" }, replicasText(s)),
          h("td", { class: "scaling" }, scalingText(s.scaling)),
          h("td", { class: "decision" }, decisionText("now", s.decision),
            s.last_decision ? h("br") : null,
            s.last_decision ? decisionText("last action", s.last_decision) : null),
          h("td", {}, s.routes.join(", ") || "—"),
          h("td", {}, needs("operator", h("button", { type: "button", class: "secondary",
            "aria-label": `Edit scaling of ${s.name}`, onclick: () => editScaling(s, editor, refresh) },
          "Edit")))))));
    routes.replaceChildren(rts.length === 0 ? h("p", { class: "muted" }, "No routes.") :
      table(["route", "services", "serving", "why"], rts.map((r) => h("tr", {},
        h("td", {}, r.name), h("td", {}, r.services.map((s) => `${s.service} (${s.ready} ready)`).join(", ")),
        h("td", {}, r.serving.join(", ") || "—"), h("td", {}, r.reason || "—")))));
  }
}

// The scaling settings of service ``s`` in a form (PATCH /admin/services/{name}); only the
// fields changed are sent, so a field left alone keeps its value.
function editScaling(s, editor, refresh) {
  const scaling = s.scaling;
  const number = (id, value, min) => h("input", { id, type: "number", min, inputmode: "numeric",
    value: value === null || value === undefined ? "" : String(value) });
  const minReplicas = number("scale-min", scaling.min_replicas, 0);
  const maxReplicas = number("scale-max", scaling.max_replicas, 0);
  const idleShown = scaling.idle_timeout_s === null ? "never" : durationText(scaling.idle_timeout_s);
  const idle = h("input", { id: "scale-idle", value: idleShown, placeholder: "10m, 1h or never" });
  const priority = number("scale-priority", scaling.priority);
  const capacity = number("scale-capacity", scaling.capacity, 1);
  const pinned = h("input", { id: "scale-pinned", type: "checkbox", checked: scaling.pinned });
  const errorBox = h("p", { class: "error", role: "alert", id: "service-edit-error" });
  const whole = (input, label) => {
    const text = input.value.trim();
    if (!/^-?\d+$/.test(text)) throw new Error(`${label}: give a whole number`);
    return Number(text);
  };
  const editForm = h("form", { class: "card edit", "aria-labelledby": "service-edit-title",
    onsubmit: async (e) => {
      e.preventDefault();
      errorBox.textContent = "";
      const body = {};
      try {
        if (minReplicas.value !== String(scaling.min_replicas)) body.min_replicas = whole(minReplicas, "min replicas");
        if (maxReplicas.value !== String(scaling.max_replicas)) body.max_replicas = whole(maxReplicas, "max replicas");
        if (idle.value.trim() !== idleShown) body.idle_timeout = idle.value.trim();
        if (priority.value !== String(scaling.priority)) body.priority = whole(priority, "priority");
        const cap = scaling.capacity === null ? "" : String(scaling.capacity);
        if (capacity.value.trim() !== cap) {
          if (capacity.value.trim() === "") throw new Error("capacity: give a number of 1 or more (it cannot be cleared here)");
          body.capacity = whole(capacity, "capacity");
        }
        if (pinned.checked !== scaling.pinned) body.pinned = pinned.checked;
      } catch (err) { errorBox.textContent = err.message; return; }
      await saveEdit(editor, errorBox, `/admin/services/${encodeURIComponent(s.name)}`, body,
        "service-edit-done", `Scaling of ${s.name} saved.`, refresh);
    } },
  h("h2", { id: "service-edit-title" }, `Scaling of ${s.name}`),
  h("div", { class: "limit-row" }, h("label", { for: minReplicas.id }, "Min replicas"), minReplicas),
  h("div", { class: "limit-row" }, h("label", { for: maxReplicas.id }, "Max replicas"), maxReplicas),
  h("div", { class: "limit-row" }, h("label", { for: idle.id }, "Idle timeout"), idle,
    h("span", { class: "muted" }, "e.g. 10m, 1h; never: stays loaded")),
  h("div", { class: "limit-row" }, h("label", { for: priority.id }, "Priority"), priority),
  h("div", { class: "limit-row" }, h("label", { for: capacity.id }, "Capacity per replica"), capacity,
    h("span", { class: "muted" }, "empty: the engine's slots")),
  h("div", { class: "limit-row" }, h("label", { for: pinned.id }, "Pinned"), pinned,
    h("span", { class: "muted" }, "never evicted to make room")),
  errorBox,
  h("div", { class: "actions" }, h("button", { type: "submit" }, "Save scaling"), " ",
    h("button", { type: "button", class: "secondary", onclick: () => editor.replaceChildren() },
      "Cancel")));
  editor.replaceChildren(editForm);
  minReplicas.focus();
}

// "1 (min 0, max 2): 1 loading, 3 queued": active replicas, the bounds, by state.
function replicasText(s) {
  const counts = Object.entries(s.replicas || {});
  const active = counts.reduce((sum, [, n]) => sum + n, 0);
  const states = counts.map(([name, n]) => `${n} ${name}`).join(", ");
  return `${active} (min ${s.scaling.min_replicas}, max ${s.scaling.max_replicas})` +
    (states ? `: ${states}` : "") + (s.queued ? `, ${s.queued} queued` : "");
}

function scalingText(scaling) {
  const idle = scaling.idle_timeout_s === null ? "never idles out"
    : `idle out after ${ago(scaling.idle_timeout_s)}`;
  return [idle, scaling.pinned ? "pinned" : "not pinned", `priority ${scaling.priority}`,
    `${scaling.replica_capacity} per replica${scaling.capacity === null ? " (engine slots)" : ""}`]
    .join(", ");
}

function decisionText(label, decision) {
  if (!decision) return h("span", { class: "muted" }, `${label}: —`);
  const ids = decision.deployment_ids.length ? ` ${decision.deployment_ids.join(", ")}` : "";
  return h("span", { "data-action": decision.action }, `${label}: `,
    h("strong", {}, decision.action), `${ids}: ${decision.reason} (${sinceIso(decision.at)} ago)`);
}

// Keys: create (the secret shown once), revoke, edit a key's limits and expiry (PATCH
// /admin/keys/{id}); each key's limits and what it uses now (GET /admin/keys), and usage
// from the ledger over a chosen window, by key, model, day or node (GET /admin/usage).
function keysPage(main) {
  const list = h("div", { id: "keys" });
  const secretBox = h("div", { id: "new-secret", "aria-live": "polite" });
  const editor = h("section", { id: "key-edit", "aria-label": "edit a key" });
  const usage = h("div", { id: "usage" });
  const name = h("input", { id: "key-name", required: true });
  const tier = h("select", { id: "key-tier" },
    h("option", { value: "standard" }, "standard"),
    needs("admin", h("option", { value: "admin" }, "admin")));
  const form = h("form", { class: "inline", onsubmit: async (e) => {
    e.preventDefault();
    try {
      const created = await call("POST", "/admin/keys", { name: name.value, tier: tier.value });
      secretBox.replaceChildren(h("div", { class: "card" },
        h("p", {}, `Key ${created.name} created. Copy its secret now: it is not shown again.`),
        h("div", { class: "secret", id: "key-secret" }, created.secret)));
      name.value = "";
      await refresh();
    } catch (err) { showError(err); }
  } }, h("label", {}, "Name", name), h("label", {}, "Tier", tier),
  h("button", { type: "submit" }, "Create key"));
  const windowSelect = h("select", { id: "usage-window", onchange: () => refreshUsage().catch(showError) },
    [["1d", "today"], ["7d", "last 7 days"], ["30d", "last 30 days"], ["90d", "last 90 days"]]
      .map(([value, text]) => h("option", { value, selected: value === "30d" }, text)));
  const groupSelect = h("select", { id: "usage-group", onchange: () => refreshUsage().catch(showError) },
    [["all", "key, model and day"], ["key", "key"], ["model", "model"], ["day", "day"],
      ["node", "node"]].map(([value, text]) => h("option", { value }, text)));
  const usageForm = h("form", { class: "inline", "aria-label": "usage window",
    onsubmit: (e) => e.preventDefault() },
  h("label", {}, "Window (UTC days)", windowSelect), h("label", {}, "Group by", groupSelect));
  main.append(h("h1", {}, "Keys and usage"), needs("operator", form), secretBox, list, editor,
    h("h2", {}, "Usage"), usageForm, usage);

  async function refresh() {
    const keys = await call("GET", "/admin/keys");
    list.replaceChildren(table(["name", "tier", "prefix", "limits", "now", "created", "state", ""],
      keys.map((k) => h("tr", { "data-key": k.name }, h("td", {}, k.name), h("td", {}, k.tier),
        h("td", { class: "mono" }, k.prefix),
        h("td", { class: "limits" }, limitsText(k.limits, k.overridden)),
        h("td", { class: "use" }, useText(k.use)),
        h("td", { class: "created" }, `${sinceIso(k.created_at)} ago`,
          k.expires_at ? `, expires ${new Date(k.expires_at).toLocaleString()}` : ""),
        h("td", {}, k.revoked_at ? statusText("revoked") : statusText("active")),
        h("td", {}, k.revoked_at ? "" : needs(k.tier === "admin" ? "admin" : "operator", h("span", {},
          h("button", { type: "button", class: "secondary", "aria-label": `Edit limits of ${k.name}`,
            onclick: () => editKey(k) }, "Edit"), " ",
          h("button", { type: "button", class: "danger",
            "aria-label": `Revoke ${k.name}`, onclick: async () => {
              if (!confirm(`Revoke key ${k.name}? Clients using it stop working at once.`)) return;
              try { await call("DELETE", `/admin/keys/${k.id}`); await refresh(); }
              catch (err) { showError(err); }
            } }, "Revoke"))))))));
  }

  // One field per limit: the key's own value, or (checked) its tier's. Typing in a field
  // makes it the key's own; an empty field is "no limit".
  function editKey(key) {
    const own = new Set(key.overridden || []);
    const fields = [];
    const rows = LIMIT_FIELDS.map(([field, label]) => {
      const current = key.limits[field];
      const shown = current === null || current === undefined ? "" :
        (Array.isArray(current) ? current.join(", ") : String(current));
      const input = h("input", { id: `limit-${field}`, value: shown,
        type: field === "models" ? "text" : "number", min: field === "models" ? null : 0,
        placeholder: "no limit", inputmode: field === "models" ? null : "numeric" });
      const inherit = h("input", { type: "checkbox", id: `limit-${field}-tier`,
        checked: !own.has(field) });
      input.addEventListener("input", () => { inherit.checked = false; });
      fields.push({ field, input, inherit });
      return h("div", { class: "limit-row" }, h("label", { for: input.id }, label), input,
        h("label", { for: inherit.id, class: "check" }, inherit, "tier's"));
    });
    const initialExpiry = key.expires_at ? localInput(key.expires_at) : "";
    const expiry = h("input", { id: "key-expiry", type: "datetime-local", value: initialExpiry });
    const errorBox = h("p", { class: "error", role: "alert", id: "key-edit-error" });
    const editForm = h("form", { class: "card edit", "aria-labelledby": "key-edit-title",
      onsubmit: async (e) => {
        e.preventDefault();
        errorBox.textContent = "";
        const body = { clear: [] };
        for (const { field, input, inherit } of fields) {
          if (inherit.checked) {
            if (own.has(field)) body.clear.push(field);
            continue;
          }
          const text = input.value.trim();
          if (field === "models") {
            body.models = text ? text.split(",").map((x) => x.trim()).filter(Boolean) : null;
          } else if (text === "") {
            body[field] = null;
          } else if (!/^\d+$/.test(text)) {
            errorBox.textContent = `${field}: give a whole number of 0 or more, or leave it empty for no limit`;
            input.focus();
            return;
          } else {
            body[field] = Number(text);
          }
        }
        if (expiry.value !== initialExpiry) {
          body.expires_at = expiry.value ? new Date(expiry.value).toISOString() : null;
        }
        await saveEdit(editor, errorBox, `/admin/keys/${key.id}`, body, "key-edit-done",
          `Limits of ${key.name} saved.`, refresh);
      } },
    h("h2", { id: "key-edit-title" }, `Limits of ${key.name}`),
    h("p", { class: "muted" }, "A field left to the tier's follows the tier; an empty field is no limit; " +
      "models: names separated by commas."),
    rows, h("div", { class: "limit-row" }, h("label", { for: expiry.id }, "Expires (local time)"), expiry,
      h("span", { class: "muted" }, "empty: never")),
    errorBox,
    h("div", { class: "actions" }, h("button", { type: "submit" }, "Save limits"), " ",
      h("button", { type: "button", class: "secondary", onclick: () => editor.replaceChildren() },
        "Cancel")));
    editor.replaceChildren(editForm);
    fields[0].input.focus();
  }

  async function refreshUsage() {
    const since = windowSelect.value;
    const group = groupSelect.value;
    const groupings = group === "all" ? ["key", "model", "day"] : [group];
    const reports = await Promise.all(groupings.map((by) =>
      call("GET", `/admin/usage?since=${encodeURIComponent(since)}&by=${by}`)));
    const first = reports[0];
    const t = first.total;
    const titles = { key: "By key", model: "By model", day: "By day", node: "By node" };
    const names = { key: (r) => r.key || r.key_id, model: (r) => r.model, day: (r) => r.day,
      node: (r) => r.node_id };
    usage.replaceChildren(
      h("p", { class: "muted", id: "usage-total" }, `${first.since} to ${first.until}: ` +
        `${t.requests} requests (${t.errors} errors), ${t.total_tokens} tokens ` +
        `(${t.prompt_tokens} in, ${t.completion_tokens} out` +
        `${t.estimated_tokens ? `, ${t.estimated_tokens} estimated` : ""}).`),
      ...groupings.map((by, i) => usageBars(titles[by],
        reports[i].rows.map((r) => [names[by](r), r]), `usage-by-${by}`)));
  }
  refresh().catch(showError);
  every(POLL_MS, refreshUsage);
}

// An ISO time as a datetime-local input's value (the browser's time zone).
function localInput(iso) {
  const at = new Date(iso);
  const pad = (n) => String(n).padStart(2, "0");
  return `${at.getFullYear()}-${pad(at.getMonth() + 1)}-${pad(at.getDate())}T` +
    `${pad(at.getHours())}:${pad(at.getMinutes())}`;
}

const LIMIT_FIELDS = [["rpm", "Requests per minute"], ["tpm", "Tokens per minute"],
  ["max_concurrency", "Max concurrency"], ["daily_tokens", "Tokens per day"],
  ["monthly_tokens", "Tokens per month"], ["models", "Models"]];

const LIMIT_NAMES = [["rpm", "rpm"], ["tpm", "tpm"], ["max_concurrency", "concurrent"],
  ["daily_tokens", "tokens/day"], ["monthly_tokens", "tokens/month"]];

// A key's limits, one line: "60 rpm, 8 concurrent*, models: a, b" (* = the key's own, the
// rest its tier's); "no limits" when it has none.
function limitsText(limits, overridden) {
  const own = new Set(overridden || []);
  const mark = (field) => (own.has(field) ? "*" : "");
  const parts = LIMIT_NAMES.filter(([field]) => limits[field] !== null && limits[field] !== undefined)
    .map(([field, label]) => `${limits[field]} ${label}${mark(field)}`);
  if (limits.models) parts.push(`models${mark("models")}: ${limits.models.join(", ") || "none"}`);
  return parts.length ? parts.join(", ") : "no limits";
}

function useText(use) {
  const parts = [`${use.in_flight} in flight`, `${use.day_tokens} tokens today`];
  // The per-minute limits are buckets refilled continuously (docs/quotas.md).
  if (use.requests_remaining !== null) {
    parts.push(`${use.requests_remaining} requests in its rpm bucket`);
  }
  if (use.tokens_remaining !== null) parts.push(`${use.tokens_remaining} tokens in its tpm bucket`);
  return parts.join(", ");
}

function usageBars(title, groups, id) {
  const max = Math.max(1, ...groups.map(([, r]) => r.total_tokens));
  return h("section", { id, "aria-label": title }, h("h3", {}, title),
    groups.length === 0 ? h("p", { class: "muted" }, "No usage yet.") :
      h("div", { class: "bars" }, groups.map(([name, r]) => h("div", { class: "bar", "data-name": name },
        h("span", {}, name), meter(r.total_tokens / max, "util", `${name}: ${r.total_tokens} tokens`),
        h("span", { class: "mono" }, `${r.requests} req, ${r.total_tokens} tok` +
          (r.errors ? `, ${r.errors} err` : ""))))));
}

// Requests: the leader's ring of recent requests, polled for what is new.
function requestsPage(main) {
  const rows = [];
  const body = h("tbody", { id: "request-rows" });
  let after = 0;
  let labels = null; // node id -> label, read before the first rows are drawn
  const filter = h("input", { id: "request-filter", type: "search",
    placeholder: "key, model, node or status", oninput: () => draw() });
  const draw = () => {
    const wanted = filter.value.trim().toLowerCase();
    body.replaceChildren(...rows.filter((row) => !wanted || row.textContent.toLowerCase().includes(wanted)));
  };
  main.append(h("h1", {}, "Requests"),
    h("p", { class: "muted" }, "Recent /v1 requests, newest first. No prompt or answer is kept."),
    h("form", { class: "inline", onsubmit: (e) => e.preventDefault() },
      h("label", {}, "Filter", filter)),
    h("div", { class: "table-wrap" }, h("table", {},
      h("thead", {}, h("tr", {}, ["time", "key", "model", "node", "status", "TTFB", "duration",
        "tokens in/out", "retries"].map((x) => h("th", { scope: "col" }, x)))), body)));
  every(2000, async () => {
    if (labels === null) {
      const nodes = await call("GET", "/admin/nodes");
      labels = Object.fromEntries(nodes.map((n) => [n.id, n.label]));
    }
    const page = await call("GET", `/admin/requests?after=${after}&limit=200`);
    after = page.last_seq;
    for (const r of page.requests) {
      rows.unshift(h("tr", { "data-request": r.request_id },
        h("td", {}, new Date(r.at * 1000).toLocaleTimeString()), h("td", {}, r.key_name || "(socket)"),
        h("td", {}, r.model), h("td", {}, labels[r.node] || r.node || "—"),
        h("td", {}, String(r.status), r.error_reason ? ` ${r.error_reason}` : ""),
        h("td", {}, r.ttfb_ms === null ? "—" : `${r.ttfb_ms} ms`), h("td", {}, `${r.duration_ms} ms`),
        h("td", {}, `${r.prompt_tokens}/${r.completion_tokens}`),
        h("td", {}, r.retries.length ? `${r.retries.length}: ${r.retries.join(", ")}` : "0")));
    }
    rows.splice(500);
    draw();
  });
}

// Playground: a streamed chat with any served model.
function playgroundPage(main) {
  const model = h("select", { id: "chat-model", required: true });
  const prompt = h("textarea", { id: "chat-prompt", rows: 3, required: true });
  const log = h("div", { class: "chat", id: "chat-log", "aria-live": "polite" });
  const history = [];
  const form = h("form", { class: "inline", onsubmit: async (e) => {
    e.preventDefault();
    const text = prompt.value.trim();
    if (!text) return;
    prompt.value = "";
    history.push({ role: "user", content: text });
    log.append(h("div", { class: "msg user" }, text));
    const answer = h("div", { class: "msg assistant" });
    log.append(answer);
    const ctl = new AbortController();
    state.aborts.push(ctl);
    try {
      const response = await call("POST", "/v1/chat/completions",
        { model: model.value, messages: history, stream: true }, { raw: true, signal: ctl.signal });
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue;
            const data = line.slice(5).trim();
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message || "the engine failed");
            const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
            if (delta && delta.content) answer.append(delta.content);
          }
        }
      }
      answer.dataset.done = "true";
      history.push({ role: "assistant", content: answer.textContent });
    } catch (err) { showError(err); }
  } }, h("label", {}, "Model", model), h("label", {}, "Message", prompt),
  h("button", { type: "submit" }, "Send"));
  main.append(h("h1", {}, "Playground"), log, form);
  call("GET", "/v1/models").then((list) => {
    model.replaceChildren(...list.data.map((m) => h("option", { value: m.id }, m.id)));
  }).catch(showError);
}

const PAGES = {
  overview: overviewPage,
  cluster: clusterPage,
  deployments: deploymentsPage,
  models: modelsPage,
  services: servicesPage,
  keys: keysPage,
  requests: requestsPage,
  playground: playgroundPage,
};

// -- start ------------------------------------------------------------------------------------

async function start() {
  document.getElementById("signin-form").addEventListener("submit", signIn);
  document.getElementById("signout").addEventListener("click", signOut);
  window.addEventListener("hashchange", route);
  for (;;) {
    try {
      const current = await call("GET", "/ui/session");
      if (current.signed_in) showApp(current.session);
      else showSignIn("");
      return;
    } catch (_) {
      await new Promise((resolve) => setTimeout(resolve, POLL_MS)); // the leader is away
    }
  }
}

document.addEventListener("DOMContentLoaded", start);
